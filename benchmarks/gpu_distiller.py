"""ESamp distiller cost on a GPU at 7B-model shapes (PyTorch + Triton only; no vLLM).

    python benchmarks/gpu_distiller.py [--hidden 3584] [--groups 8] [--rows 16] [--iters 200] [--json]
    python benchmarks/gpu_distiller.py --kernels [--quick] [--device cpu] [--bandwidth 4.26e12]

Timed with CUDA events after warm-up, in microseconds per decode step:

1. ``predict``, ``train_step`` and both (``step_us``: the update reusing the prediction's
   forward, as ESamp does; ``step_rerun_forward_us``: the forward run again) of the grouped
   distiller alone (8 groups x 16 rows, intermediate 384, 2 blocks), per variant:
   ``eager_main`` (CPU only: the CPU ``GroupedDistiller``), ``eager_side`` (side stream, no
   graphs), ``graph_main`` (graphs on the main stream), ``graph_side`` (as ESamp runs it).
2. The distiller inside a decode step: :class:`SyntheticDecode` (the linear layers of a
   Qwen2-7B-shaped decoder in bf16, one CUDA graph; attention left out, so the step is a lower
   bound and the overhead fraction an upper bound), then ``predict`` and ``train_step``.
   ``--decode-ms`` replaces the synthetic step's time in the fraction by a measured one.
3. ``bytes_per_param``: bytes one update moves per distiller parameter and group, counted on
   the meta device (``BytesCounter``): ``graph_update`` (the CUDA graphs' update) and
   ``host_update`` (the CPU trainer). ``--bytes-only``: this part and the captured graphs'
   launches and bytes (:func:`update_graphs`), on any machine.
4. ``--kernels``: ESamp's fused kernels alone at 7B shapes per ``(groups live, capacity)``
   case: ``grad_adam`` (``_bf16``: bf16 moments; ``_tf32``: TF32 gradient product) and
   ``slot_matmul`` (against ``dense_matmul``, ``torch.bmm`` over every slot), each against the
   bytes it must move at ``--bandwidth``; ``sweep`` (CUDA): a few tile sizes. ``--quick`` (or
   ``--device cpu``): tiny shapes.

``--device cpu``: a tiny smoke run of part 1 (eager only), to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
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
    slot_matmul,
    slot_matmul_bytes,
    triton_available,
)
from algorithms.esamp.memory_plan import MemoryPlan, default_slots, plan_memory  # noqa: E402
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
    """The variants a device runs (see the module docstring)."""
    return ["eager_side", "graph_main", "graph_side"] if is_cuda(device) else ["eager_main"]


def make(variant: str, args, device):
    """``eager_main`` on CPU: the CPU distiller; otherwise the CUDA distiller, eager or with
    its graphs, on its side stream or (``_main``) the current one."""
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


def time_us(fn: Any, iters: int, device: torch.device) -> float:
    """Microseconds per call over ``iters`` calls of ``fn``: CUDA events around the pipelined
    calls on a CUDA device, wall time elsewhere."""
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


def bench_distiller(variant: str, args, device) -> dict[str, float]:
    d = make(variant, args, device)
    slots_live = [d.alloc() for _ in range(args.groups)]
    slots, x, t = distiller_inputs(args, device)
    slots = torch.tensor(slots_live)[slots]

    def step(**same_rows: Any) -> None:
        d.predict(slots, x, **same_rows)
        d.train_step(slots, x, t, **same_rows)

    res = {}
    cases = [
        ("predict_us", lambda: d.predict(slots, x)),
        ("train_us", lambda: d.train_step(slots, x, t)),
        # as ESamp runs a decode step: the update reuses the prediction's forward
        ("step_us", lambda: step(**_same_rows(d))),
    ]
    if d.takes_rows_id:
        cases.append(("step_rerun_forward_us", step))  # the update runs the forward again
    for name, fn in cases:
        for _ in range(args.warmup):
            fn()
        d.synchronize()
        res[name] = statistics.median(time_us(fn, args.iters, device) for _ in range(args.repeats))
    res["graph_failures"] = getattr(d, "graph_failures", 0)
    return res


def _same_rows(d) -> dict[str, Any]:
    """``rows_id`` for a predict and the train step after it on the same rows (as ESamp
    names them), where the distiller takes one."""
    return {"rows_id": "step"} if d.takes_rows_id else {}


class SyntheticDecode:
    """Linear layers of a Qwen2-7B-shaped decoder at ``rows`` tokens, bf16, as one CUDA graph."""

    def __init__(self, rows: int, device, spec=QWEN2_7B, dtype=torch.bfloat16):
        h, i = spec["hidden"], spec["intermediate"]
        qkv = (spec["q_heads"] + 2 * spec["kv_heads"]) * spec["head_dim"]
        w = lambda o, k: torch.randn(o, k, device=device, dtype=dtype) * 0.01  # noqa: E731
        self.layers = [(w(qkv, h), w(h, h), w(2 * i, h), w(h, i)) for _ in range(spec["layers"])]
        self.head = w(spec["vocab"], h)
        self.x = torch.randn(rows, h, device=device, dtype=dtype)
        self.h1 = torch.empty(rows, h, device=device, dtype=torch.float32)
        self.hL = torch.empty(rows, h, device=device, dtype=torch.float32)
        self.graph = None
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            for _ in range(2):
                self._run()
        torch.cuda.current_stream(device).wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._run()

    def _run(self):
        h = self.x
        for li, (wqkv, wo, wgu, wd) in enumerate(self.layers):
            a = h @ wqkv.T
            h = h + a[:, : wo.shape[1]] @ wo.T
            gu = h @ wgu.T
            g, u = gu.chunk(2, dim=-1)
            h = h + (torch.nn.functional.silu(g) * u) @ wd.T
            h = torch.nn.functional.rms_norm(h, (h.shape[-1],))
            if li == 0:
                self.h1.copy_(h)
        self.hL.copy_(h)
        return h @ self.head.T

    def __call__(self):
        self.graph.replay()

    def run_logits(self) -> torch.Tensor:
        """One step (the graph) and its logits (the graph's static output)."""
        self.graph.replay()
        return self.logits


def bench_in_step(variant: str | None, decode: SyntheticDecode, args, device) -> float:
    """Microseconds per decode step: synthetic decode, then predict + train (if a variant)."""
    if variant is None:
        fn = decode
    else:
        d = make(variant, args, device)
        live = [d.alloc() for _ in range(args.groups)]
        slots = torch.tensor(live).repeat_interleave(args.rows)

        def fn():
            decode()
            # The sampler needs the prediction: the main stream waits for it. The update
            # (side stream: may overlap the next step) trains the same rows, as ESamp's do.
            d.predict(slots, decode.h1, **_same_rows(d))
            d.train_step(slots, decode.h1, decode.hL, **_same_rows(d))

    for _ in range(args.warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(time_us(fn, args.iters, device) for _ in range(args.repeats))


# ---------------------------------------------------------------- the kernels alone
SHAPES_7B: dict[str, Any] = dict(
    hidden=3584, intermediate=384, blocks=2, rows=16, cases=((8, 8), (64, 64), (8, 64)),
    iters=20, warmup=3,
)  # fmt: skip
QUICK_SHAPES: dict[str, Any] = dict(
    hidden=48, intermediate=16, blocks=2, rows=4, cases=((2, 3),), iters=2, warmup=1
)
H200_BANDWIDTH = 4.26e12  # copy bandwidth measured on an H200, bytes/s
LR, BETAS, EPS = 4e-4, (0.9, 0.999), 1e-4
ADAM_TILES = ((32, 128, 4), (64, 64, 4), (64, 128, 8), (16, 256, 4))  # block_n, block_k, warps
MATMUL_TILES = ((64, 64, 4), (32, 128, 4), (128, 64, 8))


def _matrices(shape: dict) -> list[tuple[int, int, int]]:
    """``(offset, N, K)`` of each weight matrix in a slot's flat row (params.py's layout:
    gate ``[NB, I, H]``, up ``[NB, I, H]``, down ``[NB, H, I]``)."""
    h, i, nb = shape["hidden"], shape["intermediate"], shape["blocks"]
    mats = [(0, i, h), (1, i, h), (2, h, i)]
    return [(kind * nb * i * h + blk * i * h, n, k) for kind, n, k in mats for blk in range(nb)]


def _view(state: torch.Tensor, off: int, n: int, k: int) -> torch.Tensor:
    return state[:, off : off + n * k].view(state.shape[0], n, k)


class _Case:
    """State, factors and inputs of one ``(groups, capacity)`` case."""

    def __init__(self, shape: dict, groups: int, capacity: int, device: torch.device):
        gen = torch.Generator(device=device).manual_seed(0)
        self.mats = _matrices(shape)
        p = sum(n * k for _, n, k in self.mats)
        rows = shape["rows"]
        self.groups, self.capacity, self.rows = groups, capacity, rows
        self.live = torch.arange(groups, device=device) * (capacity // groups)
        self.theta = torch.randn(capacity, p, device=device, generator=gen) * 0.02
        self.m = torch.zeros(capacity, p, device=device)
        self.v = torch.zeros(capacity, p, device=device)
        self.step = torch.full((capacity,), 5.0, device=device)
        self.a = [
            torch.randn(groups, rows, n, device=device, generator=gen) for _, n, _ in self.mats
        ]
        self.b = [torch.randn(groups, rows, k, device=device, generator=gen) for *_, k in self.mats]
        self.scale = torch.full((groups,), 0.5, device=device)
        self.ok = torch.ones(groups, dtype=torch.bool, device=device)
        self.x = torch.randn(groups, rows, shape["hidden"], device=device, generator=gen)

    def fused(self, theta, m, v, precision: str = "ieee", launch=None) -> None:
        for (off, n, k), a, b in zip(self.mats, self.a, self.b, strict=True):
            w, mm, vv = (_view(t, off, n, k) for t in (theta, m, v))
            if launch is None:
                grad_adam(
                    a, b, self.scale, self.live, self.ok, self.step, w, mm, vv,
                    lr=LR, betas=BETAS, eps=EPS, input_precision=precision,
                )  # fmt: skip
            else:
                launch(a, b, self.scale, self.live, self.ok, self.step, w, mm, vv,
                       LR, *BETAS, EPS, precision)  # fmt: skip

    def forward_products(self, theta, out_i, out_h, launch=None) -> None:
        """The six weight products of one forward pass (inputs reused: only the weight
        reads matter), reading the live slots only."""
        run = launch or (lambda x, w, s, out, t: slot_matmul(x, w, s, out, transpose_w=t))
        for off, n, k in self.mats:
            w = _view(theta, off, n, k)
            x, out = (self.x, out_i) if k == self.x.shape[2] else (out_i, out_h)
            run(x, w, self.live, out, True)

    def dense_products(self, theta, out_i, out_h) -> None:
        """``torch.bmm`` over every slot's views (dead slots included): what reading only the
        live slots saves."""
        cap = self.capacity
        xd = torch.zeros(cap, self.rows, self.x.shape[2], device=theta.device)
        xd[self.live] = self.x
        for off, n, k in self.mats:
            w = _view(theta, off, n, k)
            if k == xd.shape[2]:
                torch.bmm(xd, w.transpose(1, 2), out=out_i)
            else:
                torch.bmm(out_i, w.transpose(1, 2), out=out_h)


def _bench_case(shape: dict, groups: int, capacity: int, device, bandwidth: float) -> dict:
    c = _Case(shape, groups, capacity, device)

    def timed(fn: Any, nbytes: int, **extra: Any) -> dict[str, Any]:
        """ms per call of ``fn`` and its floor: ``nbytes`` moved at ``bandwidth``."""
        for _ in range(shape["warmup"]):
            fn()
        ms = time_us(fn, shape["iters"], device) / 1e3
        floor_ms = nbytes / bandwidth * 1e3
        return dict(ms=ms, bytes=nbytes, floor_ms=floor_ms, x_floor=ms / floor_ms, **extra)

    params = groups * sum(n * k for _, n, k in c.mats)
    adam_bytes = sum(grad_adam_bytes(groups, c.rows, n, k) for _, n, k in c.mats)
    bf16_bytes = sum(grad_adam_bytes(groups, c.rows, n, k, 2) for _, n, k in c.mats)
    mm_bytes = sum(slot_matmul_bytes(groups, c.rows, n, k) for _, n, k in c.mats)
    res: dict[str, Any] = dict(groups=groups, capacity=capacity, rows=c.rows, params_updated=params)
    per_param = adam_bytes / params
    res["grad_adam"] = timed(
        lambda: c.fused(c.theta, c.m, c.v), adam_bytes, bytes_per_param=per_param
    )
    res["grad_adam_tf32"] = timed(lambda: c.fused(c.theta, c.m, c.v, "tf32"), adam_bytes)
    m16, v16 = c.m.bfloat16(), c.v.bfloat16()
    res["grad_adam_bf16"] = timed(
        lambda: c.fused(c.theta, m16, v16), bf16_bytes, bytes_per_param=bf16_bytes / params
    )
    out_i = torch.zeros(capacity, c.rows, shape["intermediate"], device=device)
    out_h = torch.zeros(capacity, c.rows, shape["hidden"], device=device)
    c.dense_products(c.theta, out_i, out_h)
    dense_h = out_h[c.live].clone()
    g_i, g_h = out_i[:groups].clone(), out_h[:groups].clone()
    c.forward_products(c.theta, g_i, g_h)
    diff = (g_h - dense_h).abs().max().item()
    res["slot_matmul"] = timed(
        lambda: c.forward_products(c.theta, g_i, g_h), mm_bytes, max_abs_diff_vs_dense=diff
    )
    res["dense_matmul"] = timed(lambda: c.dense_products(c.theta, out_i, out_h), mm_bytes)
    if is_cuda(device) and triton_available():
        res["sweep"] = _sweep(c, g_i, g_h, timed, adam_bytes, mm_bytes)
    return res


def _sweep(c: _Case, g_i, g_h, timed: Any, adam_bytes: int, mm_bytes: int) -> dict:
    """The kernels at a few tile sizes (CUDA)."""
    from algorithms.esamp.kernels import op_grad_adam, op_slot_matmul

    out: dict[str, Any] = {}
    for bn, bk, nw in ADAM_TILES:

        def launch(*args, bn=bn, bk=bk, nw=nw):
            op_grad_adam.run_triton(*args, block_n=bn, block_k=bk, num_warps=nw)

        fn = lambda: c.fused(c.theta, c.m, c.v, launch=launch)  # noqa: E731
        out[f"grad_adam_{bn}x{bk}_w{nw}"] = timed(fn, adam_bytes)
    for bn, bk, nw in MATMUL_TILES:
        for split in (0, 1):

            def run(x, w, s, o, t, bn=bn, bk=bk, nw=nw, split=split):
                op_slot_matmul.run_triton(
                    x, w, s, o, t, "ieee", split, block_n=bn, block_k=bk, num_warps=nw
                )

            fn = lambda: c.forward_products(c.theta, g_i, g_h, launch=run)  # noqa: E731
            out[f"slot_matmul_{bn}x{bk}_w{nw}_split{split or 'auto'}"] = timed(fn, mm_bytes)
    return out


def bench_kernels(
    device: torch.device | str, shapes: dict | None = None, bandwidth: float = H200_BANDWIDTH
) -> dict:
    """Time each kernel per case of ``shapes`` (default: 7B shapes on CUDA, tiny on CPU);
    returns the figures as a JSON-able dict (see the module docstring)."""
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
    p.add_argument(
        "--decode-ms",
        type=float,
        default=None,
        help="decode-step time of a real engine (ms) for the fraction",
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke run)")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--bytes-only",
        action="store_true",
        help="only part 3 and the captured graphs' counts (no GPU needed: counted on meta)",
    )
    p.add_argument("--kernels", action="store_true", help="time the fused kernels alone (part 4)")
    p.add_argument("--quick", action="store_true", help="with --kernels: tiny shapes (just runs)")
    p.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="bytes/s (--kernels)")
    args = p.parse_args(argv)
    if args.kernels:
        shapes = QUICK_SHAPES if args.quick or args.device == "cpu" else SHAPES_7B
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
    if device.type == "cuda":
        # Run on a non-default stream, so that graphs can also be captured on the "main"
        # stream (capture on the legacy default stream is not allowed).
        with torch.cuda.stream(torch.cuda.Stream(device)):
            return _run(args, device)
    return _run(args, device)


def _run(args, device) -> int:
    variants = distiller_variants(device)
    out: dict[str, Any] = {
        "shape": {k: getattr(args, k) for k in ("hidden", "groups", "intermediate", "blocks")}
        | {"rows_per_group": args.rows, "batch_rows": args.groups * args.rows},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "code": code_version(),
        "distiller": {},
        "in_step": {},
        "memory_plan": plan(args).as_dict(),
    }
    out["triton"] = importlib.metadata.version("triton") if triton_available() else None
    for v in variants:
        out["distiller"][v] = bench_distiller(v, args, device)
        print(
            f"[gpu_distiller] {v:<11} "
            + "  ".join(f"{k}={val:.1f}" for k, val in out["distiller"][v].items()),
            file=sys.stderr,
        )

    out["bytes_per_param"] = update_bytes_per_param(args, device)
    print(f"[gpu_distiller] bytes per parameter {out['bytes_per_param']}", file=sys.stderr)

    if device.type == "cuda":
        decode = SyntheticDecode(args.groups * args.rows, device)
        base = bench_in_step(None, decode, args, device)
        step_us = args.decode_ms * 1000 if args.decode_ms else base
        out["decode_step_us"] = step_us
        synthetic = "synthetic Qwen2-7B linear layers, bf16, CUDA graph"
        out["decode_step_source"] = "--decode-ms" if args.decode_ms else synthetic
        out["synthetic_decode_us"] = base
        for v in variants:
            t = bench_in_step(v, decode, args, device)
            out["in_step"][v] = {
                "step_us": t,
                "added_us": t - base,
                "fraction_of_step": (t - base) / step_us,
            }
        for d in out["distiller"].values():
            d["isolated_fraction_of_step"] = d["step_us"] / step_us
    print(json.dumps(out) if args.json else render(out))
    return 0


def render(gp: dict[str, Any]) -> str:
    """The docs/results.md section of a ``--json`` result: each variant's predict and
    update, and what it adds to the decode step."""
    rows = []
    for v, d in gp["distiller"].items():
        s = gp["in_step"].get(v, {})
        rows.append(
            [
                v,
                f"{d['predict_us']:.1f}",
                f"{d['train_us']:.1f}",
                f"{s.get('added_us', float('nan')):.1f}",
                f"{100 * s.get('fraction_of_step', float('nan')):.1f}%",
            ]
        )
    head = ["variant", "predict (µs)", "update (µs)", "added to a step (µs)", "fraction of step"]
    machine = {"device": gp["device"], "torch": gp["torch"]}
    return section(
        "ESamp distiller on a GPU (7B shapes)",
        {**gp, "machine": machine},
        table(head, rows),
        command="python benchmarks/gpu_distiller.py --json",
    )


if __name__ == "__main__":
    sys.exit(main())
