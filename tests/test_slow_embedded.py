"""The main job on the embedded SmolLM2-135M-Instruct (slow; select with -m slow)."""

from __future__ import annotations

import math

import pytest
from conftest import cli_json, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_main_job_esamp_on_embedded_model():
    out = cli_json(
        run_cli(
            "run",
            "--consumer",
            "esamp",
            "--chat",
            "-n",
            "4",
            "--max-tokens",
            "48",
            "--min-p",
            "0.1",
            "--seed",
            "0",
            "--json",
            timeout=900,
        )
    )
    es = out["counters"]["esamp"]
    assert len(out["outputs"]) == 1 and len(out["outputs"][0]) == 4
    assert all(t.strip() for t in out["outputs"][0])
    for name in ("optimizer_steps", "rows_trained", "rows_guided", "candidates_guided"):
        assert es[name] > 0, name
    assert math.isfinite(es["loss_last"]) and es["groups_alive"] == 0
    assert out["errors"] == []


def test_embedded_model_on_model_runner_v2_captures_like_transformers_and_guides():
    """The embedded model on vLLM's V2 runner (test fixture): residual and final states of
    every row equal transformers' on the same tokens while ESamp trains and guides."""
    import json

    from cli_util import v2_env
    from reference import sequences_from_rows
    from test_capture_truth import PROMPTS, check_against_hf

    from tllm_core.default_model import default_model_path

    model = str(default_model_path())
    rec = json.dumps({"layers": [0, 14, -1, "final"]})
    args = ["run", "--consumer", f"recorder:{rec}", "--consumer", 'esamp:{"beta": 0.5}']
    args += ["--chat", "-n", "2", "--max-tokens", "6", "--min-p", "0.1", "--seed", "0"]
    args += ["--enforce-eager", "--no-prefix-caching", "--json"]
    for p in PROMPTS:
        args += ["--prompt", p]
    out = cli_json(run_cli(*args, env=v2_env(), timeout=1500))
    assert out["run"]["runner"].startswith("V2 runner"), out["run"]["runner"]
    es = out["counters"]["esamp"]
    for name in ("optimizer_steps", "rows_trained", "rows_guided", "candidates_guided"):
        assert es[name] > 0, name
    result = out["results"]["recorder"]
    assert len(sequences_from_rows(result["rows"], result["sampled"])) == len(PROMPTS) * 2
    assert check_against_hf(model, result, 30, 2) > 0
    assert out["errors"] == []
