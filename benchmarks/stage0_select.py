"""Stage 0 of the pre-registered ESamp experiment: apply the selection rule written in
docs/history.md ("Confirmatory experiment") to the stage-0 run.

    python benchmarks/stage0_select.py benchmarks/results/confirm_stage0.json [--json]

Rule: the configuration with the lowest ``fit_5_60`` is selected; configurations within
0.005 of the lowest count as tied, and a tie goes to the one with fewer departures from the
paper's recipe (source layer 0, lr 4e-4, ``loss_reduction`` "sum", paper init, no warm
start), then to the earlier one in the run's loop order. Prints ``SEL``: the selected
configuration's JSON without ``beta`` (stage 1 gives β itself) and without ``diagnostics``
(switched on by ``esamp_tokens.py`` for the fit, not part of the recipe). A configuration
whose counters show missing work (groups created != problems, no optimizer step, staleness
above 0) makes the run invalid: nothing is selected.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

TIE = 0.005
PAPER = {
    "source_layer": 0,
    "lr": 4e-4,
    "loss_reduction": "sum",
    "init": "paper",
    "warm_start_steps": 0,
}
NOT_RECIPE = ("beta", "diagnostics")


def departures(config: dict[str, Any]) -> int:
    """How many of the selected fields differ from the paper's recipe."""
    return sum(config.get(k, v) != v for k, v in PAPER.items())


def loop_order(run: dict[str, Any]) -> list[str]:
    """Configuration names in the order of the run's ``--config`` arguments (else as stored)."""
    names = []
    argv = shlex.split(run.get("command", ""))
    for i, a in enumerate(argv[:-1]):
        if a == "--config":
            names.append(argv[i + 1].partition("=")[0])
    stored = list(run["configs"])
    return [n for n in names if n in run["configs"]] + [n for n in stored if n not in names]


def invalid(name: str, r: dict[str, Any], problems: int) -> list[str]:
    """What the counters say is missing in one configuration's run."""
    c = r["counters"]
    out = []
    if c.get("groups_created") != problems:
        out.append(f"{name}: groups_created {c.get('groups_created')} != {problems} problems")
    if not c.get("optimizer_steps"):
        out.append(f"{name}: no optimizer step")
    if c.get("staleness_max", 0) != 0:
        out.append(f"{name}: staleness_max {c.get('staleness_max')}")
    if r.get("fit_5_60") is None:
        out.append(f"{name}: no row in decode steps 5-60")
    return out


def select(run: dict[str, Any]) -> dict[str, Any]:
    """The rule applied: the ranking, the tied set, the selected name and ``SEL``."""
    order = loop_order(run)
    problems = []
    for name in order:
        problems += invalid(name, run["configs"][name], run["problems"])
    if problems:
        return {"valid": False, "problems": problems, "selected": None, "sel": None}
    fit = {n: run["configs"][n]["fit_5_60"] for n in order}
    best = min(fit.values())
    tied = [n for n in order if fit[n] <= best + TIE]
    chosen = min(tied, key=lambda n: (departures(run["configs"][n]["config"]), order.index(n)))
    cfg = run["configs"][chosen]["config"]
    return {
        "valid": True,
        "problems": [],
        "ranking": sorted(
            (
                {
                    "name": n,
                    "fit_5_60": fit[n],
                    "departures": departures(run["configs"][n]["config"]),
                }
                for n in order
            ),
            key=lambda row: row["fit_5_60"],
        ),
        "lowest_fit": best,
        "tied": tied,
        "selected": chosen,
        "sel": {k: v for k, v in cfg.items() if k not in NOT_RECIPE},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="the stage-0 JSON (esamp_tokens.py --out)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    out = select(json.loads(args.run.read_text()))
    if args.json:
        print(json.dumps(out))
    elif not out["valid"]:
        print("invalid run, nothing selected:\n  " + "\n  ".join(out["problems"]))
    else:
        for row in out["ranking"]:
            mark = (
                "*"
                if row["name"] == out["selected"]
                else ("=" if row["name"] in out["tied"] else " ")
            )
            print(
                f"{mark} {row['name']:<34} fit {row['fit_5_60']:.4f}  departures {row['departures']}"
            )
        print(f"SEL={json.dumps(out['sel'])}")
    return 0 if out["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
