"""Faults of the engine and of the model folder (issue 46): a killed engine process ends the
command within seconds with one line naming it, and leaves no process or ``/dev/shm`` file;
a broken ``config.json`` is bad input (exit 2) before vLLM starts, naming the file and key."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from cli_util import SMALL_ENGINE
from node_util import descendants, exit_within, leftover_shm, shm_entries, start, wait_for

from tllm_core.app.cli_common import EXIT_ENGINE_DIED

# A fault bound, not a speed figure: the command notices the death within a second and then
# stops the rest of the engine (its other processes get a few seconds to exit). Also the bound
# for its processes (vLLM's workers, the resource tracker) to be gone after it exited: on a
# loaded machine (two test workers, other jobs) they took more than 10 s.
DEATH_BOUND_S = 30


def _engine_core(cli_pid: int) -> int:
    """The pid of the command's engine core: the child vLLM spawned (``VLLM::EngineCore`` where
    setproctitle is installed), not ``multiprocessing``'s resource tracker."""
    import psutil

    for p in psutil.Process(cli_pid).children():
        try:
            line = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if ("spawn_main" in line or "EngineCore" in line) and "resource_tracker" not in line:
            return p.pid
    raise AssertionError(f"no engine core among {descendants(cli_pid)}")


# -- a killed engine process ---------------------------------------------------------------------
@pytest.mark.vllm
def test_kill_9_of_the_engine_core_mid_run_ends_the_run_naming_it(tiny_model, tmp_path):
    """... and an export of the run keeps its shards, its manifest saying why it is not
    complete (the front end writes the cause there: the engine process that held the export
    is gone)."""
    log = tmp_path / "run.log"
    out = tmp_path / "acts"
    before = shm_entries()
    export = json.dumps({"out": str(out), "layers": [0], "shard_rows": 32})
    argv = ["run", "--model", tiny_model, "--consumer", "stats", "--consumer", f"export:{export}"]
    argv += ["-n", "16"]
    argv += ["--max-tokens", "480", "--ignore-eos", *SMALL_ENGINE]
    proc = start(argv, log)
    try:
        wait_for(log, "tllm: engine ready", proc, 300)
        time.sleep(1)  # generating (16 x 480 tokens: well over 10 s on 2 cores)
        pids = set(descendants(proc.pid))
        core = _engine_core(proc.pid)
        os.kill(core, signal.SIGKILL)
        t0 = time.monotonic()
        code = exit_within(proc, DEATH_BOUND_S)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == EXIT_ENGINE_DIED, (took, text[-4000:])
    errors = [ln for ln in text.splitlines() if ln.startswith("tllm: error:")]
    assert len(errors) == 1, text[-4000:]
    assert f"engine core (pid {core}) died (killed by SIGKILL)" in errors[0], errors
    assert "Traceback" not in text and "leaked" not in text, text[-4000:]
    # What finished is printed and the rest marked (none of 400 tokens finished here).
    assert "=== prompt 0" in text and "(not finished)" in text, text[-4000:]
    assert "tllm: the engine died after 0/16 samples" in text, text[-4000:]
    assert descendants(proc.pid, settle=DEATH_BOUND_S) == [], text[-4000:]
    assert leftover_shm(before, pids | {proc.pid}) == [], text[-4000:]
    # The export: the shards written before the kill, and the cause in its manifest.
    from consumers.export import IncompleteExportWarning, open_export

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["shards"], manifest
    assert f"engine core (pid {core}) died (killed by SIGKILL)" in manifest["run_error"]
    with pytest.warns(IncompleteExportWarning, match=f"pid {core}.*killed by SIGKILL"):
        export = open_export(out)
    records = export.records()  # the rows written so far; no request finished
    assert records and not any(r.finished for r in records), len(records)


@pytest.mark.vllm
@pytest.mark.slow  # an engine start (~60 s); the watch itself: the two unit tests below
def test_kill_9_of_the_command_stops_its_engine_processes(tiny_model, tmp_path):
    """vLLM's engine core does not watch its parent: after a ``kill -9`` of the command it kept
    running (and on a GPU its memory). Each engine process of the command stops itself."""
    log = tmp_path / "run.log"
    argv = ["run", "--model", tiny_model, "--consumer", "stats", "-n", "8"]
    argv += ["--max-tokens", "480", "--ignore-eos", *SMALL_ENGINE]
    assert _left_after_kill_9(start(argv, log), log, "tllm: engine ready") == []


def _left_after_kill_9(proc: subprocess.Popen, log, ready: str) -> list[int]:
    """``proc``'s processes still there ``DEATH_BOUND_S`` after its ``kill -9`` (once ``ready``
    is in its ``log``); whatever is left is killed, and the log's tail shown on failure."""
    import psutil

    try:
        wait_for(log, ready, proc, 300)
        assert descendants(proc.pid), "no engine process to orphan"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        left = descendants(proc.pid, settle=DEATH_BOUND_S)
    finally:
        for pid in descendants(proc.pid):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
    if left:
        print(log.read_text()[-4000:])
    return left


ORPHANED_SCRIPT = r"""
import sys, time
from tllm_core import TllmLLM

llm = TllmLLM(sys.argv[1], consumers=["stats"], enforce_eager=True, max_model_len=512)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.vllm
@pytest.mark.slow  # a TllmLLM start (~40 s); the command's case above is the default one
@pytest.mark.parametrize("when", ["ready", "starting"])
def test_kill_9_of_a_tllmllm_script_stops_its_engine_processes(tiny_model, tmp_path, when):
    """As the command's: a Python script's engine processes stop once it is ``kill -9``-ed,
    also when that was before they looked (``starting``: once its engine core has its
    configuration, before its worker starts; vLLM's engine core would then load the model and
    wait minutes for a front end that is gone)."""
    log = tmp_path / "script.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # the engine core's first line tells when to kill
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", ORPHANED_SCRIPT, tiny_model],
            env=env,
            stdout=out,
            stderr=out,
            start_new_session=True,  # descendants() finds its engine processes by session
        )
    ready = "ready" if when == "ready" else "Initializing a V1 LLM engine"  # vLLM's EngineCore
    assert _left_after_kill_9(proc, log, ready) == []


UNCLOSED_SCRIPT = """
import sys
from tllm_core import TllmLLM
llm = TllmLLM(sys.argv[1], [], dtype="float32", max_model_len=256, enforce_eager=True)
print("NOTE", llm._fault_note.path, flush=True)
"""


@pytest.mark.vllm
@pytest.mark.slow  # a TllmLLM start in a fresh interpreter (~30 s)
def test_a_tllmllm_script_that_never_closes_leaves_no_note_file(tiny_model):
    """A script that ends without ``close``: its engine's note file goes with it at exit."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    p = subprocess.run(
        [sys.executable, "-c", UNCLOSED_SCRIPT, tiny_model],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    notes = [line.split()[1] for line in p.stdout.splitlines() if line.startswith("NOTE ")]
    assert p.returncode == 0 and notes, p.stderr[-3000:]
    assert not os.path.exists(notes[0]), f"left behind: {notes[0]}"


def test_an_engine_process_watches_its_tllmllm_front_end_only_where_it_runs(monkeypatch):
    """The front end's (pid, create_time, pid space) in the settings: watched when that
    process runs in this pid space; stopped at once when its pid is free there (a kill -9
    while the engine started); not this process (in-process engine), not another pid space's
    pid, not a pid with another create time, not the command (it watches itself)."""
    import psutil

    from tllm_core.vllm_bridge import plugin

    watched: list[tuple[int, bool]] = []
    monkeypatch.setattr(
        plugin, "_stop_without", lambda pid, gone=False: watched.append((pid, gone))
    )
    monkeypatch.delenv(plugin.CLI_PID_ENV, raising=False)
    here, elsewhere = plugin.pid_space(), "another-boot:1"
    assert here, "no boot id or pid namespace on this Linux machine"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        created = psutil.Process(child.pid).create_time()
        plugin.watch_front_end(None)
        plugin.watch_front_end((os.getpid(), psutil.Process().create_time(), here))
        plugin.watch_front_end((child.pid, created, elsewhere))
        plugin.watch_front_end((child.pid, created - 3600))  # no pid space: a live one only
        monkeypatch.setenv(plugin.CLI_PID_ENV, str(child.pid))
        plugin.watch_front_end([child.pid, created, here])
        assert watched == []
        monkeypatch.delenv(plugin.CLI_PID_ENV)
        plugin.watch_front_end([child.pid, created, here])  # a list: the settings' JSON
        assert watched == [(child.pid, False)]
        plugin.watch_front_end([child.pid, created - 3600, here])  # reused, or a clock step
        assert watched == [(child.pid, False)]  # not stopped for
    finally:
        child.kill()
        child.wait(30)
    del watched[:]
    plugin.watch_front_end([child.pid, created])  # gone, no pid space: another node's maybe
    plugin.watch_front_end([child.pid, created, elsewhere])
    assert watched == []
    plugin.watch_front_end([child.pid, created, here])  # gone before the engine looked
    assert watched == [(child.pid, True)]


def test_an_engine_process_whose_front_end_is_gone_stops_at_once(monkeypatch):
    """``_stop_without(pid, gone=True)`` does not watch whatever now holds that pid: it stops
    this engine process (vLLM's SIGTERM stop) at once."""
    from tllm_core.vllm_bridge import plugin

    killed: list[int] = []
    both = threading.Event()

    def kill(pid: int, sig: int) -> None:
        assert pid == os.getpid()
        killed.append(sig)
        if len(killed) == 2:
            both.set()

    monkeypatch.setattr(plugin.os, "kill", kill)
    monkeypatch.setenv("TLLM_STOP_TIMEOUT_S", "0.1")  # then SIGKILL: a stop that hangs
    plugin._stop_without(os.getpid(), gone=True)  # this pid runs: it would be watched
    assert both.wait(10), f"the engine process was not stopped within 10 s: {killed}"
    assert killed == [signal.SIGTERM, signal.SIGKILL]


FORKED_ENGINE = r"""
import argparse, multiprocessing as mp, os, signal, threading
from tllm_core.app.cli_common import prepare_engine_processes

def child(q):
    names = [t.name for t in threading.enumerate()]
    q.put((names, signal.getsignal(signal.SIGINT) == signal.SIG_IGN))

if __name__ == "__main__":
    prepare_engine_processes(argparse.Namespace())
    ctx = mp.get_context("fork")  # vLLM's default on GPUs: vLLM's plugins are not loaded again
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(q.get(timeout=60), flush=True)
    p.join(60)
"""


def test_a_forked_engine_process_of_the_command_leaves_ctrl_c_to_it_and_watches_it(tmp_path):
    """On a GPU vLLM forks its engine processes, which then skip loading vLLM's plugins (the
    command loaded them): the command's settings must still reach them (at fork)."""
    script = tmp_path / "forked.py"
    script.write_text(FORKED_ENGINE)
    env = {**os.environ, "TLLM_NO_PRELOAD": "1"}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'tllm-command'" in out.stdout and out.stdout.strip().endswith("True)"), out.stdout


def test_an_engine_process_whose_command_is_already_gone_stops_at_once():
    """The command killed while its engine process was still starting: no process to watch,
    so the engine process stops at once rather than run on without it."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], stdout=-1)
    code = "import time; from tllm_core.vllm_bridge.plugin import _stop_without\n"
    code += f"_stop_without({int(gone.stdout)}); time.sleep(60)"
    out = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert out.returncode == -signal.SIGTERM


KILL_DURING_GENERATE = r"""
import os, signal, sys, threading, time
from vllm import SamplingParams
from tllm_core import TllmLLM
from tllm_core.vllm_bridge.engine_watch import EngineDiedError
from tllm_core.vllm_bridge.lifecycle import engine_processes

llm = TllmLLM(sys.argv[1], consumers=["stats"], enforce_eager=True, max_model_len=512)
core = engine_processes(llm.llm.llm_engine.engine_core)[0].pid
print("core", core, flush=True)
threading.Timer(3, os.kill, (core, signal.SIGKILL)).start()
t0 = time.monotonic()
try:
    llm.generate(["Tell me a story"] * 4, SamplingParams(n=4, max_tokens=400, ignore_eos=True))
except EngineDiedError as e:
    print("generate", round(time.monotonic() - t0, 1), e, flush=True)
t0 = time.monotonic()
try:
    llm.close()
except EngineDiedError as e:
    print("close", round(time.monotonic() - t0, 1), e, flush=True)
"""


@pytest.mark.vllm
@pytest.mark.slow  # a second engine start (~40 s); the command's case above is the default one
def test_kill_9_of_the_engine_core_during_generate_raises_engine_died(tiny_model, tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
    )
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    before = shm_entries()
    proc = subprocess.run(
        [sys.executable, "-c", KILL_DURING_GENERATE, tiny_model],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    out = proc.stdout
    assert proc.returncode == 0, (out, proc.stderr[-4000:])
    core = int(re.search(r"^core (\d+)", out, re.M).group(1))
    gen = re.search(r"^generate ([\d.]+) (.*)$", out, re.M)
    assert gen and float(gen.group(1)) < DEATH_BOUND_S, out
    assert f"engine core (pid {core}) died (killed by SIGKILL)" in gen.group(2)
    assert re.search(r"^close ([\d.]+) .*died", out, re.M), out  # close says it too, at once
    assert leftover_shm(before, {core}) == [], proc.stderr[-4000:]


# -- a broken model folder -----------------------------------------------------------------------
def _folder(tmp_path, config: str | None):
    model = tmp_path / "model"
    model.mkdir()
    if config is not None:
        (model / "config.json").write_text(config)
    return model


BROKEN_CONFIGS = {
    "not JSON": ("{hidden_size: 64", "config.json", "not valid JSON"),
    "empty object": ("{}", "config.json", "hidden_size"),
    "a list": ("[1, 2]", "config.json", "not a JSON object"),
    "no layer count": (
        json.dumps({"hidden_size": 64, "vocab_size": 100, "model_type": "llama"}),
        "config.json",
        "num_hidden_layers",
    ),
    "a layer count that is text": (
        json.dumps({"hidden_size": 64, "num_hidden_layers": "two", "vocab_size": 100}),
        "config.json",
        "num_hidden_layers",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_CONFIGS))
def test_broken_config_is_bad_input_naming_the_file_and_key(case, tmp_path):
    from tllm_core.runtime.model_config import BadModelConfig, read_model_config

    text, file, key = BROKEN_CONFIGS[case]
    model = _folder(tmp_path, text)
    with pytest.raises(BadModelConfig) as e:
        read_model_config(str(model))
    assert str(model / file) in str(e.value) and key in str(e.value)
    assert isinstance(e.value, ValueError)  # the CLI's bad input: exit 2


def test_unreadable_config_is_bad_input(tmp_path):
    from tllm_core.runtime.model_config import BadModelConfig, read_model_config

    model = _folder(tmp_path, "{}")
    (model / "config.json").chmod(0)
    if os.access(model / "config.json", os.R_OK):  # root reads anything
        (model / "config.json").unlink()
        (model / "config.json").mkdir()  # a folder named config.json: not readable as a file
    with pytest.raises(BadModelConfig, match="config.json"):
        read_model_config(str(model))


# Runs the command with vLLM made unimportable: the check must come before vLLM starts.
NO_VLLM_DRIVER = """
import sys

class NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "vllm":
            raise ImportError("vllm imported before the model folder was checked")

sys.meta_path.insert(0, NoVllm())
from tllm_core.app.cli import main

sys.argv = ["tllm", *sys.argv[1:]]
sys.exit(main())
"""


@pytest.mark.parametrize("command", ["run", "export", "serve"])
def test_cli_exits_2_before_vllm_on_a_broken_config(command, tmp_path):
    model = _folder(tmp_path, "{}")
    argv = [sys.executable, "-c", NO_VLLM_DRIVER, command, "--model", str(model)]
    if command == "export":
        argv += ["--layers", "0", "--out", str(tmp_path / "out")]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "starting vLLM" not in proc.stderr, proc.stderr
    assert f"{model / 'config.json'}" in proc.stderr and "hidden_size" in proc.stderr


def test_tllmllm_refuses_a_broken_config_before_vllm(tmp_path, monkeypatch):
    from tllm_core import TllmLLM
    from tllm_core.runtime.model_config import BadModelConfig

    model = _folder(tmp_path, "not json")
    monkeypatch.setattr("tllm_core.app.engine.check_version", lambda: None)
    with pytest.raises(BadModelConfig, match="not valid JSON"):
        TllmLLM(str(model))


# -- the engine watch, without vLLM --------------------------------------------------------------
def _engine_core_with_a_worker() -> None:
    """A fake engine core (forked): starts a worker process, then waits. As vLLM's executor
    does, it notices a dead worker soon and reaps it (then only it knows the exit status)."""
    # Named as vLLM names its workers (a process without such a name is a helper); it forks
    # a short-lived child of the same name, as a consumer's process pool in a worker would.
    child = "import time; time.sleep(1.5)"
    work = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}, "
    work += "'VLLM::Worker_TP0']).wait(); time.sleep(120)"
    worker = subprocess.Popen([sys.executable, "-c", work, "VLLM::Worker_TP0"])
    while worker.poll() is None:
        time.sleep(0.2)
    time.sleep(120)


def _fake_client():
    import multiprocessing
    import queue
    from concurrent.futures import Future
    from types import SimpleNamespace

    proc = multiprocessing.get_context("fork").Process(target=_engine_core_with_a_worker)
    proc.start()
    manager = SimpleNamespace(processes=[proc])
    core = SimpleNamespace(
        resources=SimpleNamespace(engine_manager=manager, engine_dead=False),
        utility_results={1: Future()},
        outputs_queue=queue.Queue(),
    )
    # Until the worker runs under its vLLM name: a fork not yet exec'd is no worker to the watch.
    deadline = time.monotonic() + 30
    while not _named_worker(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return core, proc


def _named_worker(pid: int) -> bool:
    import psutil

    try:
        return any("VLLM::" in " ".join(c.cmdline()) for c in psutil.Process(pid).children())
    except psutil.Error:
        return False


def _kids(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children()]


def test_a_killed_engine_core_is_named_and_every_wait_on_it_ends():
    from tllm_core.vllm_bridge.engine_watch import EngineDiedError, EngineWatch

    core, proc = _fake_client()
    (worker,) = _kids(proc.pid)
    watch = EngineWatch(core).start()
    kmp = f"/dev/shm/__KMP_REGISTERED_LIB_{proc.pid}_0"
    open(kmp, "w").close()  # what libiomp5 leaves when its process is killed
    try:
        os.kill(proc.pid, signal.SIGKILL)
        # vLLM's offline waits: the output queue and a utility call's future, no timeout.
        error = core.outputs_queue.get(timeout=5)
        assert isinstance(error, EngineDiedError)
        assert isinstance(core.utility_results[1].exception(timeout=5), EngineDiedError)
        assert core.resources.engine_dead is True
        assert str(watch.death) == f"vLLM's engine core (pid {proc.pid}) died (killed by SIGKILL)"
        with pytest.raises(EngineDiedError, match="killed by SIGKILL"):
            watch.check()
        watch.clean_up(grace=1)
        assert not os.path.exists(kmp)
        assert not _running(worker)  # the orphaned worker is killed too
    finally:
        proc.kill()
        with contextlib.suppress(OSError):
            os.kill(worker, signal.SIGKILL)
            os.unlink(kmp)


@pytest.mark.parametrize("kernel_lists", [True, False], ids=["proc-children", "no-proc-children"])
def test_a_killed_worker_is_named_and_a_requested_stop_is_no_death(kernel_lists, monkeypatch):
    from tllm_core.vllm_bridge import engine_watch
    from tllm_core.vllm_bridge.engine_watch import EngineWatch

    if kernel_lists and not engine_watch.KERNEL_CHILDREN:
        pytest.skip("this kernel keeps no /proc/PID/task/TID/children lists")
    monkeypatch.setattr(engine_watch, "KERNEL_CHILDREN", kernel_lists)  # False: psutil's scan
    core, proc = _fake_client()
    (worker,) = _kids(proc.pid)
    watch = EngineWatch(core).start()
    try:
        time.sleep(2.5)  # the worker's own child has ended meanwhile: no death of the engine
        assert watch.death is None, watch.death
        os.kill(worker, signal.SIGKILL)
        assert watch.wait_for_death(5) is not None
        assert str(watch.death) == f"vLLM's worker process (pid {worker}) died (killed by SIGKILL)"
    finally:
        proc.kill()
        proc.join(5)
    core, proc = _fake_client()
    watch = EngineWatch(core).start()
    watch.stop()
    proc.kill()
    proc.join(5)
    time.sleep(1)
    assert watch.death is None and core.outputs_queue.empty()


def test_a_worker_seen_while_it_exits_stays_watched_and_named_with_its_signal(monkeypatch):
    """A killed worker's command line reads empty while it exits (its memory goes before it is
    a zombie): a look then dropped it from the workers, and its death went unnamed (the
    command ended on vLLM's EngineDeadError, exit 1); and its parent may reap the zombie before
    a look: its status is read while it exits."""
    from types import SimpleNamespace

    from tllm_core.vllm_bridge import engine_watch
    from tllm_core.vllm_bridge.engine_watch import EngineWatch

    core_pid, a, b = 9_999_990, 9_999_991, 9_999_992  # no such processes: no pidfds
    state = {a: "worker", b: "worker"}  # worker, exiting (no title yet a status), reaped
    proc = SimpleNamespace(pid=core_pid, exitcode=None, join=lambda timeout=None: None)
    core = SimpleNamespace(
        resources=SimpleNamespace(engine_manager=SimpleNamespace(processes=[proc]))
    )
    # /proc/PID/stat from the state on: the exit status is its 50th field (9: SIGKILL).
    # ptrace-stopped: a signal in that field too, no PF_EXITING (4) in its flags (the 7th).
    exiting = [b"R", *[b"0"] * 5, b"4", *[b"0"] * 42, b"9"]
    stat = {"worker": [b"S", *[b"0"] * 49], "traced": [b"t", *[b"0"] * 48, b"5"]}
    stat |= {"exiting": exiting, "reaped": []}

    def children(pid: int, recursive: bool = True) -> list[int]:
        return [p for p, s in state.items() if s != "reaped"] if pid == core_pid else []

    monkeypatch.setattr(engine_watch, "_children", children)
    monkeypatch.setattr(engine_watch, "_vllm_started", lambda pid: state.get(pid) == "worker")
    monkeypatch.setattr(engine_watch, "_stat", lambda pid: stat[state.get(pid, "reaped")])
    monkeypatch.setattr(engine_watch, "mapped_shm", lambda pid: set())
    watch = EngineWatch(core)  # not started: the looks are made here, one at a time
    assert watch._look() is None and watch._workers == {a, b}
    state[b] = "traced"  # a debugger's stop: no status to keep
    assert watch._look() is None and watch._codes == {}
    state[b] = "exiting"
    assert watch._look() is None
    state[b] = "reaped"
    assert str(watch._look()) == f"vLLM's worker process (pid {b}) died (killed by SIGKILL)"


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.vllm
@pytest.mark.slow  # two ranks (~1-2 min)
def test_kill_9_of_a_worker_mid_run_ends_the_run_naming_it(tmp_path):
    import psutil
    from conftest import MODEL_CACHE
    from tiny_models import build_tiny_model

    model = str(build_tiny_model(MODEL_CACHE, arch="llama", heads=2, kv_heads=2))
    log = tmp_path / "run.log"
    before = shm_entries()
    argv = ["run", "--model", model, "-n", "4", "--max-tokens", "400", "--ignore-eos"]
    proc = start([*argv, "--tensor-parallel-size", "2", *SMALL_ENGINE], log)
    try:
        wait_for(log, "tllm: engine ready", proc, 400)
        time.sleep(3)
        pids = set(descendants(proc.pid))
        core = _engine_core(proc.pid)
        workers = [
            c.pid
            for c in psutil.Process(core).children()
            if "resource" not in " ".join(c.cmdline())
        ]
        os.kill(workers[-1], signal.SIGKILL)
        code = exit_within(proc, DEATH_BOUND_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == EXIT_ENGINE_DIED, text[-4000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("tllm: error:")]
    # The signal when the watch read the worker's status before vLLM's engine core reaped it
    # (a worker is not this process's child: it reads /proc, which races with the reaping).
    hows = ("killed by SIGKILL", "its exit status went to its parent process")
    named = [f"worker process (pid {workers[-1]}) died ({how})" for how in hows]
    assert len(errors) == 1 and any(n in errors[0] for n in named), text[-4000:]
    # The surviving worker and the engine core log their own errors (vLLM's, with tracebacks:
    # its peer is gone); the command itself ends on its one line, no traceback of its own.
    assert 'tllm_core/app/cli.py", line' not in text, text[-4000:]
    assert descendants(proc.pid, settle=DEATH_BOUND_S) == [], text[-4000:]
    assert leftover_shm(before, pids | {proc.pid}) == [], text[-4000:]


# -- served: a killed engine core ends the server ------------------------------------------------
@pytest.mark.vllm
@pytest.mark.slow  # a server start (~55 s); the command's case above is the default one
def test_kill_9_of_the_engine_core_ends_tllm_serve_naming_it(tiny_model, tmp_path):
    from serve_util import free_port

    log = tmp_path / "serve.log"
    before = shm_entries()
    port = free_port()
    out = tmp_path / "x"
    spec = json.dumps({"out": str(out), "layers": [0], "shard_rows": 2})
    argv = ["serve", "--model", tiny_model, "--consumer", f"export:{spec}", "--port", str(port)]
    argv += ["--max-model-len", "512", "--kv-cache-gib", "1", "--", "--enforce-eager"]
    proc = start(argv, log)
    try:
        wait_for(log, "tllm: ready", proc, 300)
        body = json.dumps({"model": "default", "prompt": [5, 6, 7], "max_tokens": 3}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:  # some shards written
            assert r.status == 200
        pids = set(descendants(proc.pid))
        core = _engine_core(proc.pid)
        os.kill(core, signal.SIGKILL)
        code = exit_within(proc, DEATH_BOUND_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code not in (0, None), (code, text[-4000:])
    errors = [ln for ln in text.splitlines() if ln.startswith(("tllm: error:", "error:"))]
    assert errors and "engine" in errors[-1], text[-4000:]
    assert descendants(proc.pid, settle=DEATH_BOUND_S) == [], text[-4000:]
    assert leftover_shm(before, pids | {proc.pid}) == [], text[-4000:]
    # The export kept what it wrote and says why it is incomplete.
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False and "engine failed" in manifest["run_error"]


# -- a stop signal while a consumer callback hangs -----------------------------------------------
@pytest.mark.vllm
def test_sigterm_ends_a_run_whose_consumer_hangs_within_the_stop_timeout(tiny_model, tmp_path):
    """The hang outlasts everything (600 s, deadline 300 s): SIGTERM must still end the run
    within the stop timeout, and take the engine with it."""
    log = tmp_path / "run.log"
    before = shm_entries()
    hang = json.dumps({"callback": "on_bundle", "after": 2, "seconds": 600})
    argv = ["run", "--model", tiny_model, "--consumer", f"hang:{hang}", "-n", "2"]
    argv += ["--max-tokens", "64", "--callback-deadline", "300", *SMALL_ENGINE]
    proc = start(argv, log, TLLM_STOP_TIMEOUT_S="8")
    try:
        wait_for(log, "tllm: engine ready", proc, 300)
        time.sleep(5)  # on_bundle's second call hangs at once
        pids = set(descendants(proc.pid))
        proc.send_signal(signal.SIGTERM)
        code = exit_within(proc, 8 + 15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code is not None and code != 0, text[-4000:]
    assert descendants(proc.pid, settle=DEATH_BOUND_S) == [], text[-4000:]
    assert leftover_shm(before, pids | {proc.pid}) == [], text[-4000:]


@pytest.mark.vllm
def test_a_tllmllm_whose_engine_lacks_the_runtime_stops_that_engine(tiny_model, monkeypatch):
    """The engine started but reports no tllm runtime (the plugin filtered out): the error
    names the cause, and the engine is stopped, not left holding its processes and device."""
    import vllm

    from tllm_core import TllmLLM
    from tllm_core.app import engine as engine_module
    from tllm_core.vllm_bridge.errors import UnsupportedEngineError

    stopped = []

    class Started:  # vllm.LLM with an engine whose workers have no tllm runtime
        def __init__(self, **kwargs):
            self.llm_engine = None

        def collective_rpc(self, method, args=()):
            return [{"installed": False}]

    monkeypatch.setattr(vllm, "LLM", Started)
    monkeypatch.setattr(engine_module, "shutdown_engine", lambda llm, **kw: stopped.append(llm))
    with pytest.raises(UnsupportedEngineError, match="runtime was not installed"):
        TllmLLM(tiny_model, [], enforce_eager=True)
    assert len(stopped) == 1 and isinstance(stopped[0], Started)
