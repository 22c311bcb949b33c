"""ESamp's whole decode step on a GPU at 7B shapes, beside a synthetic decode step (torch +
pydantic; no vLLM):

    from esamp_gpu_step import bench_step; bench_step(torch.device("cuda"), prompts=8, n=16)

The synthetic step (``gpu_distiller.SyntheticDecode``: the linear layers of a Qwen2-7B-shaped
decoder in bf16 at the step's rows, one CUDA graph, attention left out: a lower bound of a
real step) is followed by a sampler stand-in (softmax, min-p 0.1 filter, exponential-race
sampling; no host sync). With ESamp, tllm's runtime drives it as the vLLM bridge does
(``esamp_runtime_step``: ``begin_step``, ``guide`` on the filtered logits before sampling,
``end_step`` after, the step's stamps and bundles included).
Reported per step: device time of plain and of ESamp steps (CUDA events over ``iters``
pipelined steps, no sync between them), the time ESamp adds and the ratio, the host time of
the runtime's calls (``time.perf_counter``, no sync), ESamp's floor (bytes it must move at the
GPU's measured copy bandwidth), whether one step runs under
``torch.cuda.set_sync_debug_mode("error")``, and the memory plan against what was allocated.

**Never run on a GPU** (written where none was available): ``benchmarks/gpu_smoke.py`` runs it.
"""

from __future__ import annotations

import statistics
from typing import Any

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
    from esamp_runtime_step import RuntimeStep

    from tllm_core.api.consumer import ModelInfo

    r = prompts * n
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    decode = SyntheticDecode(r, device)
    head = decode.head
    model = ModelInfo(H, QWEN2_7B["layers"], V, torch.bfloat16, device, lambda z: z @ head.T, head)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    rs = RuntimeStep(model, prompts, n, {"cuda_rows_per_step": r, **cfg})
    c = rs.consumer
    torch.cuda.synchronize(device)
    built = torch.cuda.memory_allocated(device) - base
    temp = torch.ones(r, device=device)
    host: list[float] = []

    def plain() -> None:
        logits = decode.run_logits().float()
        _sampler(logits)

    # The runtime's taps: ESamp's source layer (the synthetic step's first layer output) and
    # the final state.
    taps = {k: decode.hL if k == "final" else decode.h1 for k in rs.tap_keys}

    def with_esamp(t: int) -> None:
        logits = decode.run_logits().float()
        probs = logits.softmax(-1)
        logits.masked_fill_(probs < 0.1 * probs.amax(-1, keepdim=True), float("-inf"))

        def sample(x: torch.Tensor) -> torch.Tensor:
            q = torch.empty_like(probs).exponential_()
            return x.softmax(-1).div_(q).argmax(-1)

        host.append(rs.step(taps.__getitem__, logits, temp, sample))

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
    errors_before = len(rs.runtime.bus.errors)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with_esamp(10**6)
        # A sync inside the consumer's callbacks raised there: the runtime's isolation caught
        # it as the consumer's error (the step went on without it).
        caught = rs.runtime.bus.errors[errors_before:]
        sync = f"synced: {caught[0]['error']}" if caught else "no sync"
    except RuntimeError as err:
        sync = f"synced: {err}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    res = c.result()
    rs.close()
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
