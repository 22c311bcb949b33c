"""A third-party plugin (tests/plugin_pkg) declares its own per-request key and a ``tllm``
subcommand, and tllm checks built-in and plugin keys the same way offline as the server does
(tests/test_serving.py covers the server). Nothing under tllm_core/ names the plugin."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ENGINE_KW, run_cli

ROOT = Path(__file__).resolve().parent.parent
CONSUMERS = [
    {"name": "tally", "per_request": True},
    {"name": "esamp", "per_request": True, "config": {"beta": 0.5}},
]


def test_core_names_no_plugin():
    for path in (ROOT / "tllm_core").rglob("*"):
        if path.suffix in (".py", ".md"):
            text = path.read_text()
            for name in ("tally", "recorder", "tllm_test_recorder"):
                assert not re.search(rf"\b{name}\b", text), f"{path.relative_to(ROOT)}: {name!r}"


def test_plugin_subcommand_runs_through_tllm():
    proc = run_cli("recorder-hello", "--name", "Ada", "--times", "2", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["hello Ada from tllm_test_recorder"] * 2
    proc = run_cli("recorder-hello", "--times", "0", timeout=120)
    assert proc.returncode == 2 and "tllm: recorder-hello: --times must be >= 1" in proc.stderr
    proc = run_cli("--help", timeout=120)
    assert "recorder-hello" in proc.stdout and "export" in proc.stdout and "steer" in proc.stdout


def test_tllm_consumers_lists_request_keys():
    proc = run_cli("consumers", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tllm_tally_weight: int | None, >= 0, <= 1000  weight of this request's" in proc.stdout
    assert "tllm_esamp_beta: float | None, >= 0, <= 1000.0, finite" in proc.stdout
    assert "tllm_steer_scale" in proc.stdout


@pytest.mark.vllm
def test_plugin_key_offline_good_value_counts_and_bad_value_fails_first(tiny_model, engines):
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM

    llm = engines.get(
        ("plugin-keys", tiny_model), lambda: TllmLLM(tiny_model, CONSUMERS, **ENGINE_KW)
    )

    def tally():
        return llm.collect()["consumers"]["tally"]

    def params(**extra):
        return SamplingParams(max_tokens=5, ignore_eos=True, seed=1, extra_args=extra or None)

    t0 = tally()
    llm.generate(["Hello there"], params(), use_tqdm=False)  # tally not named: idle
    t1 = tally()
    assert t1.get("tokens", 0) == t0.get("tokens", 0)
    llm.generate(["Hello there"], params(tllm_consumers="tally"), use_tqdm=False)
    t2 = tally()
    assert t2["tokens"] - t1.get("tokens", 0) == 5
    assert t2["weighted_tokens"] - t1.get("weighted_tokens", 0) == 5  # config weight 1
    llm.generate(
        ["Hello there"], params(tllm_consumers="tally", tllm_tally_weight="7"), use_tqdm=False
    )
    t3 = tally()
    assert t3["tokens"] - t2["tokens"] == 5
    assert t3["weighted_tokens"] - t2["weighted_tokens"] == 35

    steps = llm.collect()["runtime"]["engine_steps"]
    bad = [
        ({"tllm_consumers": "tally", "tllm_tally_weight": -1}, "'tllm_tally_weight'] must be >= 0"),
        ({"tllm_consumers": "tally", "tllm_tally_weight": "x"}, "must be a whole number, got 'x'"),
        ({"tllm_tally_weight": 2}, "'tally' is not active for this request"),
        # Built-in keys follow the same path: no silent fallback to the configured beta.
        ({"tllm_consumers": "esamp", "tllm_esamp_beta": -0.5}, "'tllm_esamp_beta'] must be >= 0"),
        ({"tllm_consumers": "esamp", "tllm_esamp_beta": "lots"}, "must be a number"),
        ({"tllm_steer_scale": 2}, "needs the 'steer' consumer, which this engine does not run"),
    ]
    for extra, msg in bad:
        # The bad request is the second one: nothing of the call may run.
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")) as ei:
            llm.generate(["a", "b"], [params(), params(**extra)], use_tqdm=False)
        assert "extra_args[" in str(ei.value)
    assert llm.collect()["runtime"]["engine_steps"] == steps, "a rejected call generated"
    assert tally()["tokens"] == t3["tokens"]
