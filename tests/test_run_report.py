"""What a person sees after a run (issue 39): at most 8 lines after the outputs, and a
report page that a real browser (headless Chromium) shows with its plots and outputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from browser import PLOT_BLUE, dump_dom, pixels_of, screenshot
from cli_util import SMALL_ENGINE, cli_env

MAX_LINES_AFTER_OUTPUTS = 8

CURVE = [[a, 7.7 * 0.97**a, 1] for a in range(64)]
RUN = {
    "prompts": ["Write a short story about a lighthouse keeper."],
    "outputs": [["The keeper found a bottle.", "A message! <b>he</b> cried.", None]],
    "counters": {
        "runtime": {"rows_seen": 200, "rows_guided": 120},
        "esamp": {
            "rows_guided": 120,
            "rows_visited": 120,
            "rows_skipped": 3,
            "rows_skipped_prefill": 3,
            "optimizer_steps": 64,
            "rows_trained": 120,
            "loss_first": 7.7,
            "loss_last": 1.1,
            "groups_created": 1,
        },
        "stats": {"bundles": 40, "rows.layer.0": 200, "rows.final": 200},
    },
    "results": {
        "esamp": {"loss_curve": CURVE},
        "stats": {
            "0/0": {
                "layer.0": {"rows": 100, "mean_norm": 3.2, "max_abs": 10.0},
                "final": {"rows": 100, "mean_norm": 55.0, "max_abs": 300.0},
            }
        },
    },
    "errors": [],
    "run": {"tokens": 123, "seconds": 4.0, "interrupted": False, "summary": "x"},
}
PLOTS = {"esamp-loss.png", "esamp-rows.png", "stats-norms.png", "stats-max_abs.png"}


def _imgs(dom: str) -> int:
    return dom.count('src="data:image/png;base64,')


def test_report_page_shows_plots_and_outputs_in_chromium(tmp_path):
    from tllm_core.app.report_html import write_report

    page = write_report(RUN, tmp_path / "rep")
    assert {p.name for p in page.parent.glob("*.png")} == PLOTS
    assert json.loads((page.parent / "run.json").read_text())["outputs"] == RUN["outputs"]
    dom = dump_dom(page)
    assert _imgs(dom) == len(PLOTS)
    for text in ("The keeper found a bottle.", "A message! &lt;b&gt;he&lt;/b&gt; cried."):
        assert text in dom  # outputs side by side, escaped
    assert "(not finished)" in dom and "lighthouse keeper" in dom
    assert "esamp: guided 120 of 123 sampled rows (98%)" in dom
    assert 'id="plot-esamp-loss"' in dom and 'id="plot-stats-norms"' in dom
    drawn = pixels_of(screenshot(page, tmp_path / "shot.png"), PLOT_BLUE)
    assert drawn > 5000, drawn  # the browser drew the plots' lines and bars

    # The pixel check can fail: the same page with its images' data cut shows no plot.
    broken = page.with_name("broken.html")
    broken.write_text(page.read_text().replace("base64,iVBOR", "base64,xx"))
    assert pixels_of(screenshot(broken, tmp_path / "broken.png"), PLOT_BLUE) == 0


def test_report_command_reads_json_and_refuses_other_files(tmp_path, capsys):
    from tllm_core.app.cli import main

    run = tmp_path / "out.json"
    run.write_text(json.dumps({k: v for k, v in RUN.items() if k != "prompts"}))
    assert main(["report", str(run)]) == 0
    assert {p.name for p in (tmp_path / "out-report").glob("*.png")} == PLOTS
    assert "report: " in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    for text in ('{"a": 1}', '{"outputs": [[1]], "counters": {}}', '{"outputs": [], "counters": {"runtime": 5}}'):  # fmt: skip
        bad.write_text(text)
        assert main(["report", str(bad)]) == 2
        assert "is not a run's JSON: expected an object with 'outputs'" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["report", str(run), "--out", str(tmp_path / "file" / "r")]) == 2
    assert "is not a folder this user can write in" in capsys.readouterr().err


def _lines_after_outputs(merged: str, outputs: list[list[str]]) -> list[str]:
    """The lines printed after the last sample's text."""
    last = outputs[-1][-1].strip().splitlines()[-1]
    at = merged.rindex(last) + len(last)
    return [ln for ln in merged[at:].splitlines() if ln.strip()]


def _run_merged(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """``tllm`` with stderr merged into stdout, in the order a terminal shows them."""
    argv = [sys.executable, "-m", "tllm_core.app.cli", *args]
    return subprocess.run(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(),
        timeout=timeout,
    )


@pytest.mark.vllm
def test_a_small_run_ends_in_a_few_lines_and_its_report_renders(tiny_model, tmp_path):
    rep = tmp_path / "rep"
    args = ["run", "--model", tiny_model, "--consumer", "esamp", "--consumer", "stats"]
    args += ["--prompt", "Hello there", "-n", "2", "--max-tokens", "8", "--ignore-eos"]
    proc = _run_merged(*args, *SMALL_ENGINE, "--report", str(rep))
    assert proc.returncode == 0, proc.stdout[-4000:]
    run = json.loads((rep / "run.json").read_text())
    tail = _lines_after_outputs(proc.stdout, run["outputs"])
    assert len(tail) <= MAX_LINES_AFTER_OUTPUTS, tail
    assert tail[0].startswith("tllm: 16 tokens in"), tail
    assert any(ln.startswith("tllm: esamp: distiller trained") for ln in tail), tail
    assert "=== counters" not in proc.stdout
    es = run["counters"]["esamp"]
    assert es["optimizer_steps"] > 0 and run["results"]["esamp"]["loss_curve"]

    dom = dump_dom(rep / "index.html")
    assert 'id="plot-esamp-loss"' in dom and 'id="plot-stats-norms"' in dom
    for text in run["outputs"][0]:
        assert dom.count(text.strip()[:20]) >= 1  # the escaped text starts the same way
    drawn = pixels_of(screenshot(rep / "index.html", tmp_path / "shot.png"), PLOT_BLUE)
    assert drawn > 2000, drawn


@pytest.mark.slow
@pytest.mark.vllm
def test_the_default_esamp_run_prints_at_most_8_lines_after_its_outputs(tmp_path):
    rep = tmp_path / "rep"
    proc = _run_merged("run", "--consumer", "esamp", "--report", str(rep))
    assert proc.returncode == 0, proc.stdout[-4000:]
    run = json.loads((rep / "run.json").read_text())
    tail = _lines_after_outputs(proc.stdout, run["outputs"])
    assert len(tail) <= MAX_LINES_AFTER_OUTPUTS, tail
    assert "eager mode for a small job" in proc.stdout  # the first run starts eager
    assert (rep / "esamp-loss.png").is_file()


def test_a_report_folder_that_is_a_file_is_refused_before_the_engine_starts(tmp_path, capsys):
    from tllm_core.app.cli import main

    taken = tmp_path / "taken"
    taken.write_text("")
    # No engine starts: the check runs before the model is even looked at.
    assert main(["run", "--model", str(tmp_path), "--report", str(taken)]) == 2
    assert f"--report {taken}: exists and is not a directory" in capsys.readouterr().err
    under = taken / "report"  # a folder that can never be made: refused before the run too
    assert main(["run", "--model", str(tmp_path), "--report", str(under)]) == 2
    assert "is not a folder this user can write in" in capsys.readouterr().err
