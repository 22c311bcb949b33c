"""What a user sees from the ``tllm`` command: a quiet stderr with tllm's lines, a summary,
engine processes that end on their own, Ctrl-C that leaves valid results (issue 15)."""

from __future__ import annotations

import html
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_util import SMALL_ENGINE, cli_env, long_export_argv
from conftest import run_cli

pytestmark = pytest.mark.vllm

# Lines that must not reach a user's default stderr: vLLM's log lines (any level, any
# process), Python and torch warnings, vLLM's own progress bars, the allocator advice, and
# the signs of an unclean shutdown.
NOISE = [
    r"\((MainProcess|EngineCore|Worker|APIServer)[^)]*pid=\d+\)",  # vLLM's log prefix
    r"\b(INFO|WARNING|DEBUG)\b",
    r"Warning:",  # Python warnings (FutureWarning: ..., UserWarning: ...) and torch C++
    r"Triton",
    r"LD_PRELOAD",
    r"NUMA",
    r"force killing",
    r"leaked",
    r"Traceback",
    r"Loading safetensors",
    r"Processed prompts",
    r"Rendering conversations",
]
# The summary after the outputs: the run's line, then each consumer's (issue 39).
SUMMARY = re.compile(
    r"^tllm: (\d+) tokens in [\d.]+ s \([\d.]+ tok/s\)\ntllm: stats: (\d+) bundles;", re.M
)


def noise(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if any(re.search(p, ln) for p in NOISE)]


def default_sigint() -> None:
    """In the child before exec: Ctrl-C as in a terminal, even when this test process was
    started in the background (a shell without job control starts it with SIGINT ignored,
    and a command started so keeps ignoring it, as it should)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ctrl_c_when(
    argv: list[str], err_path: Path, ready, timeout: float, group: bool = False
) -> tuple[subprocess.Popen, str]:
    """Run the command ``argv`` (stderr to ``err_path``), wait for ``ready(proc)``, press
    Ctrl-C (SIGINT to the command only; ``group``: to all its processes, as a terminal does)
    and wait up to ``timeout`` s for it to end; returns the process and its stdout. The
    process is killed if it is still running."""
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            argv,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            preexec_fn=default_sigint,
            start_new_session=group,
        )
        try:
            ready(proc)
            assert proc.poll() is None
            if group:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGINT)
            stdout, _ = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
    return proc, stdout


def engine_processes(cli_pid: int) -> list[str]:
    """Processes still alive that the command with ``cli_pid`` started (by their environment)."""
    import psutil

    left = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if p.pid != cli_pid and p.environ().get("TLLM_CLI_PID") == str(cli_pid):
                left.append(f"{p.info['name']} pid {p.pid}")
        except (psutil.Error, OSError):
            continue
    return left


def test_noise_patterns_catch_what_vllm_prints():
    # Lines a plain vLLM run printed before issue 15, and tllm's own lines that must pass.
    seen = [
        "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
        "(EngineCore pid=19472) WARNING 11-23 17:04:15 [vllm.py:1703] Enforce eager set",
        "/x/vllm/triton_utils/dispatcher.py:138: FutureWarning: `torch.distributed.reduce_op`",
        "[W1123 17:04:07.198044982 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy",
        "(Worker pid=19789) WARNING 11-23 17:04:07 [cpu_worker.py:114] libtcmalloc is not found",
        "Loading safetensors checkpoint shards: 100% Completed | 1/1",
        "(MainProcess pid=18777) WARNING [utils.py:653] force killing remaining process EngineCore",
        "vLLM WARNING (EngineCore): something new",
    ]
    assert noise("\n".join(seen)) == seen
    ours = (
        "tllm: engine ready in 21 s\ntllm: 16 tokens in 0.4 s (40.0 tok/s)\n"
        "tllm: stats: 9 bundles; rows per port: layer.0 20"
    )
    assert noise(ours) == []
    assert SUMMARY.search(ours)


# ~35-50 s, one more tllm run: the default suite's quiet, summarised run is
# test_run_report.py::test_a_small_run_ends_in_a_few_lines_and_its_report_renders (at most 8
# lines after the outputs, the summary line); the noise patterns: the unit tests above; an engine
# left by a command: test_ctrl_c_while_the_engine_starts_stops_it_at_once.
@pytest.mark.slow
def test_default_run_is_quiet_summarised_and_stops_its_engine():
    """Also issue 27: no ``--max-model-len`` means the model's own length (vLLM derives it);
    a fixed default of 2048 made vLLM refuse this 1024-position model at start."""
    from conftest import MODEL_CACHE
    from tiny_models import build_tiny_model

    model = str(build_tiny_model(MODEL_CACHE, num_layers=2, max_positions=1024))
    proc = run_cli(
        "run",
        "--model",
        model,
        "--consumer",
        "stats",
        "--prompt",
        "Hello there",
        "-n",
        "2",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--counters",
        "--enforce-eager",
        "--kv-cache-gib",
        "1",
        env={"VLLM_LOGGING_LEVEL": "INFO"},  # the quiet setting must win over the env's level
    )
    assert "greater than the derived max_model_len" not in proc.stderr
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert noise(proc.stderr) == [], proc.stderr[-4000:]
    m = SUMMARY.search(proc.stderr)
    assert m, proc.stderr[-4000:]
    assert int(m.group(1)) == 2 * 8 and int(m.group(2)) > 0
    assert "tllm: engine ready in" in proc.stderr
    assert "=== counters" in proc.stdout
    assert engine_processes(proc.pid) == []


def _stderr_until(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        err = path.read_text() if path.exists() else ""
        if text in err:
            return err
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not seen on stderr:\n{path.read_text()[-4000:]}")


# ~40 s; an interrupted export's manifest in the default suite: test_export_unit.py
# (test_interrupted_run_holds_only_complete_shards) and a served export whose engine dies
# (test_engine_faults.py::test_kill_9_of_the_engine_core_ends_tllm_serve_naming_it)
@pytest.mark.slow
def test_ctrl_c_mid_export_leaves_valid_json_and_a_readable_export(tiny_model, tmp_path):
    from consumers.export import IncompleteExportWarning, read_export
    from consumers.export import format as fmt

    out = tmp_path / "exp"
    prompts = tmp_path / "prompts.txt"
    # 64 x 4 samples x 400 tokens: a minute or more of generation on 2 cores.
    prompts.write_text("\n".join(f"Tell me a long story number {i}" for i in range(64)))
    err_path = tmp_path / "stderr.txt"

    def well_into_generation(proc: subprocess.Popen) -> None:
        _stderr_until(err_path, "tllm: engine ready", proc, 300)
        time.sleep(10)

    argv = long_export_argv(tiny_model, str(out), "--prompts", str(prompts), "-n", "4")
    proc, stdout = ctrl_c_when([*argv, "--json"], err_path, well_into_generation, 180)
    stderr = err_path.read_text()
    assert proc.returncode == 130, stderr[-4000:]
    assert "tllm: interrupted" in stderr
    assert "tllm: warning: export: not complete" in stderr  # --json too: warnings on stderr
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["run"]["interrupted"] is True
    samples = [t for ts in result["outputs"] for t in ts]
    assert len(samples) == 64 * 4 and None in samples  # partial: unfinished samples are null
    exported = result["counters"]["export"]["rows_exported"]
    assert exported > 0
    # The export was closed (flushed) after the interruption, and says it is not complete;
    # exactly the samples the run returned are "finished", the aborted ones are not.
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False
    table = fmt.request_table(str(out), manifest)
    unfinished = [r for r in table if not r["finished"]]
    assert unfinished and manifest["losses"]["requests_unfinished"] == len(unfinished)
    done = sum(t is not None for t in samples)
    assert sum(r["finished"] for r in table) == done
    assert result["counters"]["export"]["requests_cut_short"] == len(unfinished)
    with pytest.warns(IncompleteExportWarning, match="requests_unfinished"):
        records = list(read_export(out, verify=True))
    assert sum(len(r.positions) for r in records) == exported
    assert engine_processes(proc.pid) == []
    # No vLLM force kill of the engine processes, no leaked semaphores / shared memory.
    assert noise(stderr) == [], stderr[-4000:]


def interrupt_at_step(monkeypatch, n: int) -> None:
    """Ctrl-C in this process at the engine's ``n``-th step (offline ``LLMEngine.step``)."""
    from vllm.v1.engine.llm_engine import LLMEngine

    step, calls = LLMEngine.step, []

    def interrupted_step(engine, *args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return step(engine, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "step", interrupted_step)


def test_an_interrupted_run_keeps_the_text_its_unfinished_samples_had(
    tiny_model, tmp_path, monkeypatch, capsys
):
    """Ctrl-C mid-generation: each unfinished sample's text so far is kept (``partial_outputs``
    in the JSON, the report and the text output), and is the start of what transformers
    generates greedily from the same prompt (top-k 1: every sample is greedy). The command
    runs in this process; the
    interrupt comes from the engine's 8th step."""
    from reference import hf_model
    from transformers import AutoTokenizer

    from tllm_core.app import cli

    interrupt_at_step(monkeypatch, 8)
    prompts = ["The sea is", "Once upon a time"]
    argv = ["run", "--model", tiny_model, "--prompt", prompts[0], "--prompt", prompts[1]]
    argv += ["-n", "2", "--max-tokens", "40", "--top-k", "1", "--ignore-eos", "--no-chat"]
    argv += ["--json"]
    argv += ["--consumer", "stats", "--report", str(tmp_path / "rep"), *SMALL_ENGINE]
    assert cli.main(argv) == 130
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["run"]["interrupted"] is True
    assert result["outputs"] == [[None, None], [None, None]]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = hf_model(tiny_model)
    for prompt, partial in zip(prompts, result["partial_outputs"], strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=40, do_sample=False, min_new_tokens=40)
        full = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        for text in partial:
            assert text and full.startswith(text) and len(text) < len(full), (text, full)
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "sample 1 (not finished)" in page
    assert html.escape(result["partial_outputs"][1][1].strip()) in page


def test_an_interrupted_run_keeps_a_sample_that_finished_before_its_siblings(
    tiny_model, monkeypatch, capsys
):
    """Sample 0 of n=2 draws eos after 3 tokens (the ``finisher`` test consumer; every sample
    greedy) while sample 1 goes on: vLLM holds the finished one in its request's aggregator,
    where an interrupt at the engine's 8th step reads it, whole, as an output; sample 1 is a
    partial text. Both are checked against transformers' greedy text."""
    from reference import hf_model
    from transformers import AutoTokenizer

    from tllm_core.app import cli

    interrupt_at_step(monkeypatch, 8)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt, after = "Once upon a time", 3
    finisher = json.dumps({"sample": 0, "after": after, "eos": tok.eos_token_id})
    argv = ["run", "--model", tiny_model, "--prompt", prompt, "-n", "2", "--max-tokens", "40"]
    argv += ["--temperature", "1.0", "--seed", "0", "--no-chat", "--json"]
    argv += ["--consumer", f"finisher:{finisher}", *SMALL_ENGINE]
    assert cli.main(argv) == 130
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["run"]["interrupted"] is True
    ids = tok(prompt, return_tensors="pt").input_ids
    out = hf_model(tiny_model).generate(ids, max_new_tokens=12, do_sample=False)
    greedy = out[0, ids.shape[1] :]
    assert tok.eos_token_id not in greedy.tolist()  # else sample 1 would finish too
    full = tok.decode(greedy, skip_special_tokens=True)
    [[finished, unfinished]] = result["outputs"]
    assert finished == tok.decode(greedy[:after], skip_special_tokens=True)
    assert unfinished is None
    [[none, partial]] = result["partial_outputs"]
    assert none is None and partial, result["partial_outputs"]
    assert full.startswith(partial) and len(partial) > len(finished), (partial, full)


def test_what_a_cut_short_request_had_is_read_per_sample_finished_or_not():
    """vLLM keeps a finished sample of n > 1 in its request's aggregator until every sample
    has finished (then no request state): it is read with its whole text, as finished; the
    unfinished ones with their text so far; a state without a detokenizer as ''."""
    from types import SimpleNamespace as NS

    from tllm_core.app.cli_common import _cut_short
    from tllm_core.vllm_bridge.lifecycle import texts_so_far

    def det(text):
        return NS(get_next_output_text=lambda finished, delta: text)

    parent = NS(external_req_id="7", output_aggregator=[None, NS(index=1, text="done."), None])
    states = {
        "0_7-x": NS(parent_req=parent, external_req_id="7", request_index=0, detokenizer=det("ha")),
        "2_7-x": NS(parent_req=parent, external_req_id="7", request_index=2, detokenizer=None),
        "8-y": NS(parent_req=None, external_req_id="8", request_index=0, detokenizer=det("so")),
    }
    proc = NS(request_states=states, parent_requests={"7-x": parent})
    cut = texts_so_far(NS(llm_engine=NS(output_processor=proc)))
    assert cut == {
        "7": {1: ("done.", True), 0: ("ha", False), 2: ("", False)},
        "8": {0: ("so", False)},
    }
    texts = [[None, None, None], [None, None, None]]  # requests 7 and 8 (the run's first: 7)
    partial = _cut_short(cut, 7, texts)
    assert texts == [[None, "done.", None], [None, None, None]]
    assert partial == [["ha", None, ""], ["so", None, None]]


def test_summary_names_each_consumers_proof_counter_and_export_progress(tmp_path):
    from consumers.export.command import written
    from tllm_core.app.summary import run_line as summary
    from tllm_core.plugins.registry import Registry

    reg = Registry()
    assert reg.get("esamp").proof_counter == "rows_guided"
    proofs = {"esamp": "rows_guided", "mine": ""}  # "mine": a consumer naming none
    consumers = {
        "esamp": {"optimizer_steps": 3, "rows_guided": 7},
        "mine": {"memory_bytes": 10, "zero": 0, "seen": 5},
    }
    line = summary(40, 2.0, consumers, proofs)
    assert line == "40 tokens in 2.0 s (20.0 tok/s); esamp rows_guided=7, mine seen=5"
    assert summary(1, 1.0, {"idle": {"x": 0}}, {}).endswith("idle: no work")

    assert written(tmp_path) == "on disk: 0 shard(s), 0 rows, 0.0 MB"
    shards = [{"file": "a", "rows": 3, "bytes": 2_000_000}, {"file": "b", "rows": 4, "bytes": 0}]
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": shards}))
    assert written(tmp_path) == "on disk: 2 shard(s), 7 rows, 2.0 MB"


def test_harmless_filter_drops_only_the_listed_messages():
    import logging

    from tllm_core.vllm_bridge.quiet import HarmlessFilter

    f = HarmlessFilter()

    def shown(level: int, msg: str) -> bool:
        return f.filter(logging.LogRecord("vllm.x", level, "f.py", 1, msg, None, None))

    assert not shown(logging.WARNING, "Triton is installed, but doesn't include CPU backend. X")
    assert not shown(logging.WARNING, "libiomp is not found in LD_PRELOAD. For best performance")
    # vLLM's own runner choice on the CPU build; tllm names the runner it hooked instead
    assert not shown(
        logging.WARNING, "Model Runner V2 requires Triton; using the V1 model runner instead."
    )
    assert shown(logging.WARNING, "Model context length 4096 exceeds the KV cache")  # unknown
    assert shown(logging.ERROR, "Triton is not installed. triton-cpu is expected")  # errors show
    assert not shown(logging.ERROR, "AsyncLLM output_handler failed.")  # after the engine stopped


def test_a_clients_bad_request_in_a_stream_is_logged_in_one_line():
    """vLLM logs an exception raised inside a stream with its traceback: a request tllm
    refuses there (a result bound past max_result_bytes) wrote ~40 lines to the server log,
    per request, at a client's will. The record keeps its message and the refusal, no
    traceback; other errors keep theirs."""
    import logging
    import sys

    from vllm.exceptions import VLLMValidationError

    from tllm_core.vllm_bridge.quiet import HarmlessFilter

    def record(exc: BaseException) -> logging.LogRecord:
        try:
            raise exc
        except BaseException:
            info = sys.exc_info()
        msg = "Error in completion stream generator."
        return logging.LogRecord("vllm.x", logging.ERROR, "f.py", 1, msg, None, info)

    refused = record(VLLMValidationError("tllm: the 'export' result ... past this server's limit"))
    assert HarmlessFilter().filter(refused) and refused.exc_info is None
    text = logging.Formatter().format(refused)
    assert text.startswith("Error in completion stream generator. tllm: the 'export' result")
    assert "Traceback" not in text
    crashed = record(RuntimeError("boom"))
    assert HarmlessFilter().filter(crashed) and "Traceback" in logging.Formatter().format(crashed)


def test_cpu_preload_env():
    from tllm_core.app.cli_common import preload_libraries

    libs = preload_libraries({})  # what this machine has: tcmalloc, Intel OpenMP
    if not libs:
        pytest.skip("neither tcmalloc nor libiomp5 is installed here")
    env: dict[str, str] = {"LD_PRELOAD": "/x/libfoo.so"}
    assert preload_libraries(env) == libs
    assert env["LD_PRELOAD"] == ":".join([*libs, "/x/libfoo.so"])
    assert preload_libraries(env) == []  # already there: nothing added twice
    # Another OpenMP runtime already preloaded (vLLM puts PyTorch's libgomp there): no libiomp,
    # vLLM refuses both at once.
    gomp = {"LD_PRELOAD": "/t/torch/lib/libgomp-a34b3233.so.1"}
    preload_libraries(gomp)
    assert "libiomp" not in gomp["LD_PRELOAD"]
    off = {"TLLM_NO_PRELOAD": "1"}
    assert preload_libraries(off) == [] and "LD_PRELOAD" not in off


def test_a_swallowed_interrupt_goes_on_after_the_original_cleanup():
    """vLLM's ``zmq_socket_ctx`` logs and drops ``KeyboardInterrupt``; wrapped, it still
    cleans up first, then the interrupt reaches the caller (other exceptions unchanged)."""
    import contextlib

    from tllm_core.vllm_bridge.startup_interrupt import keeping_interrupts

    closed = []

    @contextlib.contextmanager
    def swallowing(name):
        try:
            yield name
        except KeyboardInterrupt:
            pass  # what vLLM 0.32 does
        finally:
            closed.append(name)

    with pytest.raises(KeyboardInterrupt):
        with keeping_interrupts(swallowing)("sock") as s:
            assert s == "sock"
            raise KeyboardInterrupt
    assert closed == ["sock"]
    with pytest.raises(ValueError):
        with keeping_interrupts(swallowing)("other"):
            raise ValueError
    with keeping_interrupts(swallowing)("fine"):
        pass
    assert closed == ["sock", "other", "fine"]


def _engine_started(cli_pid: int) -> bool:
    """Whether an engine process of the command runs (vLLM's spawned engine core, named
    ``VLLM::EngineCore`` once it sets its title)."""
    import psutil

    for p in psutil.process_iter():
        try:
            if p.environ().get("TLLM_CLI_PID") != str(cli_pid) or p.pid == cli_pid:
                continue
            line = " ".join(p.cmdline())
        except (psutil.Error, OSError):
            continue
        if "spawn_main" in line or "VLLM::" in line:
            return True
    return False


def test_ctrl_c_while_the_engine_starts_stops_it_at_once(tiny_model, tmp_path):
    """Ctrl-C at the terminal (every process of the command gets it) once the engine process
    is up, while it imports and loads: exit 130, no engine left, no traceback. Before the
    fixes vLLM dropped the interrupt in its handshake and the command hung for 600 s, and
    the engine process printed its half-imported traceback."""
    err_path = tmp_path / "stderr.txt"

    def engine_loading(proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + 120
        while not _engine_started(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(2)  # the engine is loading; the front end waits in the handshake
        assert "engine ready" not in err_path.read_text()

    argv = ["tllm", "run", "--model", tiny_model, "--prompt", "hi", "--max-tokens", "2"]
    proc, _ = ctrl_c_when([*argv, *SMALL_ENGINE], err_path, engine_loading, 90, group=True)
    stderr = err_path.read_text()
    assert proc.returncode == 130, stderr[-4000:]
    assert "tllm: interrupted" in stderr and "Traceback" not in stderr, stderr[-4000:]
    time.sleep(1)
    assert not _engine_started(proc.pid)
