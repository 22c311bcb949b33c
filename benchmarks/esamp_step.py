"""ESamp's decode step at Qwen2.5-7B shapes (hidden 3584, vocabulary 152064, bf16 states):

    python benchmarks/esamp_step.py [--json] [--steps 3] [--configs]       # counted, no GPU
    from esamp_step import bench_step; bench_step(torch.device("cuda"), prompts=8, n=16)

Counted (default, any machine; ``tests/esamp_steps.py``): on the fake CUDA device, per layout,
mode and beta schedule, the launches, bytes moved, allocations, host waits and pageable copies
(the last three must be 0) of the consumer alone and of the whole step through tllm's runtime,
ESamp on every request and per request. ``--configs``: each setting of ``CONFIGS`` at 8 x 16.
Timed: :func:`bench_step` (CUDA; ``gpu_smoke.py`` runs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from bench_setup import code_version, section, table  # noqa: E402
from esamp_steps import CONFIGS, COUNTED_PER_REQUEST, LAYOUTS, MODES, run, run_runtime  # noqa: E402
from gpu_distiller import QWEN2_7B, time_us  # noqa: E402

from algorithms.esamp.kernels import grad_adam_bytes, slot_matmul_bytes  # noqa: E402

H, V, I_DIST, BLOCKS = QWEN2_7B["hidden"], QWEN2_7B["vocab"], 384, 2


def copy_bandwidth(device: torch.device, mib: int = 1024) -> float:
    """Device copy bandwidth (read + write bytes per second) of a large copy."""
    a = torch.empty(mib * 2**20 // 4, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / (time_us(lambda: b.copy_(a), 10, device, warmup=1) / 1e6)


class SyntheticDecode:
    """The linear layers of a Qwen2-7B-shaped decoder at ``rows`` tokens in bf16, one CUDA
    graph (attention left out: a lower bound of a decode step). A replay rewrites ``h1`` (the
    first layer's output), ``hL`` (the last one's) and ``logits``."""

    def __init__(self, rows: int, device: torch.device):
        spec, dtype = QWEN2_7B, torch.bfloat16
        h, i = spec["hidden"], spec["intermediate"]
        qkv = (spec["q_heads"] + 2 * spec["kv_heads"]) * spec["head_dim"]
        w = lambda o, k: torch.randn(o, k, device=device, dtype=dtype) * 0.01  # noqa: E731
        self.layers = [(w(qkv, h), w(h, h), w(2 * i, h), w(h, i)) for _ in range(spec["layers"])]
        self.head = w(spec["vocab"], h)
        self.x = torch.randn(rows, h, device=device, dtype=dtype)
        self.h1 = torch.empty(rows, h, device=device, dtype=torch.float32)
        self.hL = torch.empty(rows, h, device=device, dtype=torch.float32)
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            for _ in range(2):
                self._run()
        torch.cuda.current_stream(device).wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._run()

    def _run(self) -> torch.Tensor:
        h = self.x
        for li, (wqkv, wo, wgu, wd) in enumerate(self.layers):
            a = h @ wqkv.T
            h = h + a[:, : wo.shape[1]] @ wo.T
            g, u = (h @ wgu.T).chunk(2, dim=-1)
            h = h + (torch.nn.functional.silu(g) * u) @ wd.T
            h = torch.nn.functional.rms_norm(h, (h.shape[-1],))
            if li == 0:
                self.h1.copy_(h)
        self.hL.copy_(h)
        return h @ self.head.T

    def run_logits(self) -> torch.Tensor:
        """One step (the graph) and its logits (the graph's static output)."""
        self.graph.replay()
        return self.logits


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


def _min_p(logits: torch.Tensor) -> torch.Tensor:
    """The min-p 0.1 filter, in place as vLLM's."""
    probs = logits.softmax(-1)
    return logits.masked_fill_(probs < 0.1 * probs.amax(-1, keepdim=True), float("-inf"))


def _sample(logits: torch.Tensor) -> torch.Tensor:
    """An exponential-race sample: no host sync."""
    return logits.softmax(-1).div_(torch.empty_like(logits).exponential_()).argmax(-1)


def bench_step(
    device: torch.device, prompts: int, n: int, iters: int = 30, warmup: int = 5, **cfg: Any
) -> dict[str, Any]:
    """ms per step of :class:`SyntheticDecode` and a sampler stand-in (min-p 0.1, exponential
    race: no host sync), plain and with ESamp through tllm's runtime: what ESamp adds, the host
    time of the runtime's calls (``host_ms`` from an idle GPU; ``host_pipelined_ms`` in the
    timed run, where a launch may wait for room in the GPU's queue), ESamp's floor (its bytes
    at the measured copy bandwidth), a step under ``torch.cuda.set_sync_debug_mode("error")``,
    the memory plan against ESamp's peak (what it built and what its step adds)."""
    from esamp_steps import RuntimeStep

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
    torch.cuda.synchronize(device)
    built = torch.cuda.memory_allocated(device) - base
    temp = torch.ones(r, device=device)
    host: list[float] = []

    # The runtime's taps: ESamp's source layer (the synthetic step's first layer output) and
    # the final state.
    taps = {k: decode.hL if k == "final" else decode.h1 for k in rs.tap_keys}

    def logits() -> torch.Tensor:
        return _min_p(decode.run_logits().float())

    def plain() -> None:
        _sample(logits())

    def with_esamp() -> None:
        host.append(rs.step(taps.__getitem__, logits(), temp, _sample))

    def peak_of(fn: Callable[[], Any]) -> tuple[float, int]:
        """ms per step of ``fn`` and the peak allocation above ``base`` meanwhile."""
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        ms = time_us(fn, iters, device, warmup, 3) / 1e3
        return ms, torch.cuda.max_memory_allocated(device) - base

    # A plain step, then one with ESamp; ESamp's memory is what it built and what its step
    # adds to the peak of a plain step (the synthetic sampler's temporaries are not ESamp's).
    (plain_ms, peak_plain), (esamp_ms, peak_esamp) = map(peak_of, (plain, with_esamp))
    pipelined_ms = statistics.median(host) * 1e3  # launches may wait on a full GPU queue
    host.clear()
    for _ in range(iters):  # the host's own time: the GPU idle at each step's start
        torch.cuda.synchronize(device)
        with_esamp()
    host_ms = statistics.median(host) * 1e3
    peak = built + max(0, peak_esamp - peak_plain)
    torch.cuda.synchronize(device)
    errors_before = len(rs.runtime.bus.errors)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with_esamp()
        # A sync inside the consumer's callbacks raised there: the runtime's isolation caught
        # it as the consumer's error (the step went on without it).
        caught = rs.runtime.bus.errors[errors_before:]
        sync = f"synced: {caught[0]['error']}" if caught else "no sync"
    except RuntimeError as err:
        sync = f"synced: {err}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    res = rs.consumer.result()  # bounded: a consumer's result, not a future
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
        "host_pipelined_ms": pipelined_ms,
        "floor_ms": floor_ms,
        "added_over_floor": added / floor_ms,
        "copy_bandwidth": bw,
        "sync_debug": sync,
        "memory": {
            "plan_bytes": plan["total_bytes"],
            "built_bytes": built,
            "step_bytes": peak - built,
            "peak_bytes": peak,
            "within_plan": peak <= plan["total_bytes"],
        },
        "counters": {
            k: res["counters"][k]
            for k in ("optimizer_steps", "rows_guided", "graph_failures", "eager_updates")
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--configs", action="store_true", help="also each setting of CONFIGS at 8 x 16")
    args = p.parse_args(argv)
    grid = [(pr, n, mode, fit) for pr, n in LAYOUTS for mode in MODES for fit in (False, True)]
    configs = []
    for name, opts in CONFIGS if args.configs else ():
        fit = opts.get("beta_schedule") == "fit"
        rest = {k: v for k, v in opts.items() if k != "beta_schedule"}
        for mode in MODES:
            configs.append({"config": name, **run(8, 16, mode, fit, args.steps, **rest)})
    result = {
        "torch": torch.__version__,
        "code": code_version(),
        "results": [run(*g, args.steps) for g in grid],
        # The whole step through tllm's runtime, with stream-order checks.
        "runtime": [run_runtime(*g, args.steps, order=True) for g in grid],
        "runtime_per_request": [
            run_runtime(pr, n, mode, False, args.steps, order=True, per_request=pq)
            for pr, n in LAYOUTS
            for mode in MODES
            for pq in COUNTED_PER_REQUEST
            if pr > 1 or pq == "block"
        ],
        "configurations": configs,
    }
    print(json.dumps(result) if args.json else render(result))
    return 0


def render(fs: dict[str, Any]) -> str:
    """The docs/results.md section of a ``--json`` result: ESamp's step alone, through the
    runtime, per request and per setting, each row a count on the fake device."""
    rows = []
    for where, key in (
        ("consumer", "results"),
        ("runtime", "runtime"),
        ("runtime", "runtime_per_request"),
        ("consumer", "configurations"),
    ):
        for r in fs.get(key, []):
            per_request = f"per request ({r['per_request']})" if "per_request" in r else where
            layout = f"{r['prompts']} x {r['n']}" if "prompts" in r else "8 x 16"
            beta = "fit" if r.get("fit") else "constant"
            counts = [r["launches"], f"{r['bytes'] / 1e9:.2f}", r["allocations"]]
            for v in (r["host_waits"], r.get("pageable_copies", 0)):  # a list of sites, or a count
                counts.append(len(v) if isinstance(v, list) else v)
            rows.append([layout, r.get("config") or per_request, r["mode"], beta, *counts])
    head = ["prompts x n", "driven by", "mode", "beta", "launches", "GB moved", "allocations"]
    return section(
        "ESamp decode step on the fake CUDA device",
        fs,
        table([*head, "host waits", "pageable copies"], rows),
        command="python benchmarks/esamp_step.py --configs --json",
    )


if __name__ == "__main__":
    sys.exit(main())
