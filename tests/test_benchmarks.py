"""Small, fast runs of the benchmark scripts: they work and their JSON has the documented fields.

The numbers belong to the benchmark runs (docs/results.md), not to these tests.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
SMALL_ENGINE = ["--enforce-eager", "--kv-cache-gib", "1", "--max-model-len", "256"]
# 2 prompts x n=2 x 4 tokens.
SMALL_WORKLOAD = "--prompts 2 -n 2 --max-tokens 4".split()


def _run(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def _json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _load(name: str):
    if str(BENCH) not in sys.path:  # the scripts import their siblings (bench_setup, throughput)
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_prompt_file_has_40_creative_prompts():
    lines = [ln for ln in (BENCH / "prompts.txt").read_text().splitlines() if ln.strip()]
    assert len(lines) >= 40 and len(set(lines)) == len(lines)


def test_throughput_case_selection_and_no_work_check():
    tp = _load("throughput")
    assert tp.select_cases(None) == tp.DEFAULT_CASES
    assert tp.select_cases(["esamp"]) == ["plain", "esamp"]
    # a case outside the defaults runs when named
    assert "sae_background" not in tp.DEFAULT_CASES
    assert tp.select_cases(["sae", "sae_background"]) == ["plain", "sae", "sae_background"]
    assert tp.select_cases(['stats:{"layers": [1]}']) == tp.DEFAULT_CASES + [
        'stats:{"layers": [1]}'
    ]
    idle = {"runtime": {"engine_steps": 5}, "esamp": {"optimizer_steps": 0, "rows_guided": 0}}
    assert tp.work_problems("esamp", idle, [])  # counters show no work: the case fails
    busy = {
        "runtime": {"engine_steps": 5, "rows_guided": 9},
        "esamp": {"optimizer_steps": 3, "rows_guided": 9},
    }
    assert tp.work_problems("esamp", busy, []) == []
    assert tp.work_problems("esamp", busy, [{"consumer": "esamp", "error": "boom"}])
    assert tp.work_problems("steer", {"runtime": {"engine_steps": 5, "rows_edited": 0}}, [])


def test_a_throughput_worker_that_never_replies_is_stopped(monkeypatch):
    tp = _load("throughput")
    popen = subprocess.Popen
    started = []

    def silent_worker(argv, **kw):  # starts, but never prints its "ready" line
        started.append(popen([sys.executable, "-c", "import time; time.sleep(60)"], **kw))
        return started[-1]

    monkeypatch.setattr(tp.subprocess, "Popen", silent_worker)
    with pytest.raises(RuntimeError, match="did not reply in 0.5 s"):
        tp._Served({"case": "esamp", "kv_cache_gib": 1, "runner": "v1"}, timeout=0.5)
    assert started[0].wait(10) is not None  # stopped, not left running


def test_diversity_methods_with_an_esamp_variant():
    dv = _load("diversity")
    ms = {m["name"]: m for m in dv.build_methods([0.25], 1.0, {"lr3e-3": {"lr": 0.003}})}
    assert set(ms) == {
        "vanilla",
        "esamp_b0.25",
        "esamp_lr3e-3_b0.25",
        "temp_0.8",
        "noise_b0.25",
        "frozen_b0.25",
        "frozen_lr3e-3_b0.25",  # each variant's own frozen ablation
    }
    spec = json.loads(ms["esamp_lr3e-3_b0.25"]["consumers"][0].split(":", 1)[1])
    assert spec == {"lr": 0.003, "beta": 0.25} and ms["esamp_lr3e-3_b0.25"]["kind"] == "esamp"


@pytest.mark.vllm
@pytest.mark.slow  # the benchmark script end to end (~23 s)
def test_throughput_script_small_run(tiny_model):
    args = "--rounds 1 --method in-process --consumer capture --consumer esamp --json".split()
    proc = _run("throughput.py", "--model", tiny_model, *SMALL_WORKLOAD, *args, *SMALL_ENGINE)
    out = _json(proc)
    assert out["baseline_tok_s"] > 0 and out["ok"] is True
    assert set(out["cases"]) == {"plain", "capture", "esamp"}
    for name, case in out["cases"].items():
        for field in ("tok_s", "ratio", "counters", "peak_rss_mib", "extra_peak_rss_mib"):
            assert field in case, (name, field)
        assert case["tok_s"] > 0 and case["tokens"] == 2 * 2 * 4
    assert out["cases"]["plain"]["ratio"] == pytest.approx(1.0)
    assert out["cases"]["plain"]["counters"] == {}
    assert out["cases"]["capture"]["counters"]["stats"]["bundles"] > 0
    assert out["cases"]["esamp"]["counters"]["esamp"]["rows_guided"] > 0
    assert out["workload"]["tokens_per_case"] == 16 and "machine" in out


@pytest.mark.vllm
@pytest.mark.slow  # the default suite runs the smaller throughput and pass@k runs
def test_throughput_paired_method_small_run(tiny_model):
    """The default method: fresh process pairs, each case alternating with plain."""
    args = "--rounds 1 --restarts 2 --consumer steer --json".split()
    proc = _run("throughput.py", "--model", tiny_model, *SMALL_WORKLOAD, *args, *SMALL_ENGINE)
    out = _json(proc)
    assert out["ok"] is True and out["workload"]["method"] == "paired"
    steer, plain = out["cases"]["steer"], out["cases"]["plain"]
    assert len(steer["ratio_rounds"]) == 2 and len(plain["tok_s_rounds"]) == 2
    assert len(steer["ratio_by_pair"]) == 2
    assert steer["ratio_min"] <= steer["ratio"] <= steer["ratio_max"]
    assert steer["counters"]["runtime"]["rows_edited"] > 0
    assert steer["step_ms_median"] > 0 and steer["step_ratio"] > 0
    assert out["machine"]["loadavg_1m_start"] >= 0


@pytest.mark.vllm
@pytest.mark.slow  # the default suite runs the smaller throughput and pass@k runs
def test_diversity_script_small_run(tiny_model, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Write a poem about the sea.\nTell me a story.\n")
    qd, bars = tmp_path / "qd.png", tmp_path / "bars.png"
    proc = _run(
        "diversity.py",
        "--model",
        tiny_model,
        "--prompts",
        str(prompts),
        "-n",
        "2",
        "--max-tokens",
        "4",
        "--beta",
        "0.5",
        "--ppl-check",
        "2",
        "--plot",
        str(qd),
        "--bars",
        str(bars),
        "--json",
        *SMALL_ENGINE,
    )
    out = _json(proc)
    methods = out["methods"]
    assert set(methods) == {"vanilla", "esamp_b0.5", "temp_0.667", "noise_b0.5", "frozen_b0.5"}
    for name, m in methods.items():
        for metric in ("vendi", "cos_sim", "ppl", "distinct2"):
            assert len(m["per_prompt"][metric]) == 2, (name, metric)
            assert math.isfinite(m["means"][metric]) and metric in m["sem"]
        assert 1.0 <= m["means"]["vendi"] <= 2.0 + 1e-6 and m["means"]["ppl"] > 1
    assert methods["esamp_b0.5"]["counters"]["esamp"]["rows_guided"] > 0
    pairs = {(c["method"], c["against"]) for c in out["comparisons"]}
    assert ("esamp_b0.5", "vanilla") in pairs and ("esamp_b0.5", "frozen_b0.5") in pairs
    cmp = out["comparisons"][0]["metrics"]["vendi"]
    for field in ("prompts", "improved", "mean_delta", "sign_test_p", "t_test_p"):
        assert field in cmp
    # vLLM's raw log-probs agree with transformers on the same tokens
    assert out["ppl_check"]["completions"] >= 1 and out["ppl_check"]["max_abs_nll_diff"] < 1e-3
    assert qd.stat().st_size > 0 and bars.stat().st_size > 0


def test_gpu_distiller_script_cpu_smoke():
    out = _json(
        _run(
            "gpu_distiller.py",
            "--device",
            "cpu",
            "--hidden",
            "64",
            "--groups",
            "2",
            "--rows",
            "4",
            "--intermediate",
            "32",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--json",
            timeout=120,
        )
    )
    d = out["distiller"]["eager_main"]
    assert d["predict_us"] > 0 and d["train_us"] > 0 and out["shape"]["batch_rows"] == 8


# ~17 s; in the default suite: the same script's parts on the fake CUDA device
# (test_gpu_smoke_runs_without_pydantic_or_vllm below, test_gpu_rehearsal.py)
@pytest.mark.slow
def test_gpu_smoke_script_cpu_quick(tmp_path):
    """``gpu_smoke.py --device cpu --quick``: every CPU-possible part runs and reports."""
    out_file = tmp_path / "smoke.json"
    out = _json(
        _run("gpu_smoke.py", "--device", "cpu", "--quick", "--out", str(out_file), timeout=120)
    )
    assert json.loads(out_file.read_text()) == out
    assert out["cuda_tests"] == {"ran_on": "not run", "skipped": "needs a CUDA device"}
    assert "needs a CUDA device" in out["esamp_step"]["skipped"]
    for part in ("kernels", "distiller", "memory", "syncs"):
        assert "error" not in out[part], out[part]
        assert out[part]["ran_on"] == "cpu"
    assert out["rehearsal"] is False and set(out["part_seconds"]) == set(out) & {
        "cuda_tests", "esamp_step", "kernels", "distiller", "memory", "syncs", "compiled_taps",
    }  # fmt: skip
    assert out["kernels"]["cases"][0]["grad_adam"]["bytes_per_param"] <= 26
    assert out["distiller"]["results"]["groups_4"]["eager_main"]["train_us"] > 0
    assert out["distiller"]["results"]["groups_4"]["bytes_per_param"]["graph_update"] > 0
    assert out["compiled_taps"] == {"ran_on": "not run", "skipped": "--quick"}
    mem = out["memory"]
    assert mem["qwen2.5_7b_default_plan"]["total_gib"] <= 1.5
    for k in ("groups_2", "groups_4"):  # the CUDA distiller's step on the fake device
        step = mem[k]["fake_device_step"]
        assert mem[k]["within_plan"] and step["launches"] > 0 and step["allocation"] == 0
        assert step["host_wait"] == step["pageable_copy"] == 0
    syncs = out["syncs"]
    # The CPU distiller's one torch.equal per update compares host tensors (no device there).
    assert syncs["distiller_step"] == [{"equal": 1}] * 3
    assert syncs["consumer_step"]["full_vocab"][-1] == {}
    assert syncs["consumer_step"]["post_filter"][-1] == {}
    search = syncs["candidate_search"]  # the exact search's nonzero, none in the fixed-size one
    assert search["exact"] == {"nonzero": 2} and search["fixed_size"] == {}


# Runs a script with pydantic and vLLM unimportable, as on a GPU machine without them.
_WITHOUT_PYDANTIC = """
import builtins, runpy, sys
real = builtins.__import__
def guarded(name, *args, **kwargs):
    if name.split(".")[0] in ("pydantic", "vllm"):
        raise ImportError("not on the GPU image: " + name)
    return real(name, *args, **kwargs)
builtins.__import__ = guarded
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_gpu_smoke_runs_without_pydantic_or_vllm():
    """The GPU image has torch but neither pydantic nor vLLM (unless the wheels travel):
    gpu_smoke.py's CUDA branches (rehearsed on the fake device) still run, and the consumer's
    parts are skipped, said so."""
    script = str(BENCH / "gpu_smoke.py")
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_PYDANTIC, script, "--device", "fake", "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    out = _json(proc)
    for part in ("cuda_tests", "kernels", "distiller", "memory", "syncs"):
        assert "error" not in out[part] and out[part]["ran_on"].startswith("rehearsal"), out[part]
    assert "not on the GPU image" in out["esamp_step"]["skipped"]
    assert "not on the GPU image" in out["syncs"]["consumer_step"]["skipped"]


@pytest.mark.slow  # a benchmark's smoke run; the default suite fuzzes the server itself
@pytest.mark.vllm
def test_load_script_small_run(tiny_model):
    """``load.py`` on the tiny model, a handful of requests of every kind: both phases report
    and every check holds (no 5xx, good requests finished, bad ones 400, huge ones 413)."""
    args = "--requests 16 --concurrency 4 --max-tokens 4 --enforce-eager --json".split()
    out = _json(_run("load.py", "--model", tiny_model, *args))
    assert out["passed"] is True, out["checks"]
    assert out["phase_order"] == "A, B" and out["tok_s_ratio_polled_to_unpolled"] > 0
    a, b = out["phases"]["A"], out["phases"]["B"]
    assert a["by_kind"] == b["by_kind"] and a["requests"] == 16
    kinds = {"plain", "esamp", "chat_stats", "stream_esamp", "stream_plain", "cancel", "bad"}
    assert set(a["by_kind"]) == kinds | {"huge"}
    assert a["polls"] > 0 and b["polls"] == 0
    for p in (a, b):
        assert p["good_completed"] == p["good_sent"] > 0 and p["status_5xx"] == 0
        assert p["good_tok_s"] > 0 and p["counters_added"]["runtime.requests_finished"] > 0
    rss = out["rss_mib"]
    assert all(0 < rss[k]["front_end"] < rss[k]["total"] for k in ("start", "after_warmup", "end"))
    assert len(a["rss_mib_after_rounds"]) == 1
    assert out["workload"]["concurrency"] == 4 and out["machine"]["loadavg_1m_end"] >= 0
    assert "| A |" in _load("load").render(out)  # docs/results.md renders it


@pytest.mark.slow  # torch.compile of the toy decoder takes 20-30 s on CPU
def test_compiled_taps_follow_edit_buffers_like_eager():
    """The toy decoder's taps, compiled, give eager's outputs, captures, stamps and edit
    counts at each step, as the edit buffers change in place between steps."""
    from compiled_taps import run

    out = run(torch.device("cpu"))
    assert max(out["compiled_max_abs_diff"]) < 1e-5, out
    assert len(set(out["rows_edited_eager"])) > 1  # the edits differ between steps
    assert out["cuda_graph"] == {"skipped": "no CUDA"}


def test_results_page_is_rendered_from_the_saved_results():
    """docs/results.md is what the tools' ``render`` make of benchmarks/results/ (rerun
    ``python benchmarks/report.py`` after saving a result), and every saved result is on it."""
    report = _load("report")
    text = report.page()
    assert (ROOT / "docs" / "results.md").read_text() == text
    used = {name for _, name, _ in report.SECTIONS}
    saved = {p.name for p in (BENCH / "results").glob("*.json")}
    assert saved <= used, f"results no section renders: {sorted(saved - used)}"
    # A GPU run's own parts: the CUDA tests' outcome, ESamp's step and targets, the kernels.
    smoke = _load("gpu_smoke").render(json.loads((BENCH / "results/gpu_smoke.json").read_text()))
    for shown in ("| CUDA tests (", "| 8x16 | ", "| memory within plan | ", "| slot_matmul | "):
        assert shown in smoke, shown


def test_kernel_benchmark_quick_mode_runs_on_cpu():
    """``gpu_distiller.py --kernels``: the fused kernels timed at tiny shapes on CPU, the
    live-slot products equal to ``torch.bmm`` over every slot."""
    res = _load("gpu_distiller").bench_kernels("cpu", _load("gpu_distiller").QUICK_SHAPES)
    case = res["cases"][0]
    assert {"grad_adam", "grad_adam_bf16", "slot_matmul", "dense_matmul"} <= set(case)
    assert case["slot_matmul"]["max_abs_diff_vs_dense"] < 1e-4
