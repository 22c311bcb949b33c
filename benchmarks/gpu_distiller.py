"""ESamp distiller cost on a GPU at 7B-model shapes (PyTorch + Triton only; no vLLM).

    python benchmarks/gpu_distiller.py [--hidden 3584] [--groups 8] [--rows 16] [--iters 200] [--json]

What is timed (CUDA events, after warm-up), in microseconds per decode step:

1. ``predict``, ``train_step`` and both (``step_us``: the update on the same rows, reusing
   the prediction's forward as ESamp does; ``step_rerun_forward_us``: the forward run
   again) of the grouped distiller alone (hidden 3584, 8 groups x 16 rows = a batch of 128
   decode rows, intermediate 384, 2 blocks), for four variants:

   - ``eager_main``:   on CPU only: the CPU ``GroupedDistiller`` (a smoke run of the script);
   - ``eager_side``:   ``CudaGroupedDistiller(use_cuda_graph=False)``: side stream, eager update;
   - ``graph_main``:   the CUDA graphs, but the "side" stream is the main stream;
   - ``graph_side``:   ``CudaGroupedDistiller`` as ESamp uses it: side stream + CUDA graphs.

2. A decode step with the distiller in it: a synthetic decode step of the model (the linear
   layers of a Qwen2-7B-shaped decoder -- 28 layers, hidden 3584, intermediate 18944, GQA with
   4 KV heads of 128, vocabulary 152064 -- in bf16 at the same batch of 128 rows, replayed from
   a CUDA graph; attention is left out, so this step is a lower bound and the overhead
   fraction an upper bound) followed by ``predict`` (the sampler waits for it) and
   ``train_step`` (which may overlap the next step on the side stream). Reported: the decode
   step alone, the step with the distiller, and the added time as a fraction of the step.

3. ``bytes_per_param``: the bytes one update moves per distiller parameter and group, counted
   from the tensor sizes of the operations it dispatches (``tllm_core.testing.counters.BytesCounter``;
   device independent, counted on the meta device): the update the CUDA graphs replay
   (``graph_update``: the fused operators count as one operation each, with their arguments)
   and the CPU trainer after a prediction of the same rows (``host_update``, as ESamp runs
   it); ``*_adam``: the share of the Adam kernel (``grad_adam``: gradient formed inside).

``--bytes-only`` prints part 3 and the captured graphs' launches and bytes
(:func:`update_graphs`) for fp32 and bf16 moments, on any machine. ``--decode-ms`` replaces the synthetic step by a measured decode-step time of a real engine in
the fraction. ``--device cpu`` runs a tiny smoke version of part 1 (eager only) for checking
the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


from algorithms.esamp.cpu import GroupedDistiller  # noqa: E402
from algorithms.esamp.memory_plan import MemoryPlan, default_slots, plan_memory  # noqa: E402
from tllm_core.testing.counters import BytesCounter  # noqa: E402
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


def _inputs(args, device):
    rows = args.groups * args.rows
    if device.type == "meta":
        x = torch.empty(rows, args.hidden, device=device)
        return torch.arange(args.groups).repeat_interleave(args.rows), x, x.clone()
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, args.hidden, generator=g).to(device)
    t = x + 0.1 * torch.randn(rows, args.hidden, generator=g).to(device)
    slots = torch.arange(args.groups).repeat_interleave(args.rows)
    return slots, x, t


def _timer(device):
    if is_cuda(device):

        def timed(fn, iters):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) * 1000 / iters  # us
    else:

        def timed(fn, iters):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t0) * 1e6 / iters

    return timed


def bench_distiller(variant: str, args, device) -> dict[str, float]:
    timed = _timer(device)
    d = make(variant, args, device)
    slots_live = [d.alloc() for _ in range(args.groups)]
    slots, x, t = _inputs(args, device)
    slots = torch.tensor(slots_live)[slots]

    def predict():
        d.predict(slots, x)

    def train():
        d.train_step(slots, x, t)

    def both():  # as ESamp runs a decode step: the update reuses the prediction's forward
        d.predict(slots, x, **_same_rows(d))
        d.train_step(slots, x, t, **_same_rows(d))

    def both_rerun():  # the update runs the forward again
        d.predict(slots, x)
        d.train_step(slots, x, t)

    res = {}
    cases = [("predict_us", predict), ("train_us", train), ("step_us", both)]
    if d.takes_rows_id:
        cases.append(("step_rerun_forward_us", both_rerun))
    for name, fn in cases:
        for _ in range(args.warmup):
            fn()
        d.synchronize()
        res[name] = statistics.median(timed(fn, args.iters) for _ in range(args.repeats))
    res["graph_failures"] = getattr(d, "graph_failures", 0)
    return res


def _same_rows(d) -> dict[str, Any]:
    """``rows_id`` for a predict and the train step after it on the same rows (as ESamp
    names them), where the distiller takes one."""
    return {"rows_id": "step"} if d.takes_rows_id else {}


def update_bytes_per_param(args, device) -> dict[str, float]:
    """Bytes per parameter and group of one update of ``args.groups`` groups of ``args.rows``
    rows: the update the CUDA graphs replay (``graph_update``: the slot-indexed products and
    the fused gradient + Adam operator, each counted as one operation with its arguments;
    ``graph_update_reuse``: the same on the forward the step's prediction kept, as ESamp runs
    it when the trained rows are the predicted ones; ``*_bf16``: with bf16 Adam moments) and
    the CPU trainer (see the module docstring, part 3); ``*_ops``: operations dispatched."""
    from algorithms.esamp.graph_update import train_groups
    from algorithms.esamp.mlp import forward_slots
    from algorithms.esamp.slot_ops import slot_matmul

    # Counted from the operations' tensor sizes: the meta device gives the same counts as a
    # GPU without computing anything; the CPU trainer's part runs on CPU.
    meta = torch.device("meta")
    slots, x, t = _inputs(args, meta)
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
        slots, x, t = _inputs(args, device)
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
    timed = _timer(device)
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
    return statistics.median(timed(fn, args.iters) for _ in range(args.repeats))


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
    args = p.parse_args(argv)
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
    variants = (
        ["eager_side", "graph_main", "graph_side"] if device.type == "cuda" else ["eager_main"]
    )
    out: dict[str, Any] = {
        "shape": {
            "hidden": args.hidden,
            "groups": args.groups,
            "rows_per_group": args.rows,
            "batch_rows": args.groups * args.rows,
            "intermediate": args.intermediate,
            "blocks": args.blocks,
        },
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "distiller": {},
        "in_step": {},
        "memory_plan": plan(args).as_dict(),
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
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
        out["decode_step_source"] = (
            "--decode-ms"
            if args.decode_ms
            else "synthetic Qwen2-7B linear layers, bf16, CUDA graph"
        )
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
    if args.json:
        print(json.dumps(out))
    else:
        print(f"shape: {out['shape']}  device: {out['device']}")
        for v, d in out["distiller"].items():
            print(
                f"{v:<11} predict {d['predict_us']:9.1f} us  train {d['train_us']:9.1f} us  "
                f"both {d['step_us']:9.1f} us"
            )
        if out["in_step"]:
            print(f"decode step: {out['decode_step_us']:.1f} us ({out['decode_step_source']})")
            for v, d in out["in_step"].items():
                print(
                    f"{v:<11} step {d['step_us']:9.1f} us  added {d['added_us']:8.1f} us  "
                    f"= {100 * d['fraction_of_step']:.1f}% of a decode step"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
