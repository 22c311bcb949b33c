"""ESamp's distiller and its fused kernels timed at 7B-model shapes (PyTorch + Triton; no vLLM):

    python benchmarks/gpu_distiller.py [--hidden 3584] [--groups 8] [--rows 16] [--iters 200] [--json]
    python benchmarks/gpu_distiller.py --bytes-only [--json]                    # any machine
    python benchmarks/gpu_distiller.py --kernels [--quick] [--device cpu] [--bandwidth 4.26e12]

Default: the grouped distiller alone (:func:`bench_distiller`, each of
:func:`distiller_variants`) and the bytes one update moves per parameter and group, counted
on the meta device (``tests/update_bytes.py``; ``--bytes-only``: those and the captured
graphs' launches and bytes). ``--kernels``: ESamp's fused kernels alone against the bytes they
must move at ``--bandwidth`` (:func:`bench_kernels`). ``--device cpu``: the CPU distiller, to
check the script without a GPU. What the distiller adds to a decode step is measured with the
whole ESamp step: ``esamp_step.bench_step``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]


from bench_setup import code_version, section, table  # noqa: E402
from update_bytes import distiller_inputs, update_bytes_per_param, update_graphs  # noqa: E402

from algorithms.esamp.cpu import GroupedDistiller  # noqa: E402
from algorithms.esamp.kernels import (  # noqa: E402
    grad_adam,
    grad_adam_bytes,
    op_grad_adam,
    op_slot_matmul,
    slot_matmul,
    slot_matmul_bytes,
    triton_available,
)
from algorithms.esamp.memory_plan import MemoryPlan, default_slots, plan_memory  # noqa: E402
from algorithms.esamp.params import AdamHyper, DistillerShape, block_weights  # noqa: E402
from tllm_core.testing.fake_cuda import is_cuda  # noqa: E402

QWEN2_7B = dict(
    layers=28, hidden=3584, intermediate=18944, q_heads=28, kv_heads=4, head_dim=128, vocab=152064
)


def plan(args) -> MemoryPlan:
    """ESamp's memory plan for this workload: as many slots as groups (the consumer's
    default for rows_per_step = groups x rows), rows per group in the graph."""
    rows = args.groups * args.rows
    return plan_memory(
        args.hidden,
        QWEN2_7B["vocab"],
        slots=default_slots(rows, args.rows),
        graph_rows=args.rows,
        rows_per_step=rows,
        intermediate_size=args.intermediate,
        num_blocks=args.blocks,
    )


def distiller_variants(device: torch.device) -> list[str]:
    """``eager_main`` on CPU (the CPU distiller); on CUDA ``eager_side`` (side stream, no
    graphs), ``graph_main`` (graphs on the main stream) and ``graph_side`` (as ESamp runs it)."""
    return ["eager_side", "graph_main", "graph_side"] if is_cuda(device) else ["eager_main"]


def make(variant: str, args, device):
    """The distiller of ``variant`` (:func:`distiller_variants`) sized as the consumer sizes it."""
    kw = dict(
        intermediate_size=args.intermediate,
        num_blocks=args.blocks,
        capacity=plan(args).slots,  # the consumer's sizing, not a benchmark-only one
        seed=0,
    )
    if device.type == "cpu":
        return GroupedDistiller(args.hidden, device=device, **kw)
    from algorithms.esamp.cuda import CudaGroupedDistiller

    d = CudaGroupedDistiller(
        args.hidden,
        device=device,
        use_cuda_graph=variant.startswith("graph"),
        graph_max_rows=args.rows,
        **kw,
    )
    if variant.endswith("_main"):
        d.stream = torch.cuda.current_stream(device)  # no side stream: serialized
    return d


def time_us(
    fn: Callable[[], Any],
    iters: int,
    device: torch.device,
    warmup: int = 0,
    repeats: int = 1,
    settle: Callable[[], Any] = lambda: None,
) -> float:
    """Microseconds per call of ``fn``: ``warmup`` calls and ``settle()``, then the median over
    ``repeats`` of ``iters`` pipelined calls between CUDA events (wall time off CUDA)."""
    for _ in range(warmup):
        fn()
    settle()

    def once() -> float:
        if not is_cuda(device):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t0) * 1e6 / iters
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / iters

    return statistics.median(once() for _ in range(repeats))


def bench_distiller(variant: str, args, device) -> dict[str, float]:
    """Microseconds per ``predict``, ``train_step`` and both (``step_us``: the update on the
    prediction's forward, as ESamp runs it; ``step_rerun_forward_us``: the forward run again)."""
    d = make(variant, args, device)
    slots, x, t = distiller_inputs(args, device)
    slots = torch.tensor([d.alloc() for _ in range(args.groups)])[slots]

    def step(**same: Any) -> None:
        d.predict(slots, x, **same)
        d.train_step(slots, x, t, **same)

    cases = {
        "predict_us": lambda: d.predict(slots, x),
        "train_us": lambda: d.train_step(slots, x, t),
        "step_us": lambda: step(rows_id="step"),  # as ESamp names them
    }
    if not isinstance(d, GroupedDistiller):  # the CPU path compares the rows: always reuses
        cases["step_rerun_forward_us"] = step
    a = (args.iters, device, args.warmup, args.repeats, d.synchronize)
    res = {name: time_us(fn, *a) for name, fn in cases.items()}
    res["graph_failures"] = getattr(d, "graph_failures", 0)
    return res


# ---------------------------------------------------------------- the kernels alone
SHAPES_7B: dict[str, Any] = dict(
    hidden=3584, intermediate=384, blocks=2, rows=16, cases=((8, 8), (64, 64), (8, 64)),
    iters=20, warmup=3,
)  # fmt: skip
QUICK_SHAPES: dict[str, Any] = dict(
    hidden=48, intermediate=16, blocks=2, rows=4, cases=((2, 3),), iters=2, warmup=1
)
H200_BANDWIDTH = 4.26e12  # copy bandwidth measured on an H200, bytes/s
HP = AdamHyper()  # the distiller's defaults
ADAM_TILES = ((32, 128, 4), (64, 64, 4), (64, 128, 8), (16, 256, 4))  # block_n, block_k, warps
MATMUL_TILES = ((64, 64, 4), (32, 128, 4), (128, 64, 8))


class _Case:
    """State, factors and inputs of one ``(groups, capacity)`` case."""

    def __init__(self, shape: dict, groups: int, capacity: int, device: torch.device):
        h, rows = shape["hidden"], shape["rows"]
        self.shape = DistillerShape(h, shape["intermediate"], shape["blocks"])
        p = self.shape.num_params
        gen = torch.Generator(device=device).manual_seed(0)
        self.groups, self.capacity, self.rows = groups, capacity, rows
        self.live = torch.arange(groups, device=device) * (capacity // groups)
        self.theta = torch.randn(capacity, p, device=device, generator=gen) * 0.02
        self.m = torch.zeros(capacity, p, device=device)
        self.v = torch.zeros(capacity, p, device=device)
        self.step = torch.full((capacity,), 5.0, device=device)
        self.mats = [tuple(w.shape[1:]) for w in self.views(self.theta)]  # (N, K) each
        self.a = [torch.randn(groups, rows, n, device=device, generator=gen) for n, _ in self.mats]
        self.b = [torch.randn(groups, rows, k, device=device, generator=gen) for _, k in self.mats]
        self.scale = torch.full((groups,), 0.5, device=device)
        self.ok = torch.ones(groups, dtype=torch.bool, device=device)
        self.x = torch.randn(groups, rows, h, device=device, generator=gen)

    def views(self, state: torch.Tensor) -> list[torch.Tensor]:
        """Each weight matrix of ``state`` (parameters or a moment), ``[capacity, N, K]``."""
        return [w for block in block_weights(state, self.shape) for w in block]

    def fused(self, m, v, precision: str = "ieee", **tiles: int) -> None:
        """The fused gradient + Adam of every matrix; with ``tiles``: the Triton launch's."""
        mats = zip(self.a, self.b, *map(self.views, (self.theta, m, v)), strict=True)
        for a, b, w, mm, vv in mats:
            args = (a, b, self.scale, self.live, self.ok, self.step, w, mm, vv)
            if tiles:
                op_grad_adam.run_triton(*args, HP.lr, *HP.betas, HP.eps, precision, **tiles)
            else:
                grad_adam(*args, lr=HP.lr, betas=HP.betas, eps=HP.eps, input_precision=precision)

    def forward_products(self, out_i, out_h, split: int | None = None, **tiles: int) -> None:
        """The six weight products of one forward pass (inputs reused: only the weight reads
        matter), reading the live slots only; with ``tiles``: the Triton launch's."""
        for w in self.views(self.theta):
            x, out = (self.x, out_i) if w.shape[2] == self.x.shape[2] else (out_i, out_h)
            if tiles:
                op_slot_matmul.run_triton(x, w, self.live, out, True, "ieee", split, **tiles)
            else:
                slot_matmul(x, w, self.live, out, transpose_w=True)

    def dense_products(self, out_i, out_h) -> None:
        """``torch.bmm`` over every slot's views (dead slots included): what reading only the
        live slots saves."""
        xd = torch.zeros(self.capacity, self.rows, self.x.shape[2], device=self.x.device)
        xd[self.live] = self.x
        for w in self.views(self.theta):
            x, out = (xd, out_i) if w.shape[2] == xd.shape[2] else (out_i, out_h)
            torch.bmm(x, w.transpose(1, 2), out=out)


def _bench_case(shape: dict, groups: int, capacity: int, device, bandwidth: float) -> dict:
    c = _Case(shape, groups, capacity, device)

    def timed(fn: Any, nbytes: int, **extra: Any) -> dict[str, Any]:
        """ms per call of ``fn`` and its floor: ``nbytes`` moved at ``bandwidth``."""
        ms = time_us(fn, shape["iters"], device, shape["warmup"]) / 1e3
        floor_ms = nbytes / bandwidth * 1e3
        return dict(ms=ms, bytes=nbytes, floor_ms=floor_ms, x_floor=ms / floor_ms, **extra)

    params = groups * c.shape.num_params
    adam_bytes = sum(grad_adam_bytes(groups, c.rows, n, k) for n, k in c.mats)
    bf16_bytes = sum(grad_adam_bytes(groups, c.rows, n, k, 2) for n, k in c.mats)
    mm_bytes = sum(slot_matmul_bytes(groups, c.rows, n, k) for n, k in c.mats)
    res: dict[str, Any] = dict(groups=groups, capacity=capacity, rows=c.rows, params_updated=params)
    per_param = adam_bytes / params
    res["grad_adam"] = timed(lambda: c.fused(c.m, c.v), adam_bytes, bytes_per_param=per_param)
    res["grad_adam_tf32"] = timed(lambda: c.fused(c.m, c.v, "tf32"), adam_bytes)
    m16, v16 = c.m.bfloat16(), c.v.bfloat16()
    res["grad_adam_bf16"] = timed(
        lambda: c.fused(m16, v16), bf16_bytes, bytes_per_param=bf16_bytes / params
    )
    out_i = torch.zeros(capacity, c.rows, shape["intermediate"], device=device)
    out_h = torch.zeros(capacity, c.rows, shape["hidden"], device=device)
    c.dense_products(out_i, out_h)
    dense_h = out_h[c.live].clone()
    g_i, g_h = out_i[:groups].clone(), out_h[:groups].clone()
    c.forward_products(g_i, g_h)
    diff = (g_h - dense_h).abs().max().item()
    res["slot_matmul"] = timed(
        lambda: c.forward_products(g_i, g_h), mm_bytes, max_abs_diff_vs_dense=diff
    )
    res["dense_matmul"] = timed(lambda: c.dense_products(out_i, out_h), mm_bytes)
    if is_cuda(device) and triton_available():  # a few tile sizes
        sweep = res["sweep"] = {}
        for bn, bk, nw in ADAM_TILES:
            fn = functools.partial(c.fused, c.m, c.v, block_n=bn, block_k=bk, num_warps=nw)
            sweep[f"grad_adam_{bn}x{bk}_w{nw}"] = timed(fn, adam_bytes)
        for (bn, bk, nw), split in itertools.product(MATMUL_TILES, (0, 1)):
            fn = functools.partial(
                c.forward_products, g_i, g_h, split, block_n=bn, block_k=bk, num_warps=nw
            )
            sweep[f"slot_matmul_{bn}x{bk}_w{nw}_split{split or 'auto'}"] = timed(fn, mm_bytes)
    return res


def bench_kernels(
    device: torch.device | str, shapes: dict | None = None, bandwidth: float = H200_BANDWIDTH
) -> dict:
    """Each kernel timed per case of ``shapes`` (default: 7B shapes on CUDA, tiny on CPU):
    ``grad_adam`` (``_bf16``: bf16 moments; ``_tf32``: TF32 gradient product), ``slot_matmul``
    (against ``dense_matmul``, ``torch.bmm`` over every slot) and on CUDA a tile ``sweep``."""
    device = torch.device(device)
    if shapes is None:
        shapes = SHAPES_7B if is_cuda(device) else QUICK_SHAPES
    name = torch.cuda.get_device_name(device) if is_cuda(device) else "cpu"
    cases = []
    with torch.no_grad():
        for groups, capacity in shapes["cases"]:
            cases.append(_bench_case(shapes, groups, capacity, device, bandwidth))
            if is_cuda(device):
                torch.cuda.empty_cache()
    return dict(
        device=name,
        triton=triton_available(),
        bandwidth_bytes_per_s=bandwidth,
        shapes={k: v for k, v in shapes.items() if k != "cases"},
        cases=cases,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--rows", type=int, default=16, help="decode rows per group")
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke run)")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--bytes-only",
        action="store_true",
        help="only the bytes and the captured graphs' counts (no GPU needed: counted on meta)",
    )
    p.add_argument("--kernels", action="store_true", help="time the fused kernels alone")
    p.add_argument("--quick", action="store_true", help="with --kernels: tiny shapes (just runs)")
    p.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="bytes/s (--kernels)")
    args = p.parse_args(argv)
    if args.kernels:
        shapes = QUICK_SHAPES if args.quick else None
        print(json.dumps(bench_kernels(args.device, shapes, args.bandwidth)))
        return 0
    if args.bytes_only:
        out = {"bytes_per_param": update_bytes_per_param(args, torch.device("meta"))}
        for name, dt in (("fp32_moments", torch.float32), ("bf16_moments", torch.bfloat16)):
            out[f"graphs_{name}"] = update_graphs(args, dt)
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_distiller: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    # A non-default stream, so that graphs can also be captured on the "main" stream (capture
    # on the legacy default stream is not allowed).
    cuda = device.type == "cuda"
    with torch.cuda.stream(torch.cuda.Stream(device)) if cuda else contextlib.nullcontext():
        out = {
            "shape": {k: getattr(args, k) for k in ("hidden", "groups", "intermediate", "blocks")}
            | {"rows_per_group": args.rows, "batch_rows": args.groups * args.rows},
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__,
            "triton": importlib.metadata.version("triton") if triton_available() else None,
            "code": code_version(),
            "memory_plan": plan(args).as_dict(),
            "distiller": {},
        }
        for v in distiller_variants(device):
            res = out["distiller"][v] = bench_distiller(v, args, device)
            figures = "  ".join(f"{k}={val:.1f}" for k, val in res.items())
            print(f"[gpu_distiller] {v:<11} {figures}", file=sys.stderr)
        out["bytes_per_param"] = update_bytes_per_param(args, device)
    print(json.dumps(out) if args.json else render(out))
    return 0


def render(gp: dict[str, Any]) -> str:
    """The docs/results.md section of a ``--json`` result: each variant's predict and update."""
    rows = [
        [v, *(f"{d[k]:.1f}" for k in ("predict_us", "train_us", "step_us"))]
        for v, d in gp["distiller"].items()
    ]
    head = ["variant", "predict (µs)", "update (µs)", "both (µs)"]
    return section(
        "ESamp distiller on a GPU (7B shapes)",
        {**gp, "machine": {"device": gp["device"], "torch": gp["torch"]}},
        table(head, rows),
        command="python benchmarks/gpu_distiller.py --json",
    )


if __name__ == "__main__":
    sys.exit(main())
