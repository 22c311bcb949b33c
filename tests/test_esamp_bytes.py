"""Bytes an ESamp update moves per distiller parameter, counted from the tensor sizes of the
operations it dispatches (``benchmarks/bytes_count.py``), at the benchmark's CPU shapes
(SmolLM2's hidden 576, the default distiller, 8 groups x 16 rows). The bounds and how they
were reached: docs/consumers/esamp.md, "On a GPU"."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bytes_count import BytesCounter  # noqa: E402
from gpu_distiller import update_bytes_per_param  # noqa: E402

# PyTorch's fused Adam reads parameter, gradient and both moments and writes all four (the
# gradient is a mutable argument of its schema): 32 bytes per fp32 parameter. The CUDA
# path's grad_adam forms the gradient inside the kernel: 24 (parameter and moments read and
# written once) plus its thin factors.
ADAM_FLOOR = 32
GRAD_ADAM_FLOOR = 24
MAX_BYTES_PER_PARAM = {"graph_update": 34.5, "host_update": 44}
MAX_ADAM = {"graph_update": GRAD_ADAM_FLOOR + 0.5, "host_update": ADAM_FLOOR + 0.01}


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
