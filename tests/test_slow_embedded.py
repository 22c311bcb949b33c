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
    every row equal transformers' on the same tokens while ESamp trains and guides.

    30 fp32 layers with large activations (up to ~2.5e4 at layer 14) differ from
    transformers by kernel order: each state is compared at 1e-4 of its own scale (on V1
    the errors are the same; docs/runners.md)."""
    import json

    import torch
    from cli_util import v2_env
    from reference import hf_states, sequences_from_rows
    from test_capture_truth import PROMPTS

    from tllm_core.app.default_model import default_model_path

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
    seqs = sequences_from_rows(result["rows"], result["sampled"])
    assert len(seqs) == len(PROMPTS) * 2
    checked = 0
    for key, seq in seqs.items():
        ref = hf_states(model, seq)
        rows = [r for r in result["rows"] if (r["request_id"], r["sample_index"]) == key]
        assert sorted(r["position"] for r in rows) == list(range(len(seq) - 1)), key
        for r in rows:
            assert r["token_id"] == seq[r["position"]]
            for k, v in r["hidden"].items():
                want = ref[k][r["position"]]
                err = (torch.tensor(v) - want).abs().max().item()
                assert err <= 1e-4 * max(1.0, want.abs().max().item()), (key, r["position"], k, err)
                checked += 1
    assert checked == 4 * sum(len(s) - 1 for s in seqs.values())
    assert out["errors"] == []
