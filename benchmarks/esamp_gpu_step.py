"""ESamp's whole decode step on a GPU at 7B shapes, beside a synthetic decode step (torch +
pydantic; no vLLM):

    from esamp_gpu_step import bench_step; bench_step(torch.device("cuda"), prompts=8, n=16)

The synthetic step (``gpu_distiller.SyntheticDecode``: the linear layers of a Qwen2-7B-shaped
decoder in bf16 at the step's rows, one CUDA graph, attention left out: a lower bound of a
real step) is followed by a sampler stand-in (softmax, min-p 0.1 filter, exponential-race
sampling; no host sync). With ESamp, the consumer is called as the runtime calls it: ``guide``
on the filtered logits (then ``GuideView.commit``) before sampling, ``on_bundle`` after.
Reported per step: device time of plain and of ESamp steps (CUDA events over ``iters``
pipelined steps, no sync between them), the time ESamp adds and the ratio, the host time of
the consumer's calls (``time.perf_counter``, no sync), ESamp's floor (bytes it must move at the
GPU's measured copy bandwidth), whether one step runs under
``torch.cuda.set_sync_debug_mode("error")``, and the memory plan against what was allocated.

**Never run on a GPU** (written where none was available): ``benchmarks/gpu_smoke.py`` runs it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch
from gpu_distiller import QWEN2_7B, SyntheticDecode

from algorithms.esamp.kernels import grad_adam_bytes, slot_matmul_bytes

H, V, I_DIST, BLOCKS = QWEN2_7B["hidden"], QWEN2_7B["vocab"], 384, 2


def copy_bandwidth(device: torch.device, mib: int = 1024) -> float:
    """Device copy bandwidth (read + write bytes per second) of a large copy."""
    a = torch.empty(mib * 2**20 // 4, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize(device)
    return 2 * a.numel() * 4 * 10 / (start.elapsed_time(end) / 1e3)


def esamp_floor_bytes(prompts: int, n: int, vocab: int = V) -> int:
    """What one ESamp step must move: the update (grad_adam over the 6 matrices of each
    group's slot: parameter and moments read and written once; the backward's reads of 4 of
    the 6 weight matrices), the prediction (every weight once) and the guidance (the logits
    read once for the candidate search, the candidates' head rows)."""
    rows, r = n, prompts * n
    mats = [(I_DIST, H), (I_DIST, H), (H, I_DIST)] * BLOCKS
    update = sum(grad_adam_bytes(prompts, rows, a, b) for a, b in mats)
    backward = 4 * I_DIST * H * 4 * prompts
    predict = sum(slot_matmul_bytes(prompts, rows, a, b) for a, b in mats)
    guidance = r * vocab * 4 + r * 64 * H * 2
    return update + backward + predict + guidance


def _sampler(logits: torch.Tensor) -> torch.Tensor:
    """min-p 0.1 filter (in place, as vLLM's) and an exponential-race sample: no host sync."""
    probs = logits.softmax(-1)
    logits.masked_fill_(probs < 0.1 * probs.amax(-1, keepdim=True), float("-inf"))
    q = torch.empty_like(probs).exponential_()
    return logits.softmax(-1).div_(q).argmax(-1)


def bench_step(
    device: torch.device, prompts: int, n: int, iters: int = 30, warmup: int = 5, **cfg: Any
) -> dict[str, Any]:
    from algorithms.esamp.config import ESampConfig
    from algorithms.esamp.consumer import ESampConsumer
    from tllm_core.api.bundles import Bundle, GuideView
    from tllm_core.api.consumer import ConsumerContext, ModelInfo
    from tllm_core.api.ports import resolve_layer
    from tllm_core.api.rows import RequestInfo, RowInfo

    r = prompts * n
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    decode = SyntheticDecode(r, device)
    head = decode.head
    model = ModelInfo(H, QWEN2_7B["layers"], V, torch.bfloat16, device, lambda z: z @ head.T, head)
    ctx = ConsumerContext(model, lambda i: resolve_layer(i, QWEN2_7B["layers"]))
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    c = ESampConsumer(ESampConfig(cuda_rows_per_step=r, **cfg), ctx)
    torch.cuda.synchronize(device)
    built = torch.cuda.memory_allocated(device) - base
    reqs = [RequestInfo(f"{p}-{s}", f"r{p}", p, s, 3) for p in range(prompts) for s in range(n)]
    tokens = torch.zeros(r, dtype=torch.long, device=device)
    rows = RowInfo(np.arange(r), reqs, np.full(r, 5), np.ones(r, bool), np.zeros(r, bool), tokens)
    temp = torch.ones(r, device=device)
    host: list[float] = []

    def plain() -> None:
        logits = decode.run_logits().float()
        _sampler(logits)

    def with_esamp(t: int) -> None:
        logits = decode.run_logits().float()
        probs = logits.softmax(-1)
        logits.masked_fill_(probs < 0.1 * probs.amax(-1, keepdim=True), float("-inf"))
        hidden = {"layer.0": decode.h1, "final": decode.hL}
        t0 = time.perf_counter()
        view = GuideView(t, rows, logits, temp, np.ones(r, bool), True, hidden)
        c.guide(view)
        view.commit()
        t1 = time.perf_counter()
        q = torch.empty_like(probs).exponential_()
        logits.softmax(-1).div_(q).argmax(-1)
        t2 = time.perf_counter()
        c.on_bundle(Bundle(t, rows, hidden))
        host.append((t1 - t0) + (time.perf_counter() - t2))

    def timed(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i in range(warmup):
            fn(i)
        torch.cuda.synchronize(device)
        start.record()
        for i in range(iters):
            fn(warmup + i)
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters

    plain_ms = statistics.median(timed(lambda i: plain()) for _ in range(3))
    host.clear()
    esamp_ms = statistics.median(timed(with_esamp) for _ in range(3))
    host_ms = statistics.median(host) * 1e3
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with_esamp(10**6)
        sync = "no sync"
    except RuntimeError as err:
        sync = f"synced: {err}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    res = c.result()
    c.close()
    bw = copy_bandwidth(device)
    floor_ms = esamp_floor_bytes(prompts, n) / bw * 1e3
    added = esamp_ms - plain_ms
    plan = res["memory_plan"]
    return {
        "prompts": prompts,
        "n": n,
        "plain_ms": plain_ms,
        "esamp_ms": esamp_ms,
        "added_ms": added,
        "ratio": plain_ms / esamp_ms,
        "host_ms": host_ms,
        "floor_ms": floor_ms,
        "added_over_floor": added / floor_ms,
        "copy_bandwidth": bw,
        "sync_debug": sync,
        "memory": {
            "plan_bytes": plan["total_bytes"],
            "built_bytes": built,
            "peak_bytes": peak,
            "within_plan": peak <= plan["total_bytes"],
        },
        "counters": {
            k: res["counters"][k]
            for k in ("optimizer_steps", "rows_guided", "graph_failures", "eager_updates")
        },
    }
