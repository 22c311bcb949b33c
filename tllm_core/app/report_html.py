"""The run report and ``tllm report RUN.json``: ``index.html`` (outputs side by side, summary,
plots, counters), ``run.json`` and one PNG per plot. Consumers describe plots
(``Consumer.report_plots``: data only); matplotlib draws them here."""

from __future__ import annotations

import argparse
import base64
import html
import json
import os
from pathlib import Path
from typing import Any

from tllm_core.api.plots import Plot
from tllm_core.api.results import json_safe
from tllm_core.app.progress import say
from tllm_core.app.summary import (
    Lookup,
    call_consumer,
    count_text,
    error_text,
    registry_lookup,
    summarize,
    text_so_far,
)

CSS = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1200px;
       padding: 0 16px; color: #1b1b1b; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 28px; }
.meta { color: #555; }
.summary { list-style: none; padding: 0; font-family: ui-monospace, monospace; }
.summary li { margin: 2px 0; } .summary li.warning { color: #a33; font-weight: 600; }
.prompt { margin: 14px 0 22px; }
.prompt-text { background: #f2f4f7; padding: 8px 10px; border-radius: 6px;
               white-space: pre-wrap; }
.samples { display: grid; gap: 10px; grid-template-columns: repeat(auto-fit, minmax(260px, 1fr)); }
.sample { border: 1px solid #d5d9e0; border-radius: 6px; padding: 8px 10px; }
.sample .label { font-size: 12px; color: #666; margin-bottom: 4px; }
.sample .text { white-space: pre-wrap; }
.plots { display: grid; gap: 14px; grid-template-columns: repeat(auto-fit, minmax(420px, 1fr)); }
figure { margin: 0; border: 1px solid #e1e4e8; border-radius: 6px; padding: 8px; }
figure img { width: 100%; height: auto; }
figcaption { font-size: 13px; color: #444; }
table { border-collapse: collapse; font-family: ui-monospace, monospace; font-size: 13px; }
td { padding: 1px 10px 1px 0; } td.v { text-align: right; }
"""


def read_run(path: Path) -> dict[str, Any]:
    """A run's JSON (``tllm run --json`` output, or a report's ``run.json``), checked."""
    try:
        run = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(
            f"{path} is not JSON ({e}); give the output of `tllm run --json`"
        ) from None
    fields = run if isinstance(run, dict) else {}
    counters, outputs = fields.get("counters"), fields.get("outputs")
    texts = isinstance(outputs, list) and all(
        isinstance(o, list) and all(t is None or isinstance(t, str) for t in o) for o in outputs
    )
    by_group = isinstance(counters, dict) and all(isinstance(v, dict) for v in counters.values())
    if not (texts and by_group):
        raise ValueError(
            f"{path} is not a run's JSON: expected an object with 'outputs' (a list of lists "
            "of texts) and 'counters' (an object of objects): the output of `tllm run --json`, "
            "or a report's run.json"
        )
    return run


def consumer_plots(run: dict[str, Any], lookup: Lookup) -> list[tuple[str, Plot]]:
    """(consumer name, plot) for every plot the run's consumers describe."""
    out = []
    for name, counters in run.get("counters", {}).items():
        if name == "runtime":
            continue
        result = run.get("results", {}).get(name)
        if isinstance(result, list):  # data parallel: the first engine's result
            result = next((r for r in result if r is not None), None)
        plots = call_consumer(lookup(name), "report_plots", name, counters, result)
        out += [(name, p) for p in plots if any(len(s.y) for s in p.series)]
    return out


def render_png(plot: Plot, path: Path) -> None:
    """Draw ``plot`` into the PNG file ``path`` (matplotlib, no display)."""
    import matplotlib  # check_out_dir said whether it is installed

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    try:
        if plot.kind == "bar":
            n = len(plot.series)
            width = 0.8 / max(n, 1)
            labels = [str(x) for x in plot.series[0].x] if n else []
            for i, s in enumerate(plot.series):
                xs = [j + (i - (n - 1) / 2) * width for j in range(len(s.x))]
                ax.bar(xs, list(s.y), width=width, label=s.label)
            ax.set_xticks(range(len(labels)), labels, rotation=20 if len(labels) > 4 else 0)
        else:
            for s in plot.series:
                style = "-o" if len(s.x) <= 40 else "-"
                ax.plot(list(s.x), list(s.y), style, markersize=3, label=s.label)
        if plot.log_y:
            ax.set_yscale("log")
        ax.set_title(plot.title, fontsize=11)
        ax.set_xlabel(plot.xlabel)
        ax.set_ylabel(plot.ylabel)
        ax.grid(alpha=0.3)
        if len(plot.series) > 1:
            ax.legend(fontsize=9)
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def _esc(text: Any) -> str:
    return html.escape(str(text))


def check_out_dir(out_dir: Path) -> None:
    """The report's folder can be written (it need not exist yet); else a ValueError."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--report {out_dir}: exists and is not a directory")
    there = next((p for p in [out_dir, *out_dir.parents] if p.exists()), Path("."))
    if not there.is_dir() or not os.access(there, os.W_OK | os.X_OK):
        raise ValueError(f"--report {out_dir}: {there} is not a folder this user can write in")
    try:
        import matplotlib  # noqa: F401 - checked here, before a run, not after it
    except ImportError:
        raise ValueError(
            "--report needs matplotlib (in the cpu and cuda extras): pip install matplotlib"
        ) from None


def write_report(run: dict[str, Any], out_dir: Path) -> Path:
    """Write the report of ``run`` into ``out_dir`` (created); returns the page's path."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lookup = registry_lookup()
    run_json = out_dir / "run.json"
    text = json.dumps(json_safe(run), default=str, allow_nan=False, indent=1)
    if not (run_json.exists() and run_json.read_text() == text):
        run_json.write_text(text)
    summary = summarize(run, lookup)
    items = [f"<li>{_esc(line)}</li>" for line in [summary.head, *summary.lines]]
    items += [f'<li class="warning">warning: {_esc(w)}</li>' for w in summary.warnings]
    items += [
        f'<li class="warning">ERROR: {_esc(error_text(e))}</li>' for e in run.get("errors", [])
    ]
    figures = []
    for name, plot in consumer_plots(run, lookup):
        png = out_dir / f"{name}-{plot.name}.png"
        render_png(plot, png)
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        caption = f"{_esc(plot.title)}" + (f": {_esc(plot.caption)}" if plot.caption else "")
        figures.append(
            f'<figure class="plot" id="plot-{_esc(name)}-{_esc(plot.name)}">'
            f'<img alt="{_esc(plot.title)}" src="data:image/png;base64,{data}">'
            f'<figcaption>{caption} (<a href="{_esc(png.name)}">{_esc(png.name)}</a>)</figcaption>'
            "</figure>"
        )
    outputs, runner = run.get("outputs", []), run.get("run", {}).get("runner")
    prompts, parts = run.get("prompts") or [], []
    partial = run.get("partial_outputs")
    for i, samples in enumerate(outputs):
        prompt = prompts[i] if i < len(prompts) else f"prompt {i}"
        cards = "".join(
            f'<div class="sample"><div class="label">sample {j}'
            f"{'' if t is not None else ' (not finished)'}</div>"
            f'<div class="text">{_esc((t if t is not None else text_so_far(partial, i, j)).strip())}'
            "</div></div>"
            for j, t in enumerate(samples)
        )
        parts.append(
            f'<section class="prompt"><h3>Prompt {i}</h3>'
            f'<div class="prompt-text">{_esc(prompt)}</div><div class="samples">{cards}</div>'
            "</section>"
        )
    rows = []
    for group, values in run.get("counters", {}).items():
        rows.append(f'<tr><td colspan="2"><b>[{_esc(group)}]</b></td></tr>')
        for k, v in sorted(values.items()):
            rows.append(f'<tr><td>{_esc(k)}</td><td class="v">{_esc(count_text(v))}</td></tr>')
    meta = f"{len(outputs)} prompt(s) · {sum(map(len, outputs))} sample(s)"
    meta += f" · {_esc(runner)}" if runner else ""
    plots = f'<div class="plots">{"".join(figures)}</div>' if figures else "<p>(no plots)</p>"
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        "<title>tllm run report</title>"
        f"<style>{CSS}</style></head><body>"
        f'<h1>tllm run report</h1><div class="meta">{meta}</div>'
        f'<h2 id="summary">Summary</h2><ul class="summary">{"".join(items)}</ul>'
        f'<h2 id="plots">Plots</h2>{plots}'
        f'<h2 id="outputs">Outputs</h2>{"".join(parts) or "<p>(no outputs)</p>"}'
        f'<h2 id="counters">Counters</h2><details><summary>All counters</summary>'
        f"<table>{''.join(rows)}</table></details>"
        "</body></html>\n"
    )
    path = out_dir / "index.html"
    path.write_text(page)
    return path


EPILOG = """examples:
  tllm run --consumer esamp --json > run.json && tllm report run.json
  tllm report run.json --out ./report        # index.html, run.json, one PNG per plot

`tllm run ... --report DIR` writes the same page at the end of a run."""


def cmd_report(args: argparse.Namespace) -> int:
    path, out = args.run_json, args.out
    run = read_run(path)
    if out is None:  # a report's own run.json: its folder; another file: <stem>-report beside it
        own = path.name == "run.json" and (path.parent / "index.html").is_file()
        out = path.parent if own else path.with_name(f"{path.stem}-report")
    try:
        say(f"report: {write_report(run, out)}")
    except OSError as e:  # a folder made unwritable meanwhile, a full disk
        raise ValueError(f"the report was not written to {out}: {e.strerror or e}") from None
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
