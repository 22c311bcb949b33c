"""ESamp's fused kernels (``algorithms.esamp.kernels``) timed against their bytes-moved floor and
against today's path, torch only (no vLLM, no pydantic):

    python benchmarks/gpu_kernels.py [--device cuda|cpu] [--bandwidth 4.26e12] [--quick] [--out f.json]

At Qwen2.5-7B shapes (hidden 3584, intermediate 384, 2 blocks: 6 weight matrices per slot,
16 rows per group), per case ``(groups live, capacity slots)``: (8, 8), (64, 64), (8, 64):

- ``grad_adam`` (fp32 moments; ``_bf16``: bf16 moments; ``_tf32``: TF32 gradient product):
  the update's six ``grad_adam`` calls (gradient formed inside Adam), with the bytes they must
  move (``grad_adam_bytes``), that floor's time at ``--bandwidth`` and the ratio to it;
- ``baseline_adam``: today's ``graph_update.train_dense`` inner loop, dense over every slot:
  per matrix one ``torch.bmm`` into a scratch block, then ``torch._fused_adam_`` per slot (dead
  slots skipped through ``found_inf``); ``max_abs_diff_vs_baseline`` compares one step of each
  from the same state;
- ``slot_matmul``: the forward's six weight products (x @ gate^T, x @ up^T, p @ down^T per
  block) reading only the live slots' weights, against ``dense_matmul`` (``torch.bmm`` over
  every slot's views, as predict does today);
- ``sweep`` (CUDA only): ``grad_adam`` and ``slot_matmul`` timed at a few tile sizes.

Times are CUDA-event medians (ms per call sequence); on CPU (or ``--quick``) tiny shapes with
``time.perf_counter``, only to show that it runs (the CPU ops are the PyTorch reference).
The last line printed is the JSON (also written to ``--out``).

**This script has never run on a GPU**: no GPU was available where it was written, so its CUDA
figures, tile sweep included, are still to be measured.
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
sys.path.insert(0, str(ROOT))

from algorithms.esamp.kernels import (  # noqa: E402
    grad_adam,
    grad_adam_bytes,
    slot_matmul,
    slot_matmul_bytes,
    triton_available,
)
from tllm_core.testing.fake_cuda import is_cuda  # noqa: E402

SHAPES_7B: dict[str, Any] = dict(
    hidden=3584, intermediate=384, blocks=2, rows=16, cases=((8, 8), (64, 64), (8, 64)),
    iters=20, warmup=3,
)  # fmt: skip
QUICK_SHAPES: dict[str, Any] = dict(
    hidden=48, intermediate=16, blocks=2, rows=4, cases=((2, 3),), iters=2, warmup=1
)
H200_BANDWIDTH = 4.26e12  # copy bandwidth measured on an H200 (issue 36), bytes/s
LR, BETAS, EPS = 4e-4, (0.9, 0.999), 1e-4
ADAM_TILES = ((32, 128, 4), (64, 64, 4), (64, 128, 8), (16, 256, 4))  # block_n, block_k, warps
MATMUL_TILES = ((64, 64, 4), (32, 128, 4), (128, 64, 8))


def _time_ms(fn, device: torch.device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    if not is_cuda(device):
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _matrices(shape: dict) -> list[tuple[int, int, int]]:
    """``(offset, N, K)`` of each weight matrix in a slot's flat row (params.py's layout:
    gate ``[NB, I, H]``, up ``[NB, I, H]``, down ``[NB, H, I]``)."""
    h, i, nb = shape["hidden"], shape["intermediate"], shape["blocks"]
    mats = [(0, i, h), (1, i, h), (2, h, i)]
    return [(kind * nb * i * h + blk * i * h, n, k) for kind, n, k in mats for blk in range(nb)]


def _view(state: torch.Tensor, off: int, n: int, k: int) -> torch.Tensor:
    return state[:, off : off + n * k].view(state.shape[0], n, k)


def _floor(total_bytes: int, ms: float, bandwidth: float) -> dict[str, float]:
    floor_ms = total_bytes / bandwidth * 1e3
    return dict(ms=ms, bytes=total_bytes, floor_ms=floor_ms, x_floor=ms / floor_ms)


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
        # Today's dense inputs: every slot, dead ones with zero rows and skipped by Adam.
        self.a_dense = [self._dense(a) for a in self.a]
        self.b_dense = [self._dense(b) for b in self.b]
        self.scale_dense = self._dense(self.scale)
        self.skip = torch.ones(capacity, device=device)
        self.skip[self.live] = 0.0
        self.scratch = torch.empty(capacity, max(n * k for _, n, k in self.mats), device=device)

    def _dense(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.capacity, *t.shape[1:], device=t.device)
        out[self.live] = t
        return out

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

    def baseline(self, theta, m, v) -> None:
        """Today's path (graph_update.train_dense): dense over every slot, the clip scale
        folded into ``a``, each matrix's gradients formed in one scratch block."""
        for (off, n, k), a, b in zip(self.mats, self.a_dense, self.b_dense, strict=True):
            a_s = a * self.scale_dense[:, None, None]
            grad = torch.bmm(a_s.transpose(1, 2), b, out=self.scratch[:, : n * k].view(-1, n, k))
            w, mm, vv = (_view(t, off, n, k) for t in (theta, m, v))
            for s in range(self.capacity):
                torch._fused_adam_(
                    [w[s]], [grad[s]], [mm[s]], [vv[s]], [], [self.step[s]],
                    lr=LR, beta1=BETAS[0], beta2=BETAS[1], weight_decay=0.0, eps=EPS,
                    amsgrad=False, maximize=False, found_inf=self.skip[s],
                )  # fmt: skip

    def forward_products(self, theta, out_i, out_h, launch=None) -> None:
        """The six weight products of one forward pass (inputs reused: only the weight
        reads matter), reading the live slots only."""
        run = launch or (lambda x, w, s, out, t: slot_matmul(x, w, s, out, transpose_w=t))
        for off, n, k in self.mats:
            w = _view(theta, off, n, k)
            x, out = (self.x, out_i) if k == self.x.shape[2] else (out_i, out_h)
            run(x, w, self.live, out, True)

    def dense_products(self, theta, out_i, out_h) -> None:
        """Today's predict: ``torch.bmm`` over every slot's views."""
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
    it, wu = shape["iters"], shape["warmup"]
    params = groups * sum(n * k for _, n, k in c.mats)
    adam_bytes = sum(grad_adam_bytes(groups, c.rows, n, k) for _, n, k in c.mats)
    res: dict[str, Any] = dict(groups=groups, capacity=capacity, rows=c.rows, params_updated=params)

    # One step of each path from the same state.
    ref = [t.clone() for t in (c.theta, c.m, c.v)]
    c.baseline(*ref)
    new = [t.clone() for t in (c.theta, c.m, c.v)]
    c.fused(*new)
    diff = (new[0] - ref[0]).abs().max().item()
    del ref, new

    ms = _time_ms(lambda: c.fused(c.theta, c.m, c.v), device, it, wu)
    res["grad_adam"] = dict(
        _floor(adam_bytes, ms, bandwidth),
        bytes_per_param=adam_bytes / params,
        max_abs_diff_vs_baseline=diff,
    )
    ms = _time_ms(lambda: c.fused(c.theta, c.m, c.v, "tf32"), device, it, wu)
    res["grad_adam_tf32"] = _floor(adam_bytes, ms, bandwidth)
    m16, v16 = c.m.bfloat16(), c.v.bfloat16()
    bf16_bytes = sum(grad_adam_bytes(groups, c.rows, n, k, 2) for _, n, k in c.mats)
    ms = _time_ms(lambda: c.fused(c.theta, m16, v16), device, it, wu)
    res["grad_adam_bf16"] = dict(
        _floor(bf16_bytes, ms, bandwidth), bytes_per_param=bf16_bytes / params
    )
    ms = _time_ms(lambda: c.baseline(c.theta, c.m, c.v), device, it, wu)
    res["baseline_adam"] = dict(
        _floor(adam_bytes, ms, bandwidth),
        launches_fused_adam=len(c.mats) * capacity,
        fused_speedup=ms / res["grad_adam"]["ms"],
    )

    h, i = shape["hidden"], shape["intermediate"]
    out_i = torch.zeros(capacity, c.rows, i, device=device)
    out_h = torch.zeros(capacity, c.rows, h, device=device)
    mm_bytes = sum(slot_matmul_bytes(groups, c.rows, n, k) for _, n, k in c.mats)
    c.dense_products(c.theta, out_i, out_h)
    dense_h = out_h[c.live].clone()
    g_i, g_h = out_i[:groups].clone(), out_h[:groups].clone()
    c.forward_products(c.theta, g_i, g_h)
    mm_diff = (g_h - dense_h).abs().max().item()
    ms = _time_ms(lambda: c.forward_products(c.theta, g_i, g_h), device, it, wu)
    res["slot_matmul"] = dict(_floor(mm_bytes, ms, bandwidth), max_abs_diff_vs_dense=mm_diff)
    ms = _time_ms(lambda: c.dense_products(c.theta, out_i, out_h), device, it, wu)
    res["dense_matmul"] = _floor(mm_bytes, ms, bandwidth)

    if is_cuda(device) and triton_available():
        res["sweep"] = _sweep(c, g_i, g_h, it, wu, adam_bytes, mm_bytes, bandwidth)
    return res


def _sweep(c: _Case, g_i, g_h, it, wu, adam_bytes, mm_bytes, bandwidth) -> dict:
    from algorithms.esamp.kernels import triton_impl

    out: dict[str, Any] = {}
    for bn, bk, nw in ADAM_TILES:

        def launch(*args, bn=bn, bk=bk, nw=nw):
            triton_impl.grad_adam(*args, block_n=bn, block_k=bk, num_warps=nw)

        ms = _time_ms(lambda: c.fused(c.theta, c.m, c.v, launch=launch), c.theta.device, it, wu)
        out[f"grad_adam_{bn}x{bk}_w{nw}"] = _floor(adam_bytes, ms, bandwidth)
    for bn, bk, nw in MATMUL_TILES:
        for split in (0, 1):

            def run(x, w, s, o, t, bn=bn, bk=bk, nw=nw, split=split):
                triton_impl.slot_matmul(
                    x, w, s, o, t, "ieee", split, block_n=bn, block_k=bk, num_warps=nw
                )

            ms = _time_ms(
                lambda: c.forward_products(c.theta, g_i, g_h, launch=run), c.theta.device, it, wu
            )
            out[f"slot_matmul_{bn}x{bk}_w{nw}_split{split or 'auto'}"] = _floor(
                mm_bytes, ms, bandwidth
            )
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="bytes/s")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (just runs)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    shapes = QUICK_SHAPES if args.quick else None
    res = bench_kernels(args.device, shapes, args.bandwidth)
    text = json.dumps(res)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
