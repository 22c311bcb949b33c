"""Shared fixtures: tiny models built once, vLLM engines shared across tests.

In-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) start in seconds; tests of vLLM's
default multiprocess layout run the ``tllm`` command in a subprocess instead.
"""

from __future__ import annotations

import gc
import io
import json
import os
import subprocess
import sys
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import pytest
from cli_util import BIND_ENV, UNBOUND, cli_env

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL_CACHE = Path(
    os.environ.get("TLLM_TEST_MODELS", Path.home() / ".cache" / "tllm" / "test-models")
)
ENGINE_KW = dict(dtype="float32", max_model_len=512, enforce_eager=True)


# -- the whole suite on two pytest-xdist workers --------------------------------------------------
# Most tests wait on one thread (imports, an engine starting, a subprocess) and use about one of
# the two cores of the machines the suite is sized for: two workers finish it in about half the
# time. Only a run of the whole default suite (``python3 -m pytest``: no paths, no -m) is
# spread; ``-n N`` chooses (``-n0``: none), and a run of some tests (``pytest tests/test_x.py``)
# stays in one process, its output and --pdb as usual.
SUITE_WORKERS = 2
DEFAULT_MARKS = "not slow"  # pyproject.toml's addopts
# Seconds per group in a whole default run (``--write-durations`` rewrites it); a group not
# listed (a new file) counts as UNKNOWN_GROUP_S: early, in case it is long.
DURATIONS = TESTS / "durations.json"
UNKNOWN_GROUP_S = 60.0


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist turns -n into its workers
def pytest_cmdline_main(config: pytest.Config) -> None:
    option = config.option
    if hasattr(config, "workerinput") or getattr(option, "numprocesses", 0) is not None:
        return  # a worker, -n given, or pytest-xdist absent (-p no:xdist)
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    default_marks = option.markexpr == DEFAULT_MARKS
    if not whole_suite or not default_marks or option.usepdb or option.collectonly:
        return
    option.numprocesses = SUITE_WORKERS
    option.dist = "loadgroup"
    option.loadscopereorder = False  # the groups' order is ours (longest first)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """pytest-xdist's workers read ``--dist`` from the command line, where the default above
    is not: they are told here that tests are grouped (``xdist_group``)."""
    node.workerinput["tllm_dist"] = node.config.option.dist


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """A grouping pytest-xdist did not apply stops the run at once: split over two workers, a
    file's module fixtures would run twice and a shared server would start twice (as with
    pytest 9.2 and pytest-xdist 3.8: pytest-xdist issue 1386; pyproject.toml pins pytest)."""
    if node.config.option.dist == "loadgroup" and not all("@" in i for i in ids):
        pytest.exit(
            f"pytest-xdist did not group the tests (e.g. {ids[0]}) with pytest "
            f"{pytest.__version__}: tests/conftest.py's grouping needs a pytest it works with "
            "(pyproject.toml's test extra)",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def pytest_configure(config: pytest.Config) -> None:
    # The test plugin package (tests/plugin_pkg) contributes its consumers only under the suite.
    os.environ.setdefault("TLLM_TEST_PLUGINS", "1")
    if getattr(config, "workerinput", {}).get("tllm_dist") == "loadgroup":
        config.option.loadgroup = True
    if hasattr(config, "workerinput") and config.option.markexpr == DEFAULT_MARKS:
        # The engines two workers start at once each get both cores (cli_util.UNBOUND), and
        # one OpenMP thread each: two of two threads would oversubscribe them (see below).
        os.environ.setdefault(BIND_ENV, UNBOUND)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if config.getoption("write_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_GroupSeconds(), "tllm-group-seconds")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from tiny_models import build_tiny_model

    return str(build_tiny_model(MODEL_CACHE, arch="llama"))


@pytest.fixture(scope="session")
def tiny_qwen() -> str:
    from tiny_models import build_tiny_model

    return str(build_tiny_model(MODEL_CACHE, arch="qwen2", num_layers=3))


class EngineCache:
    """One live in-process engine at a time (each holds its KV cache), keyed by config."""

    def __init__(self) -> None:
        self.key = None
        self.llm = None

    def get(self, key, factory):
        if self.key != key:
            self.close()
            self.llm = factory()
            self.key = key
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            llm = self.llm
            self.llm = None
            self.key = None
            inner = getattr(llm, "llm", llm)
            engine = getattr(inner, "llm_engine", None)
            if engine is not None and hasattr(engine, "engine_core"):
                try:
                    engine.engine_core.shutdown()
                except Exception:  # noqa: BLE001
                    pass
            del llm, inner, engine
            gc.collect()


@pytest.fixture(autouse=True)
def _one_torch_thread_per_worker(request):
    """A worker of the spread suite computes (references, in-process engines) on one intra-op
    thread: two workers of two threads each oversubscribe the two cores, and OpenMP's waiting
    threads then make a tiny model's forward about ten times slower. torch._C's binding:
    vLLM's CPU worker replaces torch.set_num_threads with a no-op in its process."""
    if hasattr(request.config, "workerinput"):
        import torch

        torch._C.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _no_leaked_dist_ident():
    """vLLM's CPU worker sets VLLM_DIST_IDENT in its own process; an in-process engine thus
    leaves it in the test process, and a ``tllm`` subprocess started later would inherit it
    and be warned about an unknown vLLM variable. Tests see the environment a user has."""
    yield
    os.environ.pop("VLLM_DIST_IDENT", None)


@pytest.fixture(autouse=True)
def _stop_handlers_undone():
    """A command's ``main`` run in this process installs tllm's stop handlers (SIGTERM and
    SIGINT as Ctrl-C, one owner per process); they are undone after the test, so pytest's
    own Ctrl-C and later tests (which check the handlers) start from a process without them."""
    yield
    stop = sys.modules.get("tllm_core.app.stop")
    if stop is not None:
        stop.uninstall()


@pytest.fixture(autouse=True)
def restored_environ():
    """Every test leaves the environment as it found it: a command's ``main`` run in this
    process sets what its engine processes inherit (``quiet``: vLLM's logging level and
    config, ``TLLM_QUIET``; vLLM's compile switches), which would reach every server and
    command later tests start (the full suite lost test_serving's 'tllm: serving' line and
    the AOT-compile check that way)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    envs = sys.modules.get("vllm.envs")
    if envs is not None and hasattr(envs, "disable_envs_cache"):
        # An in-process engine freezes vLLM's view of the environment; the next test reads
        # the environment it is given.
        envs.disable_envs_cache()


@contextmanager
def registered_plugin(plugin: object, name: str):
    """Registers ``plugin`` (an object with hookimpls) in every Registry built in this process
    while active (an in-process engine's worker builds its own), as an installed plugin package
    would."""
    from tllm_core.plugins.loader import Plugins

    original = Plugins.load.__func__

    def with_plugin(cls, *args, **kwargs):
        plugins = original(cls, *args, **kwargs)
        plugins.register(plugin, name)
        return plugins

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Plugins, "load", classmethod(with_plugin))
        yield


@pytest.fixture(scope="session")
def engines():
    cache = EngineCache()
    yield cache
    cache.close()


# -- a tllm serve shared by the tests that ask for it --------------------------------------------
SERVE_KEY = "k-test-26"
_SHARED = pytest.StashKey[dict]()  # fixture name -> its SharedServer, once started
_LAST_USER = pytest.StashKey[dict]()  # fixture name -> node id of the last test using it
_SHARED_FIXTURES = ("guarded_server",)


@pytest.fixture(scope="session")
def guarded_server(tiny_model, tmp_path_factory, pytestconfig):
    """``tllm serve`` on the tiny model with per-request ``esamp``, ``steer`` (a vector at
    layer 1), ``stats`` and ``export`` (no files: rows returned with the completion), a 1 MiB
    body limit, 64 KiB results and the API key ``SERVE_KEY``: the server of
    test_serve_command, test_serve_fuzz, test_serve_guarded and test_results, started once
    for them."""
    import torch
    from safetensors.torch import save_file
    from serve_util import SharedServer

    shared = pytestconfig.stash.setdefault(_SHARED, {})
    if "guarded_server" not in shared:
        tmp = tmp_path_factory.mktemp("guarded-server")
        hidden = json.loads((Path(tiny_model) / "config.json").read_text())["hidden_size"]
        vector = tmp / "v.safetensors"
        g = torch.Generator().manual_seed(0)
        save_file({"v": torch.randn(hidden, generator=g)}, str(vector))
        steer = json.dumps({"vectors": [{"layer": 1, "path": str(vector)}]})
        args = ["--model", tiny_model, "--consumer", "esamp", "--consumer", f"steer:{steer}"]
        export = json.dumps({"out": None, "layers": [0, -1], "phase": "all"})
        args += ["--consumer", "stats", "--consumer", f"export:{export}", "--per-request"]
        args += ["--max-body-mib", "1", "--max-result-kib", "64"]
        args += ["--max-model-len", "512", "--kv-cache-gib", "1"]
        args += ["--", "--enforce-eager", "--api-key", SERVE_KEY]
        shared["guarded_server"] = SharedServer(args, tmp / "serve.err", key=SERVE_KEY)
    server = shared["guarded_server"]
    yield server.start()
    server.stop()  # normally stopped already, after its last test


def _xdist_group(item: pytest.Item) -> str:
    """The group of a test under ``--dist loadgroup``: its ``xdist_group`` mark's, else a
    shared server's it uses, else its file."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    shared = [name for name in _SHARED_FIXTURES if name in getattr(item, "fixturenames", ())]
    return shared[0] if shared else item.nodeid.split("::", 1)[0]


def pytest_itemcollected(item: pytest.Item) -> None:
    """Groups for pytest-xdist's ``--dist loadgroup`` (the default, ``-n 2``): the users of a
    shared server run on one worker (one server, stopped after its last user); every other
    test runs on one worker with the rest of its file (a file's module fixtures and
    consecutive tests sharing an engine start it once). Marked as each test is collected:
    pytest-xdist reads the marks in its own ``pytest_collection_modifyitems``, which may run
    before this file's (it does with pytest 9.2 and pluggy 1.7)."""
    if getattr(item.config.option, "loadgroup", False):  # set in pytest-xdist's workers
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_xdist_group(item)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The groups are handed out longest first (seconds from ``DURATIONS``), so that the last
    ones, run while the other worker may have nothing left, are short."""
    if not getattr(config.option, "loadgroup", False):
        return
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(_xdist_group(item), []).append(item)
    ordered = sorted(groups.items(), key=lambda kv: -seconds.get(kv[0], UNKNOWN_GROUP_S))
    items[:] = [item for _, members in ordered for item in members]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--write-durations",
        action="store_true",
        help=f"write {DURATIONS.relative_to(TESTS.parent)}: each xdist group's seconds in "
        "this run (a whole default run: the order groups are handed out in)",
    )


class _GroupSeconds:
    """Sums the setup, call and teardown seconds of each group's tests; writes DURATIONS."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        # pytest-xdist's own rule: the group follows the last '@' unless inside the params
        at = nodeid.rfind("@")
        group = nodeid[at + 1 :] if at > nodeid.rfind("]") else nodeid.split("::", 1)[0]
        self.seconds[group] = self.seconds.get(group, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        rounded = {k: round(v, 1) for k, v in sorted(self.seconds.items())}
        DURATIONS.write_text(json.dumps(rounded, indent=1) + "\n")


def pytest_collection_finish(session: pytest.Session) -> None:
    last = {}
    for item in session.items:
        for name in _SHARED_FIXTURES:
            if name in getattr(item, "fixturenames", ()):
                last[name] = item.nodeid
    session.config.stash[_LAST_USER] = last


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """A shared server stops after the last test that uses it, not when the whole test run ends: it
    would hold its processes and memory through every later test."""
    shared = item.config.stash.get(_SHARED, {})
    for name, nodeid in item.config.stash.get(_LAST_USER, {}).items():
        if nodeid == item.nodeid and name in shared:
            shared.pop(name).stop()


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``tllm`` in vLLM's default (multiprocess) layout."""
    with subprocess.Popen(
        [sys.executable, "-m", "tllm_core.app.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(**(env or {})),
    ) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
    proc = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    proc.pid = p.pid  # the front end's pid: consumers must run elsewhere
    return proc


def cli_in_process(*args: str) -> dict:
    """The ``--json`` report of ``tllm *args`` run by its ``main`` in this process, with an
    in-process engine: seconds to start, not the ~40 s of the multiprocess layout's three
    interpreters. For tests of what a command computes, not of its processes."""
    from tllm_core.app.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        status = main([*args, "--json"])
    assert status == 0, f"tllm {' '.join(args)} exited {status}"
    return json.loads(out.getvalue().strip().splitlines()[-1])


def cli_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"tllm failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def cuda_on_cpu():
    """``torch.cuda``'s streams, events and graphs on CPU tensors that compute
    (``FakeCuda(device="cpu")``): the CUDA path's host logic checked against values."""
    from tllm_core.testing.fake_cuda import FakeCuda

    with FakeCuda(device="cpu") as fc:
        yield fc
