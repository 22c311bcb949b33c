"""Bytes an ESamp update moves per distiller parameter, counted from the tensor sizes of the
operations it dispatches (``tllm_core.testing.counters``), at the benchmark's CPU shapes
(SmolLM2's hidden 576, the default distiller, 8 groups x 16 rows). The bounds and how they
were reached: docs/consumers/esamp.md, "On a GPU"."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from tllm_core.testing.counters import BytesCounter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from gpu_distiller import update_bytes_per_param, update_graphs  # noqa: E402

# PyTorch's fused Adam reads parameter, gradient and both moments and writes all four (the
# gradient is a mutable argument of its schema): 32 bytes per fp32 parameter. The CUDA
# path's grad_adam forms the gradient inside the kernel: 24 (parameter and moments read and
# written once) plus its thin factors.
ADAM_FLOOR = 32
GRAD_ADAM_FLOOR = 24
# graph_update_reuse: on the forward the step's prediction kept (the weights are not read
# for a forward); *_bf16: Adam's moments in bf16 (grad_adam's floor 16).
MAX_BYTES_PER_PARAM = {
    "graph_update": 32.5,
    "graph_update_reuse": 28.0,
    "graph_update_bf16": 24.5,
    "graph_update_reuse_bf16": 20.0,
    "host_update": 44,
}
# The captured graphs' launches (issue 36: "about ten"): the fused loss, per-block backward
# and tail kernels, gate and up in one product and one Adam launch (unfused: 24, 107, 93).
MAX_LAUNCHES = {"predict": 11, "train": 21, "train_reuse": 13}
MAX_ADAM = {
    "graph_update": GRAD_ADAM_FLOOR + 0.5,
    "graph_update_reuse": GRAD_ADAM_FLOOR + 0.5,
    "graph_update_bf16": 16.5,
    "graph_update_reuse_bf16": 16.5,
    "host_update": ADAM_FLOOR + 0.01,
}
# The backward reads 4 of the 6 weight matrices (both blocks' down, the last block's gate
# and up, to carry the gradient back): fp32, 4 * 4/6 bytes per parameter.
BACKWARD_WEIGHT_READS = 4 * 4 / 6


def test_the_counter_counts_reads_and_writes_not_views():
    x, y = torch.zeros(100), torch.zeros(100)
    w, g, m, v = (torch.ones(100) for _ in range(4))
    step = torch.ones(())
    with BytesCounter() as bc:
        x.add_(y)  # reads x and y, writes x: 1200 bytes
        z = x + y  # reads x and y, writes z: 1200
        torch.add(x, y, out=z)  # the out= tensor is written, not read: 1200
        x.view(10, 10).t()  # views move nothing
        torch._fused_adam_(
            [w], [g], [m], [v], [], [step], lr=0.1, beta1=0.9, beta2=0.99,
            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip
    assert bc.by_op["add_"] == bc.by_op["add"] / 2 == 1200
    assert bc.by_op["_fused_adam_"] == 100 * ADAM_FLOOR + 4  # and the step count, read
    assert set(bc.by_op) == {"add_", "add", "_fused_adam_"}


def test_update_bytes_per_param_at_the_benchmark_shapes():
    args = SimpleNamespace(hidden=576, intermediate=384, blocks=2, groups=8, rows=16)
    got = update_bytes_per_param(args, torch.device("cpu"))
    print(f"bytes per parameter: {got}")
    for path, bound in MAX_BYTES_PER_PARAM.items():
        assert got[f"{path}_adam"] <= MAX_ADAM[path], got
        assert got[path] <= bound, got
    # Reusing the prediction's forward saves at least its weight reads (4 bytes each)...
    for moments in ("", "_bf16"):
        assert got[f"graph_update{moments}"] - got[f"graph_update_reuse{moments}"] >= 4, got
        assert got[f"graph_update_reuse{moments}_ops"] < got[f"graph_update{moments}_ops"]
    # ... and what is left is Adam, the backward's weight reads and the activations' traffic
    # (0.6 bytes per parameter at these shapes, 0.4 at 7B: it scales as 1/H + 1/I). The
    # issue's 26 holds with bf16 moments; with fp32 ones the floor itself is above 26.
    for moments in ("", "_bf16"):
        floor = got[f"graph_update_reuse{moments}_adam"] + BACKWARD_WEIGHT_READS
        assert floor < got[f"graph_update_reuse{moments}"] <= floor + 2, got
    assert got["graph_update_reuse_bf16"] <= 26 < GRAD_ADAM_FLOOR + BACKWARD_WEIGHT_READS


def test_the_update_graphs_as_captured():
    """The CUDA distiller's captured update graphs as a whole (row packing, mask and result
    ring included; the fake CUDA device counts them): the reuse graph launches fewer
    operations and moves what train_groups' count says, plus the packing."""
    args = SimpleNamespace(hidden=576, intermediate=384, blocks=2, groups=8, rows=16)
    got = update_graphs(args)
    print(f"update graphs: {got}")
    assert got["train_reuse_launches"] < got["train_launches"]
    for kind, most in MAX_LAUNCHES.items():
        assert got[f"{kind}_launches"] <= most, got
    assert got["train_bytes_per_param"] - got["train_reuse_bytes_per_param"] >= 4, got
    assert got["train_reuse_bytes_per_param"] <= MAX_BYTES_PER_PARAM["graph_update_reuse"] + 0.2
