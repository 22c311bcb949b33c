"""ESamp's GPU readiness in one command, torch only (pydantic for the consumer's parts; no vLLM):

    python benchmarks/gpu_smoke.py [--device cuda|cpu|fake] [--quick] [--out smoke.json]
                                   [--budget-s 200]

Seven parts (:func:`_parts`), each a key of the JSON printed on the last line and written to
``--out`` after each part, each saying where it ran (``ran_on``); what each checks and what a
pass looks like: docs/gpu.md. ``--device fake`` is the dress rehearsal (:func:`rehearsal`):
every CUDA-only line runs on CPU on the fake CUDA device at the GPU run's shapes, one
iteration; every value of its JSON is null (it checks the code, it measures nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from bench_setup import code_version, section, table  # noqa: E402
from compiled_taps import run as run_compiled_taps  # noqa: E402
from gpu_distiller import (  # noqa: E402
    QUICK_SHAPES,
    QWEN2_7B,
    SHAPES_7B,
    bench_distiller,
    bench_kernels,
    distiller_variants,
    make,
    plan,
)
from update_bytes import distiller_inputs, update_bytes_per_param  # noqa: E402

from algorithms.esamp.memory_plan import GIB, plan_memory  # noqa: E402
from tllm_core.testing import fake_cuda  # noqa: E402
from tllm_core.testing.counters import SyncCounter  # noqa: E402
from tllm_core.testing.fake_cuda import FakeCuda, is_cuda  # noqa: E402

CUDA_TESTS = [
    "tests/test_esamp_cuda.py",
    "tests/test_esamp_kernels.py",
    "tests/test_esamp_ops_reference.py",
    "tests/test_fake_cuda.py",
]
BUDGET_S = 300.0  # parts not started by then are skipped: the run ends near 4 minutes
CUDA_TESTS_TIMEOUT_S = 240  # a hung test must not take the whole run (H200: about 100 s)
RAN_ON = (
    "rehearsal: FakeCuda on CPU (meta tensors, stub streams, events and graphs); "
    "nothing measured, every value null"
)
DEVICE_NAME = "FakeCuda rehearsal (not a GPU)"
KEEP = frozenset({"ran_on", "skipped", "error", "traceback", "rehearsal"})
# The distiller's shapes: 7B on a GPU, tiny with --quick or on CPU.
FULL = dict(hidden=3584, intermediate=384, blocks=2, rows=16, iters=20, warmup=5, repeats=3)
SMALL = dict(hidden=256, intermediate=64, blocks=2, rows=4, iters=3, warmup=1, repeats=1)


def active() -> FakeCuda | None:
    """The rehearsal in progress, if any."""
    fc = fake_cuda.active()
    return fc if fc is not None and fc.rehearsal else None


def scrub(value: Any, key: str | None = None) -> Any:
    """``value`` with every leaf null except under the keys of :data:`KEEP`: no rehearsal
    output can pass for a measurement."""
    if key in KEEP:
        return value
    if isinstance(value, dict):
        return {k: scrub(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v) for v in value]
    return None


def _arg_spec(arg: Any) -> list:
    """A kernel argument as Triton's JIT specialises it: a tensor's dtype; an int as 1, a
    multiple of 16 (16) or another (3); a float."""
    if isinstance(arg, torch.Tensor):
        return ["tensor", str(arg.dtype).removeprefix("torch.")]
    if isinstance(arg, float):
        return ["float"]
    return ["int", 1 if arg == 1 else 16 if arg % 16 == 0 else 3]


@contextlib.contextmanager
def rehearsal() -> Iterator[FakeCuda]:
    """The fake CUDA device as a rehearsal (``FakeCuda(rehearsal=True)``: docs/fake-cuda.md)
    where ESamp takes its CUDA path and its kernel operators run their CUDA implementation's
    checks, each Triton launch built and recorded (for a compile check for sm_90), not run."""
    from algorithms.esamp import factory
    from algorithms.esamp.kernels import ops, triton_available

    names = ("grad_adam", "slot_matmul", "candidate_dot")
    kernels = {f"tllm_esamp::{n}": ops.CUDA_IMPLS[n] for n in names}
    with FakeCuda(device_name=DEVICE_NAME, rehearsal=True, kernels=kernels) as fc:
        fc.patch(factory, {"uses_gpu_path": is_cuda})
        if triton_available():
            from algorithms.esamp.kernels import launch, triton_impl

            def run(launch: Any, kernels: Any = None) -> None:
                config = {"kernel": launch.kernel, "constexprs": dict(launch.constexprs)}
                config["num_warps"] = launch.num_warps
                config["args"] = [_arg_spec(a) for a in launch.args]
                fc.launch_built(launch.kernel, config)

            fc.patch(launch.Launch, {"run": run})
            # The GPU's SM count (the fake's properties: 132) picks split_k, as there.
            sms = torch.cuda.get_device_properties(fc.device).multi_processor_count
            fc.patch(triton_impl, {"_sm_count": lambda device: sms})
        yield fc


def rehearsal_record(fc: FakeCuda) -> dict[str, Any]:
    """The rehearsal's own record (JSON-able; not a measurement of anything)."""
    built = "Triton launches built with their grids, not run (meta tensors)"
    return {
        "triton_launches_built_not_run": dict(fc.launches_built),
        "triton_configs": list(fc.launch_configs.values()),
        "triton": built if fc.launches_built else "no Triton launch reached",
        "sync_debug_windows_seen_by_fake_device": list(fc.sync_windows),
        # A host wait or pageable copy inside a graph capture: the GPU's capture fails.
        "capture_failures_seen_by_fake_device": [
            f"{f.kind} at {f.where}: {f.code} x{f.count}" for f in fc.failures()
        ],
        "torch_compile": "not rehearsed (identity under the fake device)",
    }


def _shape(quick: bool, device: torch.device, small: dict, full: dict) -> dict:
    """``small`` with ``--quick`` or on CPU, else ``full``; in the rehearsal one iteration."""
    s = dict(small if quick or device.type == "cpu" else full)
    if active():  # the GPU run's shapes, one iteration: nothing is timed
        s.update((k, 1) for k in ("iters", "warmup", "repeats") if k in s)
    return s


def _free(device: torch.device) -> None:
    """Free what the last case left (reference cycles included) back to the device."""
    if is_cuda(device):
        gc.collect()
        torch.cuda.empty_cache()


def tests_env() -> dict[str, str]:
    """The CUDA tests' environment: the checkout first, then the caller's PYTHONPATH (where
    packages installed with ``pip --target`` are: pydantic for the consumer's test)."""
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def run_cuda_tests(device: torch.device) -> dict[str, Any]:
    if not is_cuda(device):
        return {"skipped": "needs a CUDA device"}
    t0 = time.time()
    rehearsing = active() is not None
    # The rehearsal collects the tests (they import, and exist): on CPU they would skip.
    collect = ["--collect-only"] if rehearsing else []
    argv = [sys.executable, "-m", "pytest", *CUDA_TESTS, "-q", "--noconftest", "-rfE"]
    try:
        proc = subprocess.run(
            [*argv, "--tb=line", "-p", "no:cacheprovider", *collect],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=tests_env(),
            timeout=CUDA_TESTS_TIMEOUT_S,
        )
        rc, stdout = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as err:  # what ran so far still tells
        rc, stdout = f"timed out after {CUDA_TESTS_TIMEOUT_S} s", err.stdout or ""
        stdout = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout
    # Each failure's one line (--tb=line) and its summary line (-rfE), whatever the tail holds.
    failed = [line[:400] for line in stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    out = {"rc": rc, "seconds": time.time() - t0, "failed": failed, "tail": stdout[-3000:]}
    if rehearsing:
        if rc != 0:
            raise RuntimeError(f"collecting {CUDA_TESTS} failed:\n{stdout[-2000:]}")
        out["rehearsal"] = {"collect_only": stdout.strip().splitlines()[-1]}
    return out


def run_distiller(device: torch.device, quick: bool) -> dict[str, Any]:
    s = _shape(quick, device, SMALL, FULL)
    out: dict[str, Any] = {}
    for groups in (2, 4) if quick else (8, 64):
        args = SimpleNamespace(groups=groups, **s)
        res = out[f"groups_{groups}"] = {}
        for v in distiller_variants(device):
            res[v] = bench_distiller(v, args, device)
            _free(device)  # the variant's distiller (6 GB at 64 groups) before the next
        res["bytes_per_param"] = update_bytes_per_param(args, device)
    return {"shape": s, "results": out}


def run_memory(device: torch.device, quick: bool) -> dict[str, Any]:
    """CUDA: the plan against what the distiller allocates. CPU: the fake device's counts of
    the distiller's step (predict + update allocate nothing per step there: graph replays)."""
    s = _shape(quick, device, SMALL, FULL)
    out: dict[str, Any] = {}
    for groups in (2, 4) if quick else (8, 64):
        args = SimpleNamespace(groups=groups, **s)
        p = plan(args)
        rec: dict[str, Any] = {"plan": p.as_dict()}
        if is_cuda(device):
            slots, x, t = distiller_inputs(args, device)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            d = make("graph_side", args, device)
            torch.cuda.synchronize(device)
            rec["built_bytes"] = torch.cuda.memory_allocated(device) - base
            live = torch.tensor([d.alloc() for _ in range(groups)])[slots]
            for _ in range(3):
                d.predict(live, x)
                d.train_step(live, x, t)
            d.synchronize()
            rec["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
            # The plan's terms that the distiller alone allocates (no guidance here).
            rec["plan_distiller_bytes"] = p.total_bytes - p.guidance_workspace_bytes
            rec["within_plan"] = rec["peak_bytes"] <= rec["plan_distiller_bytes"]
            d.close()
        else:
            with FakeCuda() as fc:
                d = make("graph_side", args, fc.device)
                slots, x, _ = distiller_inputs(args, fc.device)
                live = torch.tensor([d.alloc() for _ in range(groups)])[slots]
                fc.start_steps()
                for _ in range(2):
                    with fc.step():
                        d.predict(live, x)
                        d.train_step(live, x, x)
                step = fc.report()["steps"]["per_step"][-1]
            keys = ("launches", "bytes", "allocation", "host_wait", "pageable_copy")
            rec["fake_device_step"] = {k: step[k] for k in keys}
            rec["within_plan"] = step["allocation"] == 0
        rec["plan_gib"] = round(p.total_bytes / GIB, 4)
        out[f"groups_{groups}"] = rec
    out["qwen2.5_7b_default_plan"] = plan_memory(
        3584, QWEN2_7B["vocab"], slots=8, graph_rows=16, rows_per_step=128
    ).as_dict()
    return out


def run_esamp_step(device: torch.device, quick: bool) -> dict[str, Any]:
    """ESamp's whole step beside the synthetic decode step, and its targets."""
    if not is_cuda(device):
        return {"skipped": "needs a CUDA device (counts on CPU: benchmarks/esamp_step.py)"}
    try:
        from esamp_step import bench_step

        import algorithms.esamp.consumer  # noqa: F401  (pydantic: bench_step imports it late)
    except ImportError as err:
        return {"skipped": f"the consumer is not importable: {err}"}
    s = _shape(quick, device, dict(iters=5, warmup=5), dict(iters=30, warmup=5))
    out: dict[str, Any] = {}
    for prompts, n in ((8, 16), (1, 128), (64, 16)):
        out[f"{prompts}x{n}"] = bench_step(device, prompts, n, **s)
        _free(device)  # each layout's 14 GB synthetic model before the next one's
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


def candidate_syncs(device: torch.device, rows: int = 128, vocab: int = QWEN2_7B["vocab"]) -> dict:
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
    if is_cuda(device):
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
    args = SimpleNamespace(hidden=64, intermediate=32, blocks=2, groups=4, rows=4)
    d = make("graph_side", args, device)
    slots, x, _ = distiller_inputs(args, device)
    live = torch.tensor([d.alloc() for _ in range(args.groups)])[slots]
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
        from test_esamp_syncs import syncs_per_step
    except ImportError as err:  # the consumer needs pydantic
        out["consumer_step"] = {"skipped": f"consumer not importable: {err}"}
    else:
        out["consumer_step"] = {m: syncs_per_step(m) for m in ("post_filter", "full_vocab")}
    return out


def _error(err: Exception) -> dict[str, str]:
    """The part's error with where it was raised (the innermost frames)."""
    frames = traceback.extract_tb(err.__traceback__)[-4:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames))
    return {"error": f"{type(err).__name__}: {err}", "traceback": where}


def _parts(device: torch.device, quick: bool) -> tuple:
    return (
        ("cuda_tests", lambda: run_cuda_tests(device)),
        ("esamp_step", lambda: run_esamp_step(device, quick)),
        ("kernels", lambda: bench_kernels(device, _shape(quick, device, QUICK_SHAPES, SHAPES_7B))),
        ("distiller", lambda: run_distiller(device, quick)),
        ("memory", lambda: run_memory(device, quick)),
        ("syncs", lambda: run_syncs(device)),
        ("compiled_taps", lambda: {"skipped": "--quick"} if quick else run_compiled_taps(device)),
    )


def smoke(
    device: torch.device, quick: bool, out_path: str | None = None, budget_s: float = BUDGET_S
) -> dict[str, Any]:
    """Every part on ``device`` (the fake device inside :func:`rehearsal`), the JSON so far
    written to ``out_path`` after each; parts not started within ``budget_s`` are skipped."""
    rehearsal = active()
    device_name = torch.cuda.get_device_name(device) if is_cuda(device) else device.type
    ran_on = RAN_ON if rehearsal is not None else device_name
    t0 = time.time()
    out: dict[str, Any] = {
        "device": device_name,
        "rehearsal": rehearsal is not None,
        "torch": torch.__version__,
        "code": code_version(),
        "quick": quick,
    }
    seconds: dict[str, float] = {}
    for name, fn in _parts(device, quick):
        t = time.time()
        try:
            past = t - t0 > budget_s
            res = {"skipped": f"past the run's budget of {budget_s:.0f} s"} if past else fn()
        except Exception as err:  # one broken part must not hide the others' results
            res = _error(err)
        if rehearsal is not None and "error" not in res:
            res = scrub(res)
        ok = "error" not in res and "skipped" not in res
        out[name] = {"ran_on": ran_on if ok else "not run", **res}
        seconds[name] = round(time.time() - t, 2)
        where = "rehearsal" if rehearsal is not None and ok else out[name]["ran_on"]
        print(f"[gpu_smoke] {name}: {seconds[name]:.1f} s ({where})", file=sys.stderr)
        if out_path:  # a run cut short keeps what it finished
            Path(out_path).write_text(json.dumps(out))
    if rehearsal is not None:  # the rehearsal's own timings: CPU seconds, not the GPU's
        out["rehearsal_record"] = {**rehearsal_record(rehearsal), "cpu_seconds": seconds}
    else:
        out["part_seconds"] = seconds
        out["seconds"] = time.time() - t0
    if out_path:
        Path(out_path).write_text(json.dumps(out))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", default="cuda", help="cuda, cpu, or fake (the rehearsal: nothing measured)"
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes (CI)")
    p.add_argument("--out", default=None, help="also write the JSON here (after each part)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help="skip the parts not started this many seconds into the run",
    )
    args = p.parse_args(argv)
    # A part that hangs (a stream or graph waiting forever) prints every thread's stack.
    faulthandler.dump_traceback_later(args.budget_s + 120, exit=False)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device (use --device cpu, or fake to rehearse)", file=sys.stderr)
        return 2
    with rehearsal() if args.device == "fake" else contextlib.nullcontext() as r:
        device = r.device if r else torch.device(args.device)
        out = smoke(device, args.quick, args.out, args.budget_s)
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps(out))
    return 0


def render(sm: dict[str, Any]) -> str:
    """The docs/results.md section of a ``--out`` result: each part's figures, one row each."""
    rows: list[list[Any]] = []
    mem, sy = sm["memory"], sm["syncs"]
    for k, rec in mem.items():
        if k.startswith("groups_"):
            if step := rec.get("fake_device_step"):
                got = f"{step['allocation']} allocations per step (fake device)"
            else:  # a record without its figures fails here rather than showing None
                got = f"{rec['peak_bytes']} bytes measured, {rec['plan_distiller_bytes']} planned"
            rows += [[f"memory, {k[7:]} slots", got]]
            rows += [[f"memory, {k[7:]} slots, within plan", rec["within_plan"]]]
    if "qwen2.5_7b_default_plan" in mem:
        gib = mem["qwen2.5_7b_default_plan"]["total_gib"]
        rows.append(["memory plan, Qwen2.5-7B defaults (GiB)", f"{gib:.3f}"])
    steps = {"distiller step": sy.get("distiller_step")}
    steps |= {f"ESamp step ({m})": c for m, c in sy.get("consumer_step", {}).items()}
    for k, c in steps.items():
        if c is None:
            continue
        if not (isinstance(c, list) and c and isinstance(c[-1], dict)):
            raise ValueError(f"syncs of the {k}: expected a list of counts per step, got {c!r}")
        rows.append([f"host syncs, {k}", sum(c[-1].values())])
    search = sy.get("candidate_search") or {}
    rows += [
        [f"host syncs, {k} candidate search", sum(v.values())]
        for k, v in search.items()
        if k in ("exact", "fixed_size")
    ]
    for k, rec in sm["distiller"].get("results", {}).items():
        for name, v in (rec.get("bytes_per_param") or {}).items():
            rows.append([f"update bytes per parameter, {k[7:]} groups, {name}", f"{v:.1f}"])
    ct = sm.get("compiled_taps") or {}
    if "compiled_max_abs_diff" in ct:
        replay = ct["cuda_graph"].get("replay_max_abs_diff")
        rows += [
            ["compiled taps, max abs diff from eager", f"{max(ct['compiled_max_abs_diff']):.1e}"],
            ["CUDA graph taps, max abs diff", f"{max(replay):.1e}" if replay else "not run"],
        ]
    rows += [
        ["not run", f"{part}: {rec['skipped']}"]
        for part, rec in sm.items()
        if isinstance(rec, dict) and "skipped" in rec
    ]
    device = f"{sm['device']}, torch {sm['torch']}"
    flag = "cpu" if sm["device"] == "cpu" else "cuda"
    command = f"python benchmarks/gpu_smoke.py --device {flag} --out FILE"
    tables = [*_gpu_tables(sm), table(["figure", "value"], rows)]
    return section(
        f"GPU smoke run on {sm['device']}", {**sm, "machine": {"device": device}}, *tables,
        command=command,
    )  # fmt: skip


def _gpu_tables(sm: dict[str, Any]) -> list[str]:
    """The parts that only a GPU measures: the CUDA tests' outcome, ESamp's step beside the
    synthetic decode step and its targets, the kernels against their bytes' floor."""
    out: list[str] = []
    ct = sm["cuda_tests"]
    if "rc" in ct:
        outcome = (ct["tail"].strip().splitlines() or ["no output"])[-1].strip("= ")
        rows = [["CUDA tests (" + ", ".join(Path(t).stem for t in CUDA_TESTS) + ")", outcome]]
        rows += [["failed", line] for line in ct.get("failed", [])]
        out.append(table(["check", "outcome"], rows))
    es = sm["esamp_step"]
    if "targets" in es:
        head = ["prompts x n", "plain step ms", "with ESamp ms", "added ms", "ratio"]
        head += ["floor ms", "added / floor", "host ms", "host ms, pipelined", "memory MiB / plan"]
        rows = []
        for k, v in es.items():
            if not (isinstance(v, dict) and "memory" in v):  # ran_on, targets
                continue
            mem = v["memory"]
            used = f"{mem['peak_bytes'] / 2**20:.0f} / {mem['plan_bytes'] / 2**20:.0f}"
            rows.append(
                [k, *(f"{v[f]:.3f}" for f in ("plain_ms", "esamp_ms", "added_ms", "ratio")),
                 f"{v['floor_ms']:.3f}", f"{v['added_over_floor']:.2f}", f"{v['host_ms']:.2f}",
                 f"{v.get('host_pipelined_ms', float('nan')):.2f}", used]
            )  # fmt: skip
        out.append(table(head, rows))
        out.append(table(["target", "met"], [[k, v] for k, v in es["targets"].items()]))
    kern = sm["kernels"]
    if kern.get("ran_on") not in (None, "cpu", "not run") and "cases" in kern:
        rows = [
            [f"{c['groups']} of {c['capacity']}", name, f"{c[name]['ms']:.3f}"]
            + [f"{c[name]['x_floor']:.2f}"]
            for c in kern["cases"]
            for name in ("grad_adam", "grad_adam_bf16", "slot_matmul", "dense_matmul")
            if name in c
        ]
        out.append(table(["groups of slots", "kernel", "ms", "x its bytes' floor"], rows))
    return out


if __name__ == "__main__":
    sys.exit(main())
