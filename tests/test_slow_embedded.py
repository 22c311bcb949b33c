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
