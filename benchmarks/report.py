"""Write docs/results.md from the saved benchmark results: each tool's ``render(result)``
over its JSON in benchmarks/results/, in the order of ``SECTIONS``.

    python benchmarks/report.py                   # render from benchmarks/results/*.json
    python benchmarks/report.py --merge run.json  # fold a later throughput.py --json run in
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOC = HERE.parent / "docs" / "results.md"
sys.path[:0] = [str(HERE.parent), str(HERE)]
from bench_setup import section, table  # noqa: E402

# (tool, result file, section title or None for the tool's own): the page, in order.
SECTIONS = [
    ("throughput", "throughput.json", None),
    ("throughput", "throughput_runner_seam.json", "Throughput, model runner seam"),
    ("throughput", "throughput_v2_interpreted.json", "Throughput, V2 model runner"),
    (
        "throughput",
        "throughput_probe.json",
        "Throughput, last prompt token of 512 prompts (prefill)",
    ),
    ("diversity", "diversity.json", None),
    ("passk", "passk.json", None),
    ("load", "load.json", None),
    ("soak", "soak.json", None),
    ("report", "fuzz.json", None),
    ("report", "server_state.json", None),
    ("esamp_step", "esamp_step.json", None),
    ("edit_fake_step", "edit_fake_step.json", None),
    ("gpu_distiller", "gpu_distiller.json", None),
    ("gpu_smoke", "gpu_smoke.json", None),
    ("gpu_smoke", "gpu_smoke_cpu.json", None),
]


def render(result: dict[str, Any]) -> str:
    """The results that tests write (``tests/test_serve_fuzz.py``, ``test_serve_state.py``)."""
    if "answers" in result:
        rows = [[k, v] for k, v in result["answers"].items()]
        rows.append(["good request answered after the fuzzing", result["good_request_after"]])
        rows.append(["bodies sent", result["bodies"]])
        return section("Server fuzzing", result, table(["route, kind, status", "answers"], rows))
    head = ["requests served", "`/tllm/counters` bytes", "export open", "runner open"]
    keys = ("requests", "counters_bytes", "export_open", "runner_open")
    rows = [[r[k] for k in keys] for r in result["reads"]]
    return section("What a server keeps per request", result, table(head, rows))


def page() -> str:
    """docs/results.md: every section whose result is saved."""
    out = [
        "# Benchmark results",
        "",
        "Written by `python benchmarks/report.py` from `benchmarks/results/*.json`. Code "
        "version: the commit the run recorded (for results saved before runs recorded it: the "
        "commit that saved the result). Decisions "
        "taken from earlier one-off experiments: [history.md](history.md#benchmark-experiments).",
        "",
    ]
    for tool, name, title in SECTIONS:
        path = RESULTS / name
        if not path.is_file():
            continue
        result = json.loads(path.read_text())
        draw = render if tool == "report" else importlib.import_module(tool).render
        out.append(draw(result, title) if title else draw(result))
    return "\n".join(out)


def merge_throughput(run_path: Path, note: str = "") -> list[str]:
    """Fold a later ``throughput.py --json`` run into ``results/throughput.json``: its cases
    (not ``plain``) replace the saved ones; ``case_commands`` and ``later_runs`` keep the
    command and machine of the run that measured each."""
    run = json.loads(run_path.read_text())
    if "cases" not in run or "command" not in run:
        raise SystemExit(f"{run_path}: not a throughput.py --json result")
    if not run.get("ok", False):
        raise SystemExit(f"{run_path}: the run failed ({run.get('failures')}); not merged")
    path = RESULTS / "throughput.json"
    tp = json.loads(path.read_text())
    cases = [c for c in run["cases"] if c != "plain"]
    for c in cases:
        tp["cases"][c] = run["cases"][c]
        tp.setdefault("case_commands", {})[c] = run["command"]
    keep = ("command", "baseline_tok_s", "machine")
    later = {k: run.get(k) for k in keep} | {
        "note": note,
        "cases": {c: run["cases"][c] for c in cases},
    }
    tp.setdefault("later_runs", []).append(later)
    path.write_text(json.dumps(tp))
    return cases


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--merge", type=Path, metavar="RUN.json", help="fold a later throughput run in")
    ap.add_argument("--note", default="", help="with --merge: kept in the result, not rendered")
    a = ap.parse_args()
    if a.merge is not None:
        print(f"merged: {', '.join(merge_throughput(a.merge, a.note))}", file=sys.stderr)
    DOC.write_text(page())
    print(f"wrote {DOC}", file=sys.stderr)
