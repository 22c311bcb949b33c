"""ESamp's GPU readiness in one command, torch only (pydantic for the consumer's parts; no vLLM):

    python benchmarks/gpu_smoke.py [--device cuda|cpu] [--quick] [--out smoke.json]

Parts (each a key of the JSON printed on the last line and written to ``--out``):

1. ``cuda_tests``: ``tests/test_esamp_cuda.py`` (the CUDA distiller against the CPU math),
   ``tests/test_esamp_kernels.py`` (the Triton kernels, compiled) and
   ``tests/test_fake_cuda.py`` (its GPU checks: what the fake device flags must synchronise on
   a GPU, what it passes must not) in a subprocess; on CPU they skip, so they run only with
   ``--device cuda``.
2. ``esamp_step`` (CUDA, needs pydantic): ESamp's whole decode step at 7B shapes for 8 x 16,
   1 x 128 and 64 x 16 beside a synthetic decode step (``esamp_gpu_step.bench_step``): device
   time added and ratio, host time of the consumer's calls, the floor, a step under
   ``set_sync_debug_mode("error")``, the memory plan against what was allocated; and the
   issue-36 targets checked (``targets``).
3. ``kernels``: ``gpu_kernels.bench_kernels`` (the fused kernels against their bytes floor and
   against the former bmm + fused Adam path); ``--quick`` or CPU: tiny shapes.
4. ``distiller``: the distiller alone (``gpu_distiller.bench_distiller``) at 7B shapes for 8 and
   64 groups, each variant, with the update's bytes per parameter; CPU: tiny shapes.
5. ``memory``: the plan against ``torch.cuda.memory_allocated`` after building the distiller
   and ``max_memory_allocated`` over predict + train steps; on CPU the fake device's counts
   of an ESamp step (``esamp_fake_step``) stand in.
6. ``syncs``: synchronising operations of the distiller's step and of the two candidate
   searches (``sync_count.SyncCounter``; on CUDA also under the sync debug mode) and of the
   consumer's decode step when pydantic is there.
7. ``compiled_taps``: tllm's residual taps with edits, ``torch.compile``'d and (CUDA only)
   captured in a CUDA graph, against eager (``compiled_taps.run``); ``--quick`` skips it.

The CUDA parts of this version have never run on a GPU (the first GPU run, of the code before
issue 36's rebuild: docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from compiled_taps import run as run_compiled_taps  # noqa: E402
from gpu_distiller import bench_distiller, update_bytes_per_param  # noqa: E402
from gpu_kernels import QUICK_SHAPES, bench_kernels  # noqa: E402
from sync_count import SyncCounter  # noqa: E402

from algorithms.esamp.memory_plan import GIB, plan_memory  # noqa: E402

VOCAB_7B = 152064


def _shape(quick: bool, device: torch.device) -> dict[str, int]:
    if quick or device.type == "cpu":
        return dict(hidden=256, intermediate=64, rows=4, iters=3, warmup=1, repeats=1)
    return dict(hidden=3584, intermediate=384, rows=16, iters=50, warmup=10, repeats=3)


def run_cuda_tests(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"skipped": "needs a CUDA device"}
    t0 = time.time()
    tests = ["tests/test_esamp_cuda.py", "tests/test_esamp_kernels.py", "tests/test_fake_cuda.py"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *tests, "-q", "--noconftest", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=900,
    )
    return {"rc": proc.returncode, "seconds": time.time() - t0, "tail": proc.stdout[-3000:]}


def run_distiller(device: torch.device, quick: bool) -> dict[str, Any]:
    s = _shape(quick, device)
    variants = (
        ["eager_side", "graph_main", "graph_side"] if device.type == "cuda" else ["eager_main"]
    )
    out: dict[str, Any] = {}
    for groups in (8, 64) if not quick else (2, 4):
        args = SimpleNamespace(groups=groups, blocks=2, **s)
        out[f"groups_{groups}"] = {v: bench_distiller(v, args, device) for v in variants}
        out[f"groups_{groups}"]["bytes_per_param"] = update_bytes_per_param(args, device)
    return {"shape": s, "results": out}


def _distiller(device: torch.device, hidden: int, inter: int, slots: int, rows: int):
    if device.type == "cuda":
        from algorithms.esamp.cuda import CudaGroupedDistiller

        return CudaGroupedDistiller(
            hidden, device=device, intermediate_size=inter, capacity=slots, graph_max_rows=rows
        )
    from algorithms.esamp.cpu import GroupedDistiller

    return GroupedDistiller(hidden, intermediate_size=inter, capacity=slots)


def run_memory(device: torch.device, quick: bool) -> dict[str, Any]:
    """CUDA: the plan against what the distiller allocates. CPU: the fake device's counts of
    the distiller's step (predict + update allocate nothing per step there: graph replays)."""
    s = _shape(quick, device)
    h, inter, rows = s["hidden"], s["intermediate"], s["rows"]
    out: dict[str, Any] = {}
    for groups in (8, 64) if not quick else (2, 4):
        plan = plan_memory(
            h, VOCAB_7B, slots=groups, graph_rows=rows, rows_per_step=groups * rows,
            intermediate_size=inter,
        )  # fmt: skip
        rec: dict[str, Any] = {"plan": plan.as_dict()}
        # The plan's terms that the distiller alone allocates (no guidance here).
        distiller_plan = plan.total_bytes - plan.guidance_workspace_bytes
        slots = torch.arange(groups).repeat_interleave(rows)
        if device.type == "cuda":
            x = torch.randn(groups * rows, h, device=device)
            t = x + 0.1 * torch.randn_like(x)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            d = _distiller(device, h, inter, groups, rows)
            torch.cuda.synchronize(device)
            rec["built_bytes"] = torch.cuda.memory_allocated(device) - base
            live = torch.tensor([d.alloc() for _ in range(groups)])[slots]
            for _ in range(3):
                d.predict(live, x)
                d.train_step(live, x, t)
            d.synchronize()
            rec["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
            rec["plan_distiller_bytes"] = distiller_plan
            rec["within_plan"] = rec["peak_bytes"] <= distiller_plan
            d.close()
            del d
        else:
            from algorithms.esamp.cuda import CudaGroupedDistiller
            from tllm_core.testing.fake_cuda import FakeCuda

            with FakeCuda() as fc:
                d = CudaGroupedDistiller(
                    h, device=fc.device, intermediate_size=inter, capacity=groups,
                    graph_max_rows=rows,
                )  # fmt: skip
                live = torch.tensor([d.alloc() for _ in range(groups)])[slots]
                x = torch.zeros(groups * rows, h, device=fc.device)
                fc.start_steps()
                for _ in range(2):
                    with fc.step():
                        d.predict(live, x)
                        d.train_step(live, x, x)
                step = fc.report()["steps"]["per_step"][-1]
            rec["fake_device_step"] = {
                k: step[k]
                for k in ("launches", "bytes", "allocation", "host_wait", "pageable_copy")
            }
            rec["within_plan"] = step["allocation"] == 0
        rec["plan_gib"] = round(plan.total_bytes / GIB, 4)
        out[f"groups_{groups}"] = rec
    out["qwen2.5_7b_default_plan"] = plan_memory(
        3584, VOCAB_7B, slots=8, graph_rows=16, rows_per_step=128
    ).as_dict()
    return out


def run_esamp_step(device: torch.device, quick: bool) -> dict[str, Any]:
    """ESamp's whole step beside the synthetic decode step, and the issue-36 targets."""
    if device.type != "cuda":
        return {"skipped": "needs a CUDA device (counts on CPU: benchmarks/esamp_fake_step.py)"}
    try:
        from esamp_gpu_step import bench_step
    except ImportError as err:
        return {"skipped": f"the consumer is not importable: {err}"}
    iters = 5 if quick else 30
    out: dict[str, Any] = {}
    for prompts, n in ((8, 16), (1, 128), (64, 16)):
        out[f"{prompts}x{n}"] = bench_step(device, prompts, n, iters=iters)
        torch.cuda.empty_cache()
    a, b, c = out["8x16"], out["1x128"], out["64x16"]
    out["targets"] = {
        "8x16 adds <= 0.6 ms and ratio >= 0.90": a["added_ms"] <= 0.6 and a["ratio"] >= 0.90,
        "1x128 adds <= 0.15 ms and ratio >= 0.97": b["added_ms"] <= 0.15 and b["ratio"] >= 0.97,
        "host <= 0.3 ms per step": max(x["host_ms"] for x in (a, b, c)) <= 0.3,
        "64x16 within 1.3 x its floor": c["added_over_floor"] <= 1.3,
        "no sync in a step": all(x["sync_debug"] == "no sync" for x in (a, b, c)),
        "memory within plan": all(x["memory"]["within_plan"] for x in (a, b, c)),
    }
    return out


def run_kernels(device: torch.device, quick: bool) -> dict[str, Any]:
    return bench_kernels(device, QUICK_SHAPES if quick or device.type == "cpu" else None)


def candidate_syncs(device: torch.device, rows: int = 128, vocab: int = VOCAB_7B) -> dict:
    """Syncs of the two candidate searches on min-p-filtered logits (SyncCounter), and on
    CUDA the fixed-size search and write under ``torch.cuda.set_sync_debug_mode("error")``,
    which raises at any real synchronisation."""
    from tllm_core.api.candidates import candidate_entries, top_candidate_entries

    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, generator=g) * 3
    p = logits.softmax(-1)
    logits[p < 0.1 * p.amax(-1, keepdim=True)] = float("-inf")
    out: dict[str, Any] = {"rows": rows, "vocab": vocab}
    with SyncCounter() as sc:
        candidate_entries(logits)
    out["exact"] = dict(sc.kinds)

    def fixed() -> None:
        top = top_candidate_entries(logits, 64)
        logits.scatter_(1, top.tokens, torch.where(top.valid, top.logits + 1, top.logits))

    with SyncCounter() as sc:
        fixed()
    out["fixed_size"] = dict(sc.kinds)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            fixed()
            out["fixed_size_cuda_sync_debug"] = "no sync"
        except RuntimeError as err:
            out["fixed_size_cuda_sync_debug"] = f"synced: {err}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out


def run_syncs(device: torch.device) -> dict[str, Any]:
    h, inter, groups, rows = 64, 32, 4, 4
    d = _distiller(device, h, inter, groups, rows)
    live = torch.tensor([d.alloc() for _ in range(groups)]).repeat_interleave(rows)
    x = torch.randn(groups * rows, h, device=device)
    per_step = []
    for _ in range(3):
        with SyncCounter() as sc:
            d.predict(live, x)
            d.train_step(live, x, x)
        per_step.append(dict(sc.kinds))
    d.synchronize()
    d.close()
    out: dict[str, Any] = {"distiller_step": per_step, "candidate_search": candidate_syncs(device)}
    try:
        sys.path.insert(0, str(ROOT / "tests"))
        from test_esamp_syncs import syncs_per_step
    except ImportError as err:  # the consumer needs pydantic
        out["consumer_step"] = {"skipped": f"consumer not importable: {err}"}
    else:
        out["consumer_step"] = {m: syncs_per_step(m) for m in ("post_filter", "full_vocab")}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CI)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    t0 = time.time()
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "quick": args.quick,
    }
    parts = (
        ("cuda_tests", lambda: run_cuda_tests(device)),
        ("esamp_step", lambda: run_esamp_step(device, args.quick)),
        ("kernels", lambda: run_kernels(device, args.quick)),
        ("distiller", lambda: run_distiller(device, args.quick)),
        ("memory", lambda: run_memory(device, args.quick)),
        ("syncs", lambda: run_syncs(device)),
        (
            "compiled_taps",
            lambda: {"skipped": "--quick"} if args.quick else run_compiled_taps(device),
        ),
    )
    for name, fn in parts:
        t = time.time()
        try:
            out[name] = fn()
        except Exception as err:  # one broken part must not hide the others' results
            out[name] = {"error": f"{type(err).__name__}: {err}"}
        print(f"[gpu_smoke] {name}: {time.time() - t:.1f} s", file=sys.stderr)
    out["seconds"] = time.time() - t0
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
