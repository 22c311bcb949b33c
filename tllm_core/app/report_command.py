"""``tllm report RUN.json``: the HTML report of a finished run (:mod:`tllm_core.app.report_html`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tllm_core.app.progress import say

EPILOG = """examples:
  tllm run --consumer esamp --json > run.json && tllm report run.json
  tllm report run.json --out ./report        # index.html, run.json, one PNG per plot

`tllm run ... --report DIR` writes the same page at the end of a run."""


def default_out(run_json: Path) -> Path:
    """A report's own run.json (an index.html beside it): its folder; any other file:
    ``<stem>-report`` beside it."""
    if run_json.name == "run.json" and (run_json.parent / "index.html").is_file():
        return run_json.parent
    return run_json.with_name(f"{run_json.stem}-report")


def cmd_report(args: argparse.Namespace) -> int:
    from tllm_core.app.report_html import read_run, write_report

    run = read_run(args.run_json)
    page = write_report(run, args.out or default_out(args.run_json))
    say(f"report: {page}")
    return 0


def add_command(subparsers: argparse._SubParsersAction) -> None:
    r = subparsers.add_parser(
        "report",
        help="write the HTML report (outputs, summary, plots) of a run's JSON",
        description="Write an HTML page with the outputs side by side, the summary and the "
        "consumers' plots (one PNG per plot beside it) from `tllm run --json` output.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("run_json", type=Path, metavar="RUN.json", help="a run's --json output")
    r.add_argument(
        "--out", type=Path, metavar="DIR", help="folder (default: RUN-report beside RUN.json)"
    )
    r.set_defaults(func=cmd_report)
