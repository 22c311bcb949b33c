"""``gpu_smoke.py --device fake``: the dress rehearsal of the GPU smoke run on CPU. Every
CUDA-only branch of the smoke run and of the benchmarks it calls runs on the fake CUDA device
(docs/fake-cuda.md), so a typo fails on any machine, not on the GPU; every value
of a rehearsed part is null, so none of it passes for a measurement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path[:0] = [str(ROOT), str(BENCH)]

import gpu_smoke  # noqa: E402

PARTS = ("cuda_tests", "esamp_step", "kernels", "distiller", "memory", "syncs", "compiled_taps")

# The smoke run needs no vLLM, and pydantic only for the consumer's parts (docs/gpu.md).
_WITHOUT_VLLM = """
import builtins, runpy, sys
real = builtins.__import__
def guarded(name, *args, **kwargs):
    if name.split(".")[0] == "vllm":
        raise ImportError("not on the GPU image: " + name)
    return real(name, *args, **kwargs)
builtins.__import__ = guarded
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _leaves(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items():
            if k not in gpu_smoke.KEEP:
                yield from _leaves(v, f"{path}/{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, x


@pytest.fixture(scope="module")
def rehearsal_run(tmp_path_factory) -> dict:
    out_file = tmp_path_factory.mktemp("rehearsal") / "smoke.json"
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_VLLM, str(BENCH / "gpu_smoke.py")]
        + ["--device", "fake", "--out", str(out_file)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out_file.read_text()) == out
    return out


def test_every_part_runs_its_cuda_branch_in_the_rehearsal(rehearsal_run):
    """At the GPU run's shapes (one iteration), each part runs its CUDA branch to the end
    on the fake device and says so; a CUDA-only line that raises fails here."""
    out = rehearsal_run
    assert out["rehearsal"] is True and out["device"] == gpu_smoke.DEVICE_NAME
    for part in PARTS:
        assert "error" not in out[part], (part, out[part])
        assert out[part]["ran_on"] == gpu_smoke.RAN_ON, (part, out[part])
    # What only the CUDA branches produce.
    assert "tests collected" in out["cuda_tests"]["rehearsal"]["collect_only"]
    assert set(out["esamp_step"]) >= {"8x16", "1x128", "64x16", "targets"}
    assert "within_plan" in out["esamp_step"]["64x16"]["memory"]
    assert "sweep" in out["kernels"]["cases"][0] and len(out["kernels"]["cases"]) == 3
    for g in ("groups_8", "groups_64"):
        assert set(out["distiller"]["results"][g]) == {
            "eager_side", "graph_main", "graph_side", "bytes_per_param",
        }  # fmt: skip
        assert "peak_bytes" in out["memory"][g]  # torch.cuda's counters, not the fake's
    assert "fixed_size_cuda_sync_debug" in out["syncs"]["candidate_search"]
    assert "replay_max_abs_diff" in out["compiled_taps"]["cuda_graph"]


def test_nothing_in_the_rehearsal_passes_for_a_measurement(rehearsal_run):
    """Every number, flag and string of a rehearsed part is null; only ``ran_on``,
    ``skipped``, ``error`` and the rehearsal's own notes are kept."""
    values = [(p, v) for part in PARTS for p, v in _leaves(rehearsal_run[part], part)]
    assert len(values) > 200
    assert [(p, v) for p, v in values if v is not None] == []
    assert "seconds" not in rehearsal_run and "part_seconds" not in rehearsal_run


def test_the_fake_device_sees_no_sync_in_the_gpu_runs_sync_checks(rehearsal_run):
    """The windows where the GPU run sets ``set_sync_debug_mode("error")`` (ESamp's step for
    each layout, the fixed-size candidate search) have no host wait or pageable copy on the
    fake device, no graph capture has one, and the Triton launches were built."""
    rec = rehearsal_run["rehearsal_record"]
    windows = rec["sync_debug_windows_seen_by_fake_device"]
    assert [w["set_at"].split(":")[0] for w in windows] == ["esamp_step.py"] * 3 + ["gpu_smoke.py"]
    assert [w["host_waits_and_pageable_copies"] for w in windows] == [0, 0, 0, 0], windows
    assert rec["capture_failures_seen_by_fake_device"] == []
    assert rec["triton_launches_built_not_run"]["grad_adam"] > 0
    assert rec["triton_launches_built_not_run"]["slot_matmul"] > 0


def test_a_sync_under_the_sync_debug_mode_raises_as_on_a_gpu(monkeypatch):
    """A host read slipped into the fixed-size candidate search: the rehearsal raises at it,
    as ``set_sync_debug_mode("error")`` does on a GPU, and names its line."""
    import tllm_core.api.candidates as candidates

    top = candidates.top_candidate_entries

    def reads_back(logits, k):
        out = top(logits, k)
        out.valid.any().item()  # the slipped-in host read
        return out

    monkeypatch.setattr(candidates, "top_candidate_entries", reads_back)
    with gpu_smoke.rehearsal() as r:
        out = gpu_smoke.candidate_syncs(r.device, rows=4, vocab=64)
    assert out["fixed_size_cuda_sync_debug"].startswith("synced: FakeCuda: host_wait")
    (window,) = r.sync_windows
    assert window["host_waits_and_pageable_copies"] == 1
    assert "out.valid.any().item()" in window["sites"][0]


def test_a_part_that_raises_is_reported_with_its_line_and_the_rest_still_run(monkeypatch):
    def broken() -> dict:
        return {"x": torch.cuda.no_such_function()}

    monkeypatch.setattr(
        gpu_smoke,
        "_parts",
        lambda device, quick: (("broken", broken), ("fine", lambda: {"ms": 1.5, "ok": True})),
    )
    with gpu_smoke.rehearsal() as r:
        out = gpu_smoke.smoke(r.device, quick=True)
    assert out["broken"]["ran_on"] == "not run"
    assert "AttributeError" in out["broken"]["error"]
    assert "test_gpu_rehearsal.py" in out["broken"]["traceback"]
    assert out["fine"] == {"ran_on": gpu_smoke.RAN_ON, "ms": None, "ok": None}


def test_the_rehearsal_puts_everything_back():
    from algorithms.esamp import factory
    from tllm_core.testing import fake_cuda

    def patched() -> tuple:
        return (
            torch.Generator, torch.compile, factory.uses_gpu_path, torch.cuda.memory_allocated,
            torch.cuda.set_sync_debug_mode, torch.cuda.is_available, torch.cuda.Event,
        )  # fmt: skip

    before = patched()
    with gpu_smoke.rehearsal() as r:
        assert fake_cuda.is_cuda(r.device) and gpu_smoke.active() is r
        assert torch.Generator(device=r.device).device.type == "cpu"
        assert torch.cuda.memory_allocated() == 0
    assert patched() == before and gpu_smoke.active() is None
    assert not fake_cuda.is_cuda("meta")


def test_the_cuda_tests_keep_the_carried_wheels_on_their_path(monkeypatch):
    """Packages installed into a folder on PYTHONPATH (``pip --target``: pydantic, say) stay
    visible: the CUDA tests' subprocess puts the checkout first and keeps that path."""
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    assert gpu_smoke.tests_env()["PYTHONPATH"].split(":") == [str(ROOT), "/tmp/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert gpu_smoke.tests_env()["PYTHONPATH"] == str(ROOT)


def test_parts_not_started_within_the_budget_are_skipped(monkeypatch):
    import time

    def slow() -> dict:
        time.sleep(0.2)
        return {}

    monkeypatch.setattr(
        gpu_smoke, "_parts", lambda device, quick: (("slow", slow), ("late", lambda: {"x": 1}))
    )
    out = gpu_smoke.smoke(torch.device("cpu"), quick=True, budget_s=0.1)
    assert out["slow"] == {"ran_on": "cpu"}
    assert out["late"] == {"ran_on": "not run", "skipped": "past the run's budget of 0 s"}
    assert set(out["part_seconds"]) == {"slow", "late"}


def _example(spec: list):
    """An argument of the kind the rehearsal recorded (see ``gpu_smoke._arg_spec``)."""
    if spec[0] == "tensor":
        return torch.empty(16, dtype=getattr(torch, spec[1]))
    return 0.5 if spec[0] == "float" else spec[1]


def test_every_triton_launch_of_the_gpu_run_compiles_for_sm90(rehearsal_run):
    """The rehearsal runs ESamp's kernel operators through their CUDA implementation (the
    argument checks, the launch built, not run): every distinct launch of the GPU run (ESamp's
    step at the three layouts, the distiller, the kernels' tile sweep) compiles for an
    H100/H200 without one, so a GPU run never meets a Triton compile error."""
    pytest.importorskip("triton", reason="Triton is not installed here")
    from test_esamp_kernels import _compile_sm90

    from algorithms.esamp.kernels.launch import Launch

    configs = rehearsal_run["rehearsal_record"]["triton_configs"]
    assert {c["kernel"] for c in configs} == {"grad_adam", "slot_matmul", "candidate_dot"}
    # One compile per kernel, constants, warps and dtypes (not per integer specialisation).
    distinct = {
        repr((c["kernel"], c["constexprs"], c["num_warps"], [a[:2] for a in c["args"] if a[0] == "tensor"])): c
        for c in configs
    }  # fmt: skip
    assert len(distinct) >= 20  # tiles x rows blocks x split_k x precisions x moment dtypes
    for c in distinct.values():
        args = tuple(_example(a) for a in c["args"])
        ptx, _ = _compile_sm90(Launch(c["kernel"], (1,), args, c["constexprs"], c["num_warps"]))
        assert ".entry" in ptx, c


def test_the_kernel_operators_check_their_arguments_in_the_rehearsal():
    """On the fake device alone ESamp's kernel operators do nothing (their meta kernel), so
    an argument only the CUDA implementation refuses would first fail on a GPU; in the
    rehearsal they run that implementation's checks."""
    from tllm_core.testing.fake_cuda import FakeCuda

    def bf16_input(device: torch.device) -> None:
        x = torch.empty(2, 4, 8, dtype=torch.bfloat16, device=device)  # must be fp32
        w, out = torch.empty(3, 16, 8, device=device), torch.empty(2, 4, 16, device=device)
        torch.ops.tllm_esamp.slot_matmul(x, w, torch.tensor([0, 2], device=device), out)

    with FakeCuda() as fc:
        bf16_input(fc.device)  # not seen
    with gpu_smoke.rehearsal() as r, pytest.raises(ValueError, match="x must be"):
        bf16_input(r.device)


def test_the_gpu_runs_step_check_reports_a_sync_in_the_consumers_step(monkeypatch):
    """``esamp_step.bench_step`` runs one ESamp step under ``set_sync_debug_mode("error")``:
    a host read slipped into the consumer's ``guide`` is reported there (``sync_debug``: the
    consumer's error, as the runtime that drives it caught it), the rest of the step's record
    still comes back."""
    import esamp_step

    from algorithms.esamp.consumer import ESampConsumer

    guide = ESampConsumer.guide

    def reads_back(self, view):
        view.logits.amax().item()  # the slipped-in host read
        return guide(self, view)

    monkeypatch.setattr(ESampConsumer, "guide", reads_back)
    with gpu_smoke.rehearsal() as r:
        res = esamp_step.bench_step(r.device, 1, 16, iters=1, warmup=1)
    # Raised inside the consumer's guide, caught by the runtime's isolation as its error.
    assert res["sync_debug"].startswith("synced: consumer 'esamp' raised in guide"), res
    assert "FakeCuda: host_wait" in res["sync_debug"], res["sync_debug"]
    assert "view.logits.amax().item()" in r.sync_windows[0]["sites"][0]
