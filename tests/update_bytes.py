"""Bytes an ESamp update moves per distiller parameter, counted from the tensor sizes of the
operations it dispatches (``tllm_core.testing.counters.BytesCounter``; device independent,
counted on the meta device), and the CUDA distiller's captured graphs counted on the fake
CUDA device. Used by ``tests/test_esamp_bytes.py`` and the GPU benchmarks
(``benchmarks/gpu_distiller.py --bytes-only``, ``benchmarks/gpu_smoke.py``). ``args``: the
benchmark's shape (``hidden``, ``intermediate``, ``blocks``, ``groups``, ``rows``)."""

from __future__ import annotations

import torch

from algorithms.esamp.cpu import GroupedDistiller
from tllm_core.testing.counters import BytesCounter


def distiller_inputs(args, device):
    """Slot per row, inputs and targets of ``args.groups`` groups of ``args.rows`` rows (empty
    on the meta device)."""
    rows = args.groups * args.rows
    if device.type == "meta":
        x = torch.empty(rows, args.hidden, device=device)
        return torch.arange(args.groups).repeat_interleave(args.rows), x, x.clone()
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, args.hidden, generator=g).to(device)
    t = x + 0.1 * torch.randn(rows, args.hidden, generator=g).to(device)
    slots = torch.arange(args.groups).repeat_interleave(args.rows)
    return slots, x, t


def update_bytes_per_param(args, device) -> dict[str, float]:
    """Bytes per parameter and group of one update of ``args.groups`` groups of ``args.rows``
    rows: the update the CUDA graphs replay (``graph_update``: the slot-indexed products and
    the fused gradient + Adam operator, each counted as one operation with its arguments;
    ``graph_update_reuse``: the same on the forward the step's prediction kept, as ESamp runs
    it when the trained rows are the predicted ones; ``*_bf16``: with bf16 Adam moments) and
    the CPU trainer (after a prediction of the same rows, as ESamp runs it); ``*_ops``: operations dispatched."""
    from algorithms.esamp.graph_update import slot_matmul, train_groups
    from algorithms.esamp.mlp import forward_slots

    # Counted from the operations' tensor sizes: the meta device gives the same counts as a
    # GPU without computing anything; the CPU trainer's part runs on CPU.
    meta = torch.device("meta")
    slots, x, t = distiller_inputs(args, meta)
    d = GroupedDistiller(
        args.hidden,
        device=meta,
        intermediate_size=args.intermediate,
        num_blocks=args.blocks,
        capacity=args.groups,
    )
    per = args.groups * d.shape.num_params
    out: dict[str, float] = {}
    shape = (args.groups, args.rows, args.hidden)
    xp, tp = x.view(shape), t.view(shape)
    gs = torch.arange(args.groups, device=meta)
    mask = torch.ones(args.groups, args.rows, dtype=torch.bool, device=meta)
    # What the prediction computed and, on CUDA, kept (not part of the update): in buffers
    # laid out as the CUDA distiller's (packed inputs and block outputs equally spaced).
    nb, inter = args.blocks, args.intermediate
    hs = torch.empty(nb + 1, *shape, device=meta)
    inner = torch.empty(nb, 4, args.groups, args.rows, inter, device=meta)
    kept = [(hs[b + 1], *inner[b].unbind(0)) for b in range(nb)]

    def mm(x, w, transpose_w, **kw):
        return slot_matmul(x, w, gs, transpose_w, **kw)

    forward = forward_slots(d.theta, d.shape, hs[0], mm, out=kept)
    bf16 = [torch.empty_like(d.m, dtype=torch.bfloat16) for _ in range(2)]
    for name, (m, v), fwd in (
        ("graph_update", (d.m, d.v), None),
        ("graph_update_reuse", (d.m, d.v), forward),
        ("graph_update_bf16", bf16, None),
        ("graph_update_reuse_bf16", bf16, forward),
    ):
        with BytesCounter() as bc:
            train_groups(
                d.theta, m, v, d.step, gs, xp, tp, mask, d.shape, d.hp, forward=fwd
            )  # fmt: skip
        out[name] = bc.total / per
        out[f"{name}_adam"] = bc.by_op["grad_adam"] / per
        out[f"{name}_ops"] = bc.calls
    if device.type == "cpu":
        slots, x, t = distiller_inputs(args, device)
        d = GroupedDistiller(
            args.hidden, intermediate_size=args.intermediate, num_blocks=args.blocks,
            capacity=args.groups,
        )  # fmt: skip
        live = torch.tensor([d.alloc() for _ in range(args.groups)])[slots]
        d.predict(live, x)
        with BytesCounter() as bc:
            d.train_step(live, x, t)
        out["host_update"] = bc.total / per
        out["host_update_adam"] = bc.by_op["_fused_adam_"] / per
    return out


def update_graphs(args, moments_dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """The CUDA distiller's captured graphs for the layout of ``args.groups`` groups of
    ``args.rows`` rows, as a whole (row packing, mask and result ring included), counted on
    the fake CUDA device (``tllm_core.testing.fake_cuda``: launches = operations captured,
    bytes by the same rules as :func:`update_bytes_per_param`): ``{kind}_launches`` and
    ``{kind}_bytes_per_param`` for ``predict``, ``train`` (forward run again) and
    ``train_reuse`` (on the prediction's kept forward)."""
    from algorithms.esamp.cuda import CudaGroupedDistiller
    from tllm_core.testing.fake_cuda import FakeCuda

    with FakeCuda() as fc:
        d = CudaGroupedDistiller(
            args.hidden, device=fc.device, intermediate_size=args.intermediate,
            num_blocks=args.blocks, capacity=args.groups, graph_max_rows=args.rows,
            moments_dtype=moments_dtype,
        )  # fmt: skip
    lay = d.layouts[0]
    per = args.groups * d.shape.num_params
    out: dict[str, float] = {}
    for kind in ("predict", "train", "train_reuse"):
        g = d._graphs[(kind, lay)]
        out[f"{kind}_launches"] = g.launches
        out[f"{kind}_bytes_per_param"] = g.bytes / per
    return out
