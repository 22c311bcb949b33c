"""A command that stops when told (issue 38): SIGTERM to the process alone, as a supervisor
(systemd, Kubernetes) sends it, at every phase of ``tllm run``, ``tllm export`` and ``tllm
serve``: the command exits within the stop timeout with its documented status (143 when the
work was cut short, 0 for a ready server that stopped cleanly; ``app/stop.py``), leaves no
process, shared memory or semaphore behind, and an export says it is not complete.

Reuses the Ctrl-C tests' helpers (``test_cli_experience``); engine runs are small and eager.
"""

from __future__ import annotations

import json
import multiprocessing.process
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest
from cli_util import SMALL_ENGINE
from node_util import descendants, exit_within, leftover_shm, shm_entries, start, wait_for
from serve_util import free_port
from test_cli_experience import _engine_started, noise

from tllm_core.app.stop import EXIT_STOP_TIMEOUT, exit_code

SIGTERM_EXIT = 128 + signal.SIGTERM  # 143


# -- the watchdog, without vLLM ------------------------------------------------------------------
HANGING_COMMAND = textwrap.dedent(
    """
    import subprocess, sys, time
    from tllm_core.app import stop

    stop.install()
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL
    )
    try:  # the signal may come as soon as the pid is out
        print(child.pid, flush=True)
        time.sleep(600)
    except KeyboardInterrupt:
        print("stopping", flush=True)
        time.sleep(600)  # a shutdown that hangs (an engine that never exits)
    """
)


def test_sigterm_interrupts_and_a_hanging_stop_is_killed_after_the_timeout(tmp_path):
    import psutil

    env = {**os.environ, "TLLM_STOP_TIMEOUT_S": "3"}
    out_log, err_log = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out_log, "w") as out, open(err_log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", HANGING_COMMAND],
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    try:
        child = int(wait_for(out_log, "\n", proc, 120))
        proc.send_signal(signal.SIGTERM)
        wait_for(out_log, "stopping", proc, 60)  # SIGTERM acted as Ctrl-C
        proc.send_signal(signal.SIGTERM)  # a second one must not break the cleanup
        code = exit_within(proc, 60)
        err = err_log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == EXIT_STOP_TIMEOUT, err
    assert "already stopping (SIGTERM again)" in err
    assert "did not stop within 3 s" in err
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"


def test_exit_codes_and_timeout_setting(monkeypatch):
    from tllm_core.app import stop

    assert stop.installed() is None  # installed by the command (cli.main), not here
    assert exit_code(130) == 130  # no signal received in this process
    signals = stop.StopSignals()
    monkeypatch.setattr(signals, "_watchdog", lambda timeout: None)
    assert signals.exit_code(130) == 130
    signals.note(signal.SIGTERM)
    assert signals.exit_code(130) == SIGTERM_EXIT
    assert exit_code(130) == 130  # another owner's signals
    monkeypatch.setattr(stop, "_installed", signals)
    assert exit_code(130) == SIGTERM_EXIT and stop.installed().received() == signal.SIGTERM
    for bad in ("0", "inf", "nan", "soon"):  # inf: a stop that never ends
        monkeypatch.setenv("TLLM_STOP_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match=f"finite number of seconds > 0, got '{bad}'"):
            stop.stop_timeout()
    monkeypatch.setenv("TLLM_STOP_TIMEOUT_S", "7.5")
    assert stop.stop_timeout() == 7.5
    # Refused when the command starts (exit 2, the variable named), not in a signal handler,
    # where the error would leave the stop without its bound.
    monkeypatch.setenv("TLLM_STOP_TIMEOUT_S", "2m")
    with pytest.raises(ValueError, match="TLLM_STOP_TIMEOUT_S must be"):
        stop.StopSignals()
    from tllm_core.app.cli import main

    monkeypatch.setattr(stop, "_installed", None)
    assert main(["consumers"]) == 2 and stop.installed() is None


def _sigint_handler_to(conn) -> None:  # a spawned child's report
    conn.send(getattr(signal.getsignal(signal.SIGINT), "name", "a handler"))


def test_install_makes_one_owner_and_uninstall_puts_the_handlers_back():
    from tllm_core.app import stop

    before = {sig: signal.getsignal(sig) for sig in stop.STOP_SIGNALS}
    start = multiprocessing.process.BaseProcess.start
    signals = stop.install()
    try:
        assert signals is not None and stop.installed() is signals
        # An ignored SIGINT (a background job; pytest-xdist's workers) stays ignored.
        ignored = before[signal.SIGINT] is signal.SIG_IGN
        for sig in stop.STOP_SIGNALS:
            want = signal.SIG_IGN if ignored and sig == signal.SIGINT else signals.handle
            assert signal.getsignal(sig) == want, sig
        assert signals.received() is None
        assert stop.install() is signals  # one per process
        # Children start with SIGINT ignored (until they set their own handler); ours is back.
        held = signal.signal(signal.SIGINT, signals.handle)  # as at a terminal (xdist: ignored)
        try:
            ctx = multiprocessing.get_context("spawn")
            theirs, ours = ctx.Pipe()
            child = ctx.Process(target=_sigint_handler_to, args=(ours,))
            child.start()
            assert theirs.poll(60), "the child did not report"
            assert theirs.recv() == "SIG_IGN"
            assert signal.getsignal(signal.SIGINT) == signals.handle
            child.join(30)
        finally:
            signal.signal(signal.SIGINT, held)
    finally:
        stop.uninstall()
    assert stop.installed() is None
    assert multiprocessing.process.BaseProcess.start is start
    assert {sig: signal.getsignal(sig) for sig in stop.STOP_SIGNALS} == before


def test_handlers_installed_by_others_record_the_signal_first():
    """vLLM's server and uvicorn install their own SIGTERM handlers; inside
    ``noting_handlers`` those still run, after tllm recorded the signal (the watchdog)."""
    from tllm_core.app import stop

    seen = []
    previous = signal.getsignal(signal.SIGUSR1)
    original = signal.signal
    signals = stop.StopSignals()
    with signals.noting_handlers():
        signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))  # not a stop signal
        term = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda s, f: seen.append(("theirs", s)))
        wrapped = signal.getsignal(signal.SIGTERM)
    try:
        assert getattr(wrapped, "_tllm_noting", False)
        assert not getattr(signal.getsignal(signal.SIGUSR1), "_tllm_noting", False)
        notes = []
        signals.note = lambda s: notes.append(s) or True  # type: ignore[method-assign]
        wrapped(signal.SIGTERM, None)
        assert notes == [signal.SIGTERM] and seen == [("theirs", signal.SIGTERM)]
    finally:
        signal.signal(signal.SIGTERM, term)
        signal.signal(signal.SIGUSR1, previous)
    assert signal.signal is original


# -- real commands ------------------------------------------------------------------------------
STOP_BOUND_S = 200  # the watchdog's 120 s and some: a command still running after it failed


def _engine_loading(proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not _engine_started(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(3)  # the engine loads; the command waits in vLLM's handshake


def _clean_after(
    proc: subprocess.Popen, pids: set[int], shm_before: set[str], log: str, handshake=False
):
    assert descendants(proc.pid, settle=30) == [], log[-4000:]
    assert leftover_shm(shm_before, pids | {proc.pid}) == [], log[-4000:]
    # A semaphore the resource tracker reports and then unlinks at shutdown is cleaned up
    # (the /dev/shm check above sees what is left); a force kill or other leak is not,
    # except vLLM's own process manager killing a rank stuck in the multi-node handshake
    # (``handshake``: it waits for a follower that never comes; nothing is left, checked).
    bad = [ln for ln in noise(log) if "force killing" in ln or "leaked" in ln]
    bad = [ln for ln in bad if "to clean up at shutdown" not in ln]
    if handshake:
        bad = [ln for ln in bad if "force killing" not in ln and "killing" not in ln]
    assert bad == [], bad


# ~40-60 s; in the default suite: SIGTERM mid-run ending the engine within the stop timeout
# (test_engine_faults.py::test_sigterm_ends_a_run_whose_consumer_hangs_within_the_stop_timeout),
# a second signal while stopping (test_sigterm_interrupts_and_a_hanging_stop_is_killed_after_the_timeout),
# an interrupted export's manifest (test_export_unit.py::test_interrupted_run_holds_only_complete_shards,
# test_engine_faults.py::test_kill_9_of_the_engine_core_ends_tllm_serve_naming_it)
@pytest.mark.slow
@pytest.mark.vllm
def test_sigterm_mid_export_and_again_while_it_stops(tiny_model, tmp_path):
    from consumers.export import IncompleteExportWarning, read_export

    out = tmp_path / "exp"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"Tell me a long story number {i}" for i in range(32)))
    log = tmp_path / "export.log"
    before = shm_entries()
    argv = ["export", "--model", tiny_model, "--layers", "0,final", "--out", str(out)]
    argv += ["--prompts", str(prompts), "-n", "4", "--max-tokens", "400", "--ignore-eos"]
    proc = start([*argv, *SMALL_ENGINE], log)
    try:
        wait_for(log, "tllm: engine ready", proc, 300)
        time.sleep(8)
        pids = set(descendants(proc.pid))
        proc.send_signal(signal.SIGTERM)  # generating
        wait_for(log, "interrupted", proc, 60)
        proc.send_signal(signal.SIGTERM)  # stopping: flushing the export, stopping the engine
        code = exit_within(proc, STOP_BOUND_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == SIGTERM_EXIT, text[-4000:]
    assert "export: not complete" in text  # the summary's warning
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["losses"]["requests_unfinished"] > 0
    with pytest.warns(IncompleteExportWarning, match="requests_unfinished"):
        records = list(read_export(out, verify=True))
    assert records and any(not r.finished for r in records)
    _clean_after(proc, pids, before, text)


def _serve(model: str, log, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = ["serve", "--model", model, "--port", str(port), "--consumer", "stats"]
    argv += ["--max-model-len", "512", "--kv-cache-gib", "1", *extra, "--", "--enforce-eager"]
    return start(argv, log), f"http://127.0.0.1:{port}"


@pytest.mark.vllm
@pytest.mark.parametrize(
    "command",
    # run: ~17 s more; a run stopped while its engine starts, in the default suite: Ctrl-C
    # (the same stop path) in test_cli_experience.py::test_ctrl_c_while_the_engine_starts_stops_it_at_once
    [pytest.param("run", marks=pytest.mark.slow), "serve"],
)
def test_sigterm_while_a_command_starts_its_engine(command, tiny_model, tmp_path):
    log = tmp_path / f"{command}.log"
    before = shm_entries()
    if command == "run":
        argv = ["run", "--model", tiny_model, "--prompt", "hi", "--max-tokens", "2"]
        proc, ready = start([*argv, *SMALL_ENGINE], log), "engine ready"
    else:
        proc, ready = _serve(tiny_model, log)[0], "tllm: ready"
    try:
        _engine_loading(proc)
        pids = set(descendants(proc.pid))
        proc.send_signal(signal.SIGTERM)
        code = exit_within(proc, STOP_BOUND_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == SIGTERM_EXIT, text[-4000:]
    assert ready not in text
    assert command != "run" or "tllm: interrupted" in text
    _clean_after(proc, pids, before, text)


@pytest.mark.vllm
@pytest.mark.slow  # 2-3 min; under a loaded full suite its stop can pass the 120 s watchdog
def test_sigterm_while_serving_a_request_and_again_while_it_stops(tiny_model, tmp_path):
    log = tmp_path / "serve.log"
    before = shm_entries()
    proc, url = _serve(tiny_model, log)
    answers: list = []

    def long_request() -> None:
        body = {"model": "default", "prompt": "Once", "max_tokens": 400, "ignore_eos": True}
        req = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                answers.append(r.status)
        except Exception as e:  # noqa: BLE001 - a cut connection is an answer too
            answers.append(type(e).__name__)

    try:
        wait_for(log, "tllm: ready", proc, 300)
        pids = set(descendants(proc.pid))
        t = threading.Thread(target=long_request, daemon=True)
        t.start()
        time.sleep(1.5)
        proc.send_signal(signal.SIGTERM)  # serving
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)  # shutting down
        code = exit_within(proc, STOP_BOUND_S)
        t.join(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0, text[-4000:]  # a ready server told to stop, stopped cleanly
    assert "tllm: server stopped" in text and answers, (answers, text[-4000:])
    _clean_after(proc, pids, before, text)


@pytest.mark.vllm
@pytest.mark.slow  # multi-node, as tests/test_multinode.py (~50 s)
def test_sigterm_while_a_leader_waits_for_its_follower_node(tmp_path):
    """The multi-node handshake: a leader (node rank 0 of 2) whose follower never comes
    waits in torch.distributed's rendezvous; SIGTERM ends it (it waited forever before)."""
    from conftest import MODEL_CACHE
    from tiny_models import build_tiny_model

    model = str(build_tiny_model(MODEL_CACHE, arch="llama", heads=2, kv_heads=2))
    log = tmp_path / "leader.log"
    before = shm_entries()
    port, master = free_port(), free_port()
    argv = ["serve", "--model", model, "--port", str(port), "--tensor-parallel-size", "2"]
    argv += ["--max-model-len", "256", "--kv-cache-gib", "1", "--", "--nnodes", "2"]
    argv += ["--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(master)]
    proc = start([*argv, "--enforce-eager"], log, VLLM_CPU_OMP_THREADS_BIND="0")
    try:
        _engine_loading(proc)
        time.sleep(5)  # the worker waits for rank 1
        pids = set(descendants(proc.pid))
        proc.send_signal(signal.SIGTERM)
        code = exit_within(proc, STOP_BOUND_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == SIGTERM_EXIT, text[-4000:]
    _clean_after(proc, pids, before, text, handshake=True)
