"""benchmarks/passk.py: the pass@k estimator, the task generator and checkers, a small run."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_benchmarks import SMALL_ENGINE, _json, _load, _run

pk = _load("passk")


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_pass_at_k_equals_brute_force_over_subsets(nc):
    n, c = nc
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert math.isclose(pk.pass_at_k(n, c, k), brute, rel_tol=1e-12, abs_tol=1e-12)


def test_pass_at_k_edges_and_bad_input():
    assert pk.pass_at_k(16, 0, 16) == 0.0 and pk.pass_at_k(16, 1, 16) == 1.0
    assert pk.pass_at_k(16, 4, 1) == pytest.approx(0.25)
    curve = pk.pass_curve(8, 2)
    assert len(curve) == 8 and curve == sorted(curve)
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError, match="need 0 <= c <= n"):
            pk.pass_at_k(*bad)


@pytest.mark.parametrize(
    "text, answer",
    [
        ("85", 85),
        ("The answer is 85.", 85),
        ("47 + 38 = 85", 85),
        ("40 + 30 = 70, 7 + 8 = 15, so 85. Answer: 85", 85),
        ("Answer: 85. Check: 85 - 38 = 47", 85),
        ("Answer: 1,200 grams", 1200),
        ("It is -3", -3),
        ("no idea", None),
    ],
)
def test_extract_answer(text, answer):
    assert pk.extract_answer(text) == answer


def test_problems_are_reproducible_distinct_and_checkable():
    a = pk.make_problems(60, 7, pk.FAMILIES)
    assert a == pk.make_problems(60, 7, pk.FAMILIES) and a != pk.make_problems(60, 8, pk.FAMILIES)
    assert len({q["prompt"] for q in a}) == 60
    assert {q["family"] for q in a} == set(pk.FAMILIES)
    for q in a:
        # The checker accepts the right answer (bare and worked) and rejects a wrong one.
        assert pk.check(q, str(q["answer"]))
        assert pk.check(q, f"First 1 + 2 = 3. Answer: {q['answer']}")
        assert not pk.check(q, str(q["answer"] + 1))
        assert not pk.check(q, f"Answer: {q['answer'] + 1}, not {q['answer']}")
    # Answers follow from the prompts.
    for q in a:
        nums = [int(x) for x in pk._INT.findall(q["prompt"])]
        if q["family"] in ("add", "add_worked"):
            assert q["answer"] == sum(nums)
        elif q["family"] == "mul":
            assert q["answer"] == nums[0] * nums[1]
        elif q["family"] == "count":
            assert q["answer"] == q["prompt"].split(":")[1].count(",") + 1
        elif q["family"] == "multi_worked":  # start + boxes x each - given away
            assert q["answer"] == nums[0] + nums[1] * nums[2] - nums[3] > 0
    with pytest.raises(ValueError, match="unknown task families"):
        pk.make_problems(3, 0, ("add", "poetry"))


def test_methods_give_each_variant_its_own_frozen_ablation():
    dv = _load("diversity")  # one method table for both benchmarks
    ms = dv.build_methods([0.25], 1.0, {"warm": {"warm_start_steps": 4}}, variant_noise=True)
    by = {m["name"]: m for m in ms}
    assert {
        "vanilla",
        "esamp_b0.25",
        "esamp_warm_b0.25",
        "frozen_warm_b0.25",
        "noise_warm_b0.25",
    } <= set(by)
    assert '"ablation": "frozen"' in by["frozen_warm_b0.25"]["consumers"][0]
    assert '"warm_start_steps": 4' in by["frozen_warm_b0.25"]["consumers"][0]
    assert by["esamp_warm_b0.25"]["variant"] == "warm" and "variant" not in by["esamp_b0.25"]


def test_methods_option_keeps_vanilla_and_names_unknown_methods(capsys):
    import argparse

    dv = _load("diversity")
    ms = dv.build_methods([0.25], 1.0, {}, variant_noise=False)
    p = argparse.ArgumentParser(prog="passk.py")
    picked = dv.select_methods(p, ms, "noise_b0.25")
    assert [m["name"] for m in picked] == ["vanilla", "noise_b0.25"]  # the reference stays
    assert dv.select_methods(p, ms, None) == ms
    with pytest.raises(SystemExit):
        dv.select_methods(p, ms, "noise_b0.25,esamp_b9")
    assert "unknown ['esamp_b9']" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.slow  # the benchmark script end to end (~35 s); its parts are unit-tested above
def test_passk_script_small_run(tiny_model, tmp_path):
    png = tmp_path / "passk.png"
    args = ["--model", tiny_model, "--problems", "3", "-n", "3", "--max-tokens", "4"]
    args += ["--beta", "0.5", "--esamp-variant", 'zo={"init": "zero_output"}', "--no-default"]
    partial = tmp_path / "samples.json.gz"
    args += ["--partial", str(partial)]
    proc = _run("passk.py", *args, "--plot", str(png), "--json", *SMALL_ENGINE, timeout=900)
    out = _json(proc)
    methods = out["methods"]
    assert set(methods) == {"vanilla", "esamp_zo_b0.5", "frozen_zo_b0.5"}
    for m in methods.values():
        assert len(m["pass_at_k"]) == 3 and len(m["per_problem"]["correct"]) == 3
        assert all(0 <= p <= 1 for p in m["pass_at_k"])
        assert m["pass_at_k"] == sorted(m["pass_at_k"])
    esamp = methods["esamp_zo_b0.5"]["counters"]["esamp"]
    assert esamp["rows_guided"] > 0 and esamp["optimizer_steps"] > 0
    frozen = methods["frozen_zo_b0.5"]["counters"]["esamp"]
    assert frozen["optimizer_steps"] == 0 and frozen["train_rows_skipped_frozen"] > 0
    assert len(out["problems"]) == 3 and out["problems"][0]["answer"] is not None
    pairs = {(c["method"], c["against"]) for c in out["comparisons"]}
    assert ("esamp_zo_b0.5", "frozen_zo_b0.5") in pairs and ("esamp_zo_b0.5", "vanilla") in pairs
    assert set(out["comparisons"][0]["pass_at_k"]) == {"1"}  # ks 1,4,16 capped at n=3
    assert png.stat().st_size > 0
    # Run again: every engine's samples come from the partial file, none is started.
    texts = tmp_path / "texts.json"
    again = _run("passk.py", *args, "--save-samples", str(texts), "--json", *SMALL_ENGINE)
    assert again.stderr.count("kept from") == 3 and "started in" not in again.stderr
    saved = json.loads(texts.read_text())  # each method's texts, per problem
    assert set(saved) == set(methods) and all(
        len(p) == 3 and len(p[0]) == 3 for p in saved.values()
    )
    assert {n: m["pass_at_k"] for n, m in _json(again)["methods"].items()} == {
        n: m["pass_at_k"] for n, m in methods.items()
    }
    other = _run("passk.py", *args[:-2], "--partial", str(partial), "-n", "2", *SMALL_ENGINE)
    assert other.returncode != 0 and "other settings" in other.stderr


def test_fnoise_methods_of_the_recipe_and_each_variant():
    dv = _load("diversity")
    plain = {m["name"] for m in dv.build_methods([0.25], 1.0, {"warm": {}})}
    assert not any(n.startswith("fnoise") for n in plain)  # only on request
    ms = dv.build_methods([0.25], 1.0, {"warm": {"warm_start_steps": 4}}, fnoise=True)
    by = {m["name"]: m for m in ms}
    for name in ("fnoise_b0.25", "fnoise_warm_b0.25"):
        conf = json.loads(by[name]["consumers"][0].split(":", 1)[1])
        assert (
            conf["ablation"] == "f_noise" and conf["beta"] == 0.25 and by[name]["kind"] == "fnoise"
        )
    assert (
        json.loads(by["fnoise_warm_b0.25"]["consumers"][0].split(":", 1)[1])["warm_start_steps"]
        == 4
    )


def test_vanilla_temperatures_option():
    import argparse

    dv = _load("diversity")
    p = argparse.ArgumentParser()
    ms = dv.vanilla_temperatures(p, "0.7, 1.2")
    assert [(m["name"], m["kind"], m["temperature"]) for m in ms] == [
        ("vanilla_t0.7", "vanilla_t", 0.7),
        ("vanilla_t1.2", "vanilla_t", 1.2),
    ]
    assert dv.vanilla_temperatures(p, None) == []
    with pytest.raises(SystemExit):
        dv.vanilla_temperatures(p, "0.7,-1")
