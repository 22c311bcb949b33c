"""The few lines after a run (issue 39): each consumer's own words and proof counters, then
only the warnings that matter; the counter table only with ``--counters``; JSON unchanged.
Unit tests on reports shaped as the engine returns them (no engine)."""

from __future__ import annotations

import json

import pytest

from tllm_core import Consumer
from tllm_core.app.cli_common import print_report
from tllm_core.app.summary import summarize

# Every counter ESamp reports, as the 135M default run returned them (a CPU run, one group).
ESAMP = {
    **{
        k: 0
        for k in (
            "diag_rows diag_top_changed eager_updates finished_unseen fit_rows fit_scale_mean "
            "graph_failures groups_alive latent_fallback_rows nonfinite_losses_skipped "
            "rows_skipped_cap rows_skipped_greedy rows_skipped_mixed staleness_max "
            "train_rows_skipped_cap train_rows_skipped_frozen train_rows_skipped_mixed "
            "train_rows_skipped_recomputed warm_start_groups warm_start_rows warm_start_steps "
            "candidates_over_cap"
        ).split()
    },
    "candidates_guided": 12386304,
    "decode_steps": 64,
    "groups_created": 1,
    "groups_freed": 1,
    "loss_first": 7.75832,
    "loss_last": 4.87665,
    "loss_mean": 6.74607,
    "memory_bytes_per_group": 15925252,
    "memory_plan_bytes": 275546344,
    "optimizer_steps": 64,
    "rows_guided": 252,
    "rows_skipped": 4,
    "rows_skipped_prefill": 4,
    "rows_trained": 252,
    "rows_visited": 252,
}
RUNTIME = {
    "bundles_delivered": 64,
    "bundles_delivered.esamp": 64,
    "engine_steps": 65,
    "rows_guided": 252,
    "rows_seen": 436,
    "requests_finished": 4,
}


def report(**consumers) -> dict:
    return {
        "runtime": dict(RUNTIME),
        "consumers": consumers or {"esamp": dict(ESAMP)},
        "results": {},
        "errors": [],
        "run": {"tokens": 256, "seconds": 7.1, "interrupted": False, "summary": "x"},
    }


def test_esamp_says_what_it_did_with_its_proof_counters():
    s = summarize(report())
    assert s.head == "256 tokens in 7.1 s (36.1 tok/s)"
    assert s.lines == [
        "esamp: guided 252 of 256 sampled rows (98%)",
        "esamp: distiller trained 64 optimizer steps on 252 rows, loss 7.76 → 4.88",
    ]
    assert s.warnings == []


@pytest.mark.parametrize(
    "counter, value, expected",
    [
        ("candidates_over_cap", 17, "esamp: 17 candidate logits past cuda_max_candidates"),
        ("rows_skipped_cap", 5, "esamp: 5 rows not guided and 0 not trained"),
        ("nonfinite_losses_skipped", 2, "esamp: 2 non-finite losses skipped"),
    ],
)
def test_esamp_warns_of_work_lost(counter, value, expected):
    s = summarize(report(esamp={**ESAMP, counter: value}))
    assert len(s.warnings) == 1 and s.warnings[0].startswith(expected), s.warnings


def test_runtime_warnings_name_the_consumer():
    r = report(esamp=dict(ESAMP))
    r["runtime"].update(
        {"bundles_dropped.esamp": 3, "consumer_errors.esamp": 4, "consumers_disabled": 1}
    )
    assert summarize(r).warnings == [
        "consumer 'esamp': 4 callback error(s) (see the errors above)",
        "consumer 'esamp': 3 bundle(s) dropped (its queue was full)",
        "1 consumer(s) switched off after repeated failures",
    ]


def test_errors_read_from_anyones_report_file_say_switched_off_once():
    from tllm_core.app.summary import error_text

    watchdog = {"consumer": "c", "error": "c hung; switched off, 2 queued bundle(s) dropped"}
    assert error_text({**watchdog, "disabled": True}) == watchdog["error"]
    assert (
        error_text({"error": "x", "disabled": True}) == "x (switched off for the rest of the run)"
    )
    assert error_text("not a dict") == "not a dict"
    r = report(esamp=dict(ESAMP))
    r["runtime"]["consumers_disabled"] = 1
    r["errors"] = ["not a dict", {**watchdog, "disabled": True}]
    assert "1 consumer(s) switched off after repeated failures: 'c'" in summarize(r).warnings


class Quiet(Consumer):
    name = "quiet"
    proof_counter = "tokens"


class Broken(Consumer):
    name = "broken"

    @classmethod
    def summary(cls, counters, result):
        raise RuntimeError("no words")


def test_a_consumer_without_words_gets_its_proof_counter_and_idle_ones_a_warning():
    classes = {"quiet": Quiet, "broken": Broken}
    r = report(quiet={"tokens": 9, "other": 1}, broken={"seen": 3}, idle={"x": 0})
    s = summarize(r, classes.get)
    assert s.lines == ["quiet: tokens 9", "broken: seen 3", "idle: no work"]
    assert s.warnings == ["consumer 'idle' did no work (all its counters are zero)"]


def test_export_not_complete_is_a_warning():
    from consumers.export.consumer import ExportConsumer

    counters = {"rows_exported": 10, "bytes_written": 2_000_000, "shards_written": 1}
    result = {"out": "/x", "requests": 2, "rows": 10, "complete": True}
    assert ExportConsumer.summary(counters, result) == [
        "export: 10 rows, 2.0 MB in 1 shard(s) written to /x"
    ]
    assert ExportConsumer.summary_warnings(counters, result) == []
    # still open (a server's export before shutdown): not complete yet, no warning
    assert ExportConsumer.summary_warnings(counters, {**result, "complete": False}) == []
    cut = {**counters, "requests_cut_short": 1}
    warned = ExportConsumer.summary_warnings(cut, {**result, "complete": False})
    assert warned and warned[0].startswith("not complete (1 request(s) cut short")


def test_default_text_is_short_and_the_table_is_opt_in(capsys):
    texts = [["a story", "another\nstory"]]
    print_report(["p"], texts, report(), as_json=False)
    out, err = capsys.readouterr()
    assert "=== counters" not in out and "warm_start_rows" not in out + err
    assert err.splitlines() == [
        "tllm: 256 tokens in 7.1 s (36.1 tok/s)",
        "tllm: esamp: guided 252 of 256 sampled rows (98%)",
        "tllm: esamp: distiller trained 64 optimizer steps on 252 rows, loss 7.76 → 4.88",
    ]
    print_report(["p"], texts, report(), as_json=False, counters=True)
    out, _ = capsys.readouterr()
    assert "=== counters" in out and "warm_start_rows" in out


def test_json_keeps_its_keys_and_counter_names_and_warns_on_stderr(capsys):
    r = report()
    print_report(["p"], [["t"]], r, as_json=True)
    out, err = capsys.readouterr()
    obj = json.loads(out)
    assert sorted(obj) == ["counters", "errors", "outputs", "results", "run"]
    assert obj["counters"]["esamp"] == ESAMP and obj["counters"]["runtime"] == RUNTIME
    assert err == "tllm: x\n"  # the run's summary line only: nothing went wrong
    r["runtime"]["bundles_dropped.esamp"] = 2
    print_report(["p"], [["t"]], r, as_json=True)
    out, err = capsys.readouterr()
    assert "bundles_dropped.esamp" in out
    assert (
        err.splitlines()[-1]
        == "tllm: warning: consumer 'esamp': 2 bundle(s) dropped (its queue was full)"
    )


def test_serve_says_what_its_consumers_did_from_the_last_counters_read():
    import http.server
    import threading

    from tllm_core.app.serve_command import LastCounters

    body = json.dumps(report()).encode()

    class Counters(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            ok = self.path == "/tllm/counters"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(body if ok else b"{}")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Counters)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        last = LastCounters(f"http://127.0.0.1:{server.server_port}")
        assert last.lines() == []  # nothing read yet: nothing said
        assert last.read_once()
        lines = last.lines()
    finally:
        server.shutdown()
    assert lines[0].startswith("served 4 request(s), 436 token rows (counters read 0 s before")
    assert lines[1:] == [
        "esamp: guided 252 of 256 sampled rows (98%)",
        "esamp: distiller trained 64 optimizer steps on 252 rows, loss 7.76 → 4.88",
    ]
    assert not LastCounters("http://127.0.0.1:9").read_once()  # no server: no summary


def test_a_consumer_that_was_called_is_never_said_to_have_done_no_work():
    r = report(hang={"x": 0}, idle={"x": 0})
    r["runtime"].update({"consumer_calls.hang": 3, "consumer_calls.other": 1})
    s = summarize(r, {}.get)
    assert s.lines == ["hang: called 3 time(s), no result", "idle: no work"]
    assert s.warnings == [
        "consumer 'hang' was called 3 time(s) but produced no result (all its counters are zero)",
        "consumer 'idle' was never called (all its counters are zero)",
    ]


def test_a_hung_callback_is_a_warning():
    r = report(hang={"x": 1})
    r["runtime"].update({"callbacks_hung.hang": 1, "bundles_abandoned.hang": 5})
    assert summarize(r, {}.get).warnings == [
        "consumer 'hang': a callback passed its deadline (see the errors above); "
        "5 queued bundle(s) dropped"
    ]
