"""The pre-registered analysis (benchmarks/confirm.py) on synthetic runs."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import confirm  # noqa: E402


def test_auc_is_the_mean_over_k_1_2_4_8_16():
    assert confirm.auc([0, 16], 16) == [0.0, 1.0]
    (one,) = confirm.auc([1], 16)
    assert one == pytest.approx(np.mean([k / 16 for k in (1, 2, 4, 8, 16)]))


def test_holm_step_down():
    out = confirm.holm({"a": 0.01, "b": 0.02, "c": 0.04})
    assert [out[k]["p_holm"] for k in "abc"] == pytest.approx([0.03, 0.04, 0.04])
    assert [out[k]["reject"] for k in "abc"] == [True, True, True]
    out = confirm.holm({"a": 0.01, "b": 0.06, "c": 0.001})
    assert out["c"]["reject"] and out["a"]["reject"] and not out["b"]["reject"]


def test_noninferiority_margin():
    rng = np.random.default_rng(0)
    b = rng.uniform(0, 1, 200)
    assert confirm.noninferior(list(b - 0.01 + rng.normal(0, 0.01, 200)), list(b))["pass"]
    assert not confirm.noninferior(list(b - 0.08 + rng.normal(0, 0.01, 200)), list(b))["pass"]


def _runs(shift: float, ppl_esamp: float):
    rng = np.random.default_rng(1)
    base = rng.integers(0, 12, 130)
    names = ["vanilla", "esamp_sel_b0.25", "frozen_sel_b0.25", "fnoise_sel_b0.25"]
    up = {"esamp_sel_b0.25": int(round(shift * 4))}
    counters = {"groups_created": 0, "staleness_max": 0, "optimizer_steps": 5}
    passk = {
        "config": {"n": 16},
        "methods": {
            m: {
                "per_problem": {"correct": [int(min(16, c + up.get(m, 0))) for c in base]},
                "mean_tokens": 80.0,
                "consumers": [] if m == "vanilla" else ["esamp:{}"],
                "counters": {}
                if m == "vanilla"
                else {"esamp": {**counters, "groups_created": 130}},
            }
            for m in names
        },
    }
    vendi = rng.uniform(2, 4, 48)
    div = {
        "methods": {
            m: {
                "per_prompt": {
                    "vendi": list(vendi + (shift if m == "esamp_sel_b0.25" else 0.0)),
                    "ppl": [ppl_esamp if m == "esamp_sel_b0.25" else 10.0] * 48,
                },
                "consumers": [] if m == "vanilla" else ["esamp:{}"],
                "counters": {} if m == "vanilla" else {"esamp": {**counters, "groups_created": 48}},
            }
            for m in names
        }
    }
    return passk, div


@pytest.mark.parametrize(
    "shift, ppl, wins, default",
    [
        (0.5, 10.2, (True, True), True),
        (0.0, 10.2, (False, False), False),
        (0.5, 11.0, (True, False), True),
    ],
)
def test_decide(shift, ppl, wins, default):
    passk, div = _runs(shift, ppl)
    out = confirm.decide(
        passk, div, "esamp_sel_b0.25", ["frozen_sel_b0.25", "fnoise_sel_b0.25"], "frozen_sel_b0.25"
    )
    assert (out["learning_wins"]["passk"], out["learning_wins"]["diversity"]) == wins
    assert out["quality_guard"] == (ppl <= 10.5) and out["vendi_at_matched_ppl"] is None
    assert out["default_follows_selection"] == default
    assert len(out["tests"]) == 4 and out["pass16_vs_vanilla"]["pass"]
    assert out["validity"] == {"valid": True, "problems": []}


def test_vendi_at_matched_ppl_interpolates_vanilla_per_prompt():
    ppl = {"vanilla": [10.0, 20.0], "vanilla_t0.8": [6.0, 10.0], "e": [8.0, 30.0]}
    ven = {"vanilla": [4.0, 5.0], "vanilla_t0.8": [2.0, 3.0], "e": [3.5, 6.0]}
    div = {"methods": {k: {"per_prompt": {"ppl": ppl[k], "vendi": ven[k]}} for k in ppl}}
    out = confirm.matched_ppl(div, "e")
    # prompt 0: vanilla interpolated at ppl 8 -> 3.0 (delta 0.5); prompt 1: ppl 30 is above
    # vanilla's range, nearest end 5.0 (delta 1.0).
    assert out["mean_delta"] == pytest.approx(0.75) and out["outside"] == 1
    assert confirm.matched_ppl({"methods": {"vanilla": {}, "e": {}}}, "e") is None


def test_validity_catches_missing_groups_staleness_and_short_answers():
    passk, div = _runs(0.5, 10.0)
    passk["methods"]["frozen_sel_b0.25"]["counters"]["esamp"]["groups_created"] = 129
    div["methods"]["fnoise_sel_b0.25"]["counters"]["esamp"]["staleness_max"] = 1
    passk["methods"]["vanilla"]["mean_tokens"] = 23.0
    div["methods"]["esamp_sel_b0.25"]["counters"]["esamp"]["optimizer_steps"] = 0
    bad = confirm.validity(passk, div)
    assert not bad["valid"] and len(bad["problems"]) == 4


def test_vanilla_temperatures_option():
    import argparse

    import diversity

    p = argparse.ArgumentParser()
    ms = diversity.vanilla_temperatures(p, "0.7, 1.2")
    assert [(m["name"], m["kind"], m["temperature"]) for m in ms] == [
        ("vanilla_t0.7", "vanilla_t", 0.7),
        ("vanilla_t1.2", "vanilla_t", 1.2),
    ]
    assert diversity.vanilla_temperatures(p, None) == []
    with pytest.raises(SystemExit):
        diversity.vanilla_temperatures(p, "0.7,-1")


def _stage0(fits: dict[str, tuple[float, dict]], **counters):
    base = {"groups_created": 3, "optimizer_steps": 10, "staleness_max": 0} | counters
    configs = {
        name: {
            "config": {"beta": 0.25, "diagnostics": True, **cfg},
            "fit_5_60": fit,
            "counters": dict(base),
        }
        for name, (fit, cfg) in fits.items()
    }
    command = "python benchmarks/esamp_tokens.py " + " ".join(
        f"--config '{n}={{}}'" for n in sorted(fits)
    )
    return {"problems": 3, "configs": configs, "command": command}


def test_stage0_rule_lowest_fit_then_fewest_departures_then_loop_order():
    import stage0_select as s0

    paper = {
        "source_layer": 0,
        "lr": 4e-4,
        "loss_reduction": "sum",
        "init": "paper",
        "warm_start_steps": 0,
    }
    run = _stage0(
        {
            "a_far": (0.500, {**paper, "source_layer": 4, "init": "zero_output"}),
            "b_near": (0.504, {**paper, "lr": 1e-3}),  # tied (within 0.005), one departure
            "c_out": (0.506, dict(paper)),  # outside the tie: the recipe itself loses
            "d_near": (0.503, {**paper, "warm_start_steps": 32}),  # tied, one departure, later
        }
    )
    out = s0.select(run)
    assert out["valid"] and out["tied"] == ["a_far", "b_near", "d_near"]
    assert out["selected"] == "b_near"  # fewer departures than a_far, earlier than d_near
    assert out["sel"] == {**paper, "lr": 1e-3}  # without beta and diagnostics
    assert (
        s0.select(_stage0({"x": (0.9, paper), "y": (0.1, {**paper, "lr": 1e-3})}))["selected"]
        == "y"
    )  # a clear winner wins whatever its departures


@pytest.mark.parametrize(
    "counters", [{"groups_created": 2}, {"optimizer_steps": 0}, {"staleness_max": 1}]
)
def test_stage0_rule_refuses_a_run_with_missing_work(counters):
    import stage0_select as s0

    out = s0.select(_stage0({"a": (0.5, {}), "b": (0.6, {})}, **counters))
    assert not out["valid"] and out["sel"] is None and len(out["problems"]) == 2


@pytest.mark.parametrize("shift, says", [(0.5, "pass@k yes, diversity yes"), (0.0, "pass@k no")])
def test_markdown_verdict_reads_the_decision(shift, says):
    passk, div = _runs(shift, 10.2)
    ablations = ["frozen_sel_b0.25", "fnoise_sel_b0.25"]
    out = confirm.decide(passk, div, "esamp_sel_b0.25", ablations, "frozen_sel_b0.25")
    text = confirm.markdown(out, passk, div, "esamp_sel_b0.25")
    assert says in text and "Validity: valid." in text
    for key, t in out["tests"].items():
        name, abl = key.split(":")
        row = next(r for r in text.splitlines() if r.startswith(f"| {name}: `{abl}`"))
        assert f"{t['mean_delta']:+.4f}" in row and f"{t['p_holm']:.4f}" in row
    means = confirm._means(passk, div)["esamp_sel_b0.25"]
    assert f"| `esamp_sel_b0.25` | {means['auc']:.4f} |" in text


def _commands(text: str) -> list[list[str]]:
    """The ``python benchmarks/...`` commands of a bash text, as words up to a redirection."""
    import shlex

    out = []
    for line in text.replace("\\\n", " ").splitlines():
        if line.strip().startswith("python benchmarks/"):
            words = shlex.split(line.replace('"$SEL"', "SEL").replace('"$SHARP"', "SHARP"))
            out.append(words[: words.index(">")] if ">" in words else words)
    return out


def test_stage1_script_runs_the_pre_registered_commands_as_written():
    """benchmarks/confirm_stage1.sh (the resumable runner) runs the plan's stage-1 commands
    word for word (docs/history.md), with SEL from stage 0's rule."""
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "history.md").read_text()
    plan = doc[doc.index("**Stage 1 — confirmation") :]
    plan = plan[plan.index("```bash") : plan.index("```", plan.index("```bash") + 7)]
    script = (root / "benchmarks" / "confirm_stage1.sh").read_text()
    planned = _commands(plan)
    assert [c[1] for c in planned] == [
        "benchmarks/passk.py",
        "benchmarks/diversity.py",
        "benchmarks/confirm.py",
    ]
    assert "$(python benchmarks/stage0_select.py benchmarks/results/confirm_stage0.json " in script
    assert _commands(script)[:3] == planned
    assert 'SHARP=\'sharp={"init": "zero_output", "train": false}\'' in plan
    assert 'SHARP=\'sharp={"init": "zero_output", "train": false}\'' in script


def test_an_invalid_run_is_reported_not_analysed():
    passk, div = _runs(0.5, 10.2)  # a clear win, were it valid
    passk["methods"]["vanilla"]["mean_tokens"] = 23.0
    ablations = ["frozen_sel_b0.25", "fnoise_sel_b0.25"]
    out = confirm.decide(passk, div, "esamp_sel_b0.25", ablations, "frozen_sel_b0.25")
    assert out["learning_wins"]["passk"] and not out["default_follows_selection"]
    text = confirm.markdown(out, passk, div, "esamp_sel_b0.25")
    assert text.startswith("Validity: INVALID") and "helps" not in text and "| `" not in text
