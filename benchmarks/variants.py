"""ESamp's variants on both benchmarks, paired across runs, with the issue's goals decided.

    python benchmarks/variants.py [--passk RUN.json]... [--diversity RUN.json]... [--json]

Each pass@k or diversity run measures a few methods beside vanilla. Runs made with the same
workload (model, problems or prompts, n, tokens, sampling, seeds) give vanilla identical
samples, so a method of one run pairs problem by problem (prompt by prompt) with a method of
another. This script checks that precondition (same workload; vanilla's per-item figures
equal in every run, else it refuses), merges the runs' methods, and compares every variant
(``esamp_{NAME}_b{B}``; the paper's recipe is ``esamp_b{B}``) with vanilla, with its own
frozen and noise ablations, and with the paper's recipe at the same beta, on both benchmarks.

The goals (issue "ESamp where it counts"), decided per variant from the paired tests:

    (a) pass@16 at or above vanilla's within noise: mean difference >= 0, or t-test p >= 0.05
    (b) a Vendi gain over vanilla (mean difference > 0, t-test p < 0.05) at a PPL at most 5%
        above vanilla's
    (c) beats its frozen ablation on both benchmarks, significant: pass@1 or pass@16 higher
        with p < 0.05, and Vendi higher with p < 0.05

Without arguments it reads the runs published in ``benchmarks/results`` (``DEFAULT_RUNS``).
``--json`` prints the whole comparison; ``benchmarks/report.py`` renders it in docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from diversity import paired  # noqa: E402
from passk import pass_curve  # noqa: E402

RESULTS = HERE / "results"
DEFAULT_RUNS = {
    "passk": [
        "passk_zw60.json",
        "passk_single_options.json",
        "passk_zwf60.json",
        "passk_noise60.json",
        "passk_warm32.json",
        "passk_zw32.json",
    ],
    "diversity": [
        "diversity.json",
        "diversity_variants_zw40.json",
        "diversity_variants_all40.json",
        "diversity_variants_noise40.json",
        "diversity_variants_warm32.json",
        "diversity_variants_zw32.json",
    ],
}
# Config fields that may differ between runs that pair (what each run chose to measure).
PER_RUN_FIELDS = {"betas", "esamp_variants"}
KS = (1, 4, 16)
_ESAMP_NAME = re.compile(r"esamp_(?:(?P<variant>.+)_)?b(?P<beta>[0-9.]+)")
ALPHA = 0.05
PPL_LIMIT = 1.05


class RunsDoNotPair(ValueError):
    """Runs measured on different workloads, or whose vanilla samples differ."""


def _item_figures(bench: str, method: dict[str, Any], n: int) -> dict[str, list[float]]:
    """Per-item figures: pass@k per problem (``pass@K``, ``n`` samples each) or the
    diversity metrics per prompt."""
    if bench == "passk":
        curves = [pass_curve(n, c) for c in method["per_problem"]["correct"]]
        return {f"pass@{k}": [c[k - 1] for c in curves] for k in KS if k <= n}
    return {k: list(v) for k, v in method["per_prompt"].items()}


def merge_runs(bench: str, paths: list[Path]) -> dict[str, Any]:
    """The methods of several runs of one benchmark, after checking that they pair."""
    config: dict[str, Any] | None = None
    methods: dict[str, dict[str, list[float]]] = {}
    source: dict[str, str] = {}
    for path in paths:
        run = json.loads(path.read_text())
        cfg = {k: v for k, v in run["config"].items() if k not in PER_RUN_FIELDS}
        if config is None:
            config = cfg
        elif cfg != config:
            diff = sorted(k for k in cfg.keys() | config.keys() if cfg.get(k) != config.get(k))
            raise RunsDoNotPair(f"{path.name}: another workload than {paths[0].name} ({diff})")
        for name, m in run["methods"].items():
            figs = _item_figures(bench, m, int(run["config"]["n"]))
            if name in methods:  # measured twice (vanilla in every run): must agree
                for k, v in figs.items():
                    if not np.allclose(v, methods[name][k], rtol=1e-6, atol=1e-9):
                        raise RunsDoNotPair(
                            f"{name} differs between {source[name]} and {path.name} ({k}): "
                            "the runs do not pair item by item"
                        )
                continue
            methods[name] = figs
            source[name] = path.name
    return {"config": config or {}, "methods": methods, "source": source}


def variant_names(methods: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(method, variant, beta) of every ESamp method (``paper`` for the default recipe)."""
    out = []
    for name in methods:
        m = _ESAMP_NAME.fullmatch(name)
        if m:
            out.append((name, m["variant"] or "paper", m["beta"]))
    return out


def _ablation(kind: str, variant: str, beta: str) -> str:
    return f"{kind}_b{beta}" if variant == "paper" else f"{kind}_{variant}_b{beta}"


def _means(figs: dict[str, list[float]]) -> dict[str, float]:
    return {k: float(np.nanmean(v)) for k, v in figs.items()}


def compare_variants(passk: dict[str, Any] | None, diversity: dict[str, Any] | None) -> dict:
    """Every variant: its figures, paired comparisons and the goals (see the module doc)."""
    benches = {"passk": passk, "diversity": diversity}
    higher = {"ppl": False, "cos_sim": False}  # lower is better for these
    names = sorted(
        {v for b in benches.values() if b for v in variant_names(b["methods"])},
        key=lambda t: (t[1] != "paper", t[1], float(t[2])),
    )
    out: dict[str, Any] = {}
    for name, variant, beta in names:
        row: dict[str, Any] = {"variant": variant, "beta": float(beta)}
        for bench, data in benches.items():
            if data is None or name not in data["methods"]:
                row[bench] = None
                continue
            ms = data["methods"]
            entry: dict[str, Any] = {"means": _means(ms[name]), "vs": {}, "ablations": {}}
            refs = {
                "vanilla": "vanilla",
                "frozen": _ablation("frozen", variant, beta),
                "noise": _ablation("noise", variant, beta),
                "paper": f"esamp_b{beta}" if variant != "paper" else None,
            }
            for label, ref in refs.items():
                if ref is None or ref not in ms:
                    continue
                entry["vs"][label] = {
                    k: paired(ms[name][k], ms[ref][k], higher.get(k, True)) for k in ms[name]
                }
                if label in ("frozen", "noise"):
                    entry["ablations"][label] = _means(ms[ref])
            row[bench] = entry
        row["goals"] = goals(row, benches)
        out[name] = row
    return out


def goals(row: dict[str, Any], benches: dict[str, Any]) -> dict[str, bool | None]:
    """(a), (b), (c) of the module doc; None where a figure it needs was not measured."""
    pk, dv = row.get("passk"), row.get("diversity")

    def sig_better(c: dict[str, Any] | None) -> bool:
        return bool(c) and c["mean_delta"] > 0 and c["t_test_p"] < ALPHA

    a = b = c_pk = c_dv = None
    if pk and "vanilla" in pk["vs"]:
        v16 = pk["vs"]["vanilla"]["pass@16"]
        a = v16["mean_delta"] >= 0 or v16["t_test_p"] >= ALPHA
    if pk and "frozen" in pk["vs"]:
        fz = pk["vs"]["frozen"]
        c_pk = sig_better(fz["pass@1"]) or sig_better(fz["pass@16"])
    if dv and "vanilla" in dv["vs"]:
        vendi = dv["vs"]["vanilla"]["vendi"]
        ppl_vanilla = float(np.nanmean(benches["diversity"]["methods"]["vanilla"]["ppl"]))
        b = sig_better(vendi) and dv["means"]["ppl"] <= PPL_LIMIT * ppl_vanilla
    if dv and "frozen" in dv["vs"]:
        c_dv = sig_better(dv["vs"]["frozen"]["vendi"])
    c = None if c_pk is None or c_dv is None else (c_pk and c_dv)
    met = None if None in (a, b, c) else bool(a and b and c)
    return {"a": a, "b": b, "c_passk": c_pk, "c_diversity": c_dv, "c": c, "all": met}


def load(passk_paths: list[Path], diversity_paths: list[Path]) -> dict[str, Any]:
    """Merged runs and the comparison of every variant."""
    pk = merge_runs("passk", passk_paths) if passk_paths else None
    dv = merge_runs("diversity", diversity_paths) if diversity_paths else None
    return {
        "runs": {
            "passk": [p.name for p in passk_paths],
            "diversity": [p.name for p in diversity_paths],
        },
        "workload": {"passk": pk and pk["config"], "diversity": dv and dv["config"]},
        "vanilla": {
            "passk": pk and _means(pk["methods"]["vanilla"]),
            "diversity": dv and _means(dv["methods"]["vanilla"]),
        },
        "variants": compare_variants(pk, dv),
    }


def published_runs(bench: str) -> list[Path]:
    """The runs of ``DEFAULT_RUNS[bench]`` that are in ``benchmarks/results``."""
    return [RESULTS / n for n in DEFAULT_RUNS[bench] if (RESULTS / n).exists()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passk", action="append", type=Path, help="a passk.py --json run")
    p.add_argument("--diversity", action="append", type=Path, help="a diversity.py --json run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    passk_paths = args.passk or published_runs("passk")
    div_paths = args.diversity or published_runs("diversity")
    try:
        res = load(passk_paths, div_paths)
    except RunsDoNotPair as e:
        print(f"variants.py: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    for name, row in res["variants"].items():
        print(f"{name}: goals {row['goals']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
