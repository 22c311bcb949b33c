"""The docs are executable and complete.

- ``docs/tutorial-first-consumer.md``: its fenced blocks tagged ``title="..."`` are extracted,
  the consumer package is pip-installed into a temporary folder put on ``sys.path`` (so the
  ``tllm`` entry point is discoverable, as after ``pip install -e .``), then the engine-free
  check, the ``TllmLLM`` script and the ``tllm run`` command line are run on the tiny model.
- Every built-in consumer has a page under ``docs/consumers/`` naming all its config fields
  and counters; every runtime counter the code writes is in ``docs/counters.md``.
- ``tllm --help`` and each subcommand's help work, and ``docs/cli.md`` names every option.
- Relative links between docs pages resolve.
- Every ```python block of README.md and docs/ runs as written, as a script
  (``python3 file.py``; engine-free blocks in a process forked from one with torch and
  tllm_core imported, see FORK_RUNNER), unless a comment right before it says why not: ``<!-- not-run:
  reason -->`` (a fragment) or ``<!-- run-by: tests/FILE.py::TEST -->`` (a test runs it with
  what it needs, e.g. a server). Blocks that start an engine (``TllmLLM(``) run on the
  embedded model in the slow run.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import cli_json, run_cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TUTORIAL = DOCS / "tutorial-first-consumer.md"
# Pages owned by others: not checked here.
NOT_CHECKED = {"results.md"}

_FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
_TITLE = re.compile(r'title="([^"]+)"')


def doc_blocks(path: Path) -> dict[str, str]:
    """Fenced code blocks of a page that carry ``title="..."``, by title (titles are unique)."""
    out: dict[str, str] = {}
    for m in _FENCE.finditer(path.read_text()):
        t = _TITLE.search(m.group("info"))
        if t:
            assert t.group(1) not in out, f"{path.name}: two blocks titled {t.group(1)!r}"
            out[t.group(1)] = m.group("body")
    return out


def _placeholders(name: str) -> str:
    """``rows_captured.{key}`` and ``rows_captured.{self.key}`` compare equal."""
    return re.sub(r"\{[^}]*\}", "{}", name)


_COUNTER_CALL = re.compile(r"counters\.(?:add|set|max)\(\s*(f?)\"([^\"]+)\"")


def counter_names(paths: list[Path]) -> set[str]:
    names = set()
    for p in paths:
        for m in _COUNTER_CALL.finditer(p.read_text()):
            names.add(_placeholders(m.group(2)))
    return names


def documented(page: Path) -> str:
    """A page's text with ``{placeholders}`` normalised, for substring checks on `code` spans."""
    return _placeholders(page.read_text())


def _py(*folders: str) -> list[Path]:
    return [p for f in folders for p in sorted((ROOT / f).rglob("*.py"))]


# -- the tutorial -------------------------------------------------------------------------
TUTORIAL_PACKAGE_FILES = ("pyproject.toml", "normtrack/__init__.py")


def _pip_install(src: Path, site: Path) -> None:
    """pip-install the package at ``src`` into ``site`` (no deps, no build isolation) and
    put ``site`` first on sys.path."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-input", "--disable-pip-version-check", "--target", str(site), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sys.path.insert(0, str(site))


@pytest.fixture(scope="module")
def tutorial_site(tmp_path_factory):
    """The tutorial's package, pip-installed (with its entry point) into a folder on sys.path."""
    blocks = doc_blocks(TUTORIAL)
    pkg = tmp_path_factory.mktemp("normtrack-src")
    for name in TUTORIAL_PACKAGE_FILES:
        assert name in blocks, f"tutorial lacks the block titled {name!r}"
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(blocks[name])
    site = tmp_path_factory.mktemp("normtrack-site")
    _pip_install(pkg, site)
    # importlib.metadata scans sys.path for *.dist-info on each call; clear the finders'
    # caches so the new folder's entry points are seen now.
    importlib.invalidate_caches()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        for mod in [m for m in sys.modules if m == "normtrack" or m.startswith("normtrack.")]:
            del sys.modules[mod]
        importlib.invalidate_caches()


def test_tutorial_consumer_is_discovered_and_checked_without_an_engine(tutorial_site, tiny_model):
    from tllm_core.plugins.registry import Registry

    assert "normtrack" in Registry().names
    code = doc_blocks(TUTORIAL)["check_normtrack.py"]
    code = code.replace('MODEL_DIR = "path/to/model"', f"MODEL_DIR = {tiny_model!r}")
    exec(compile(code, "check_normtrack.py", "exec"), {"__name__": "__main__"})


@pytest.mark.vllm
def test_tutorial_script_runs_with_tllmllm(tutorial_site, tiny_model, engines):
    code = doc_blocks(TUTORIAL)["run_normtrack.py"]
    assert "MODEL = None" in code
    code = code.replace("MODEL = None", f"MODEL = {tiny_model!r}", 1)
    engines.close()  # one in-process engine at a time
    ns: dict = {"__name__": "__main__"}
    try:
        exec(compile(code, "run_normtrack.py", "exec"), ns)
    finally:
        if "llm" in ns:  # let the shared cache shut the engine down
            engines.llm, engines.key = ns["llm"], ("docs-tutorial",)
    report = ns["report"]
    assert report["errors"] == []
    counters = report["consumers"]["normtrack"]
    assert counters["rows"] > 0 and counters["pairs"] > 0
    assert counters["requests_finished"] == 4
    results = report["results"]["normtrack"]
    assert sorted(results) == ["0/0", "0/1", "1/0", "1/1"]
    for r in results.values():
        assert r["rows"] == 7 and r["mean_norm"] > 0 and -1 <= r["mean_cos_consecutive"] <= 1


@pytest.mark.vllm
@pytest.mark.slow  # ~32 s; the tutorial script runs below, the CLI in test_cli_experience
def test_tutorial_command_line_runs_in_the_default_multiprocess_layout(tutorial_site, tiny_model):
    lines = [ln for ln in doc_blocks(TUTORIAL)["run.sh"].splitlines() if ln.startswith("tllm ")]
    assert len(lines) == 1, lines
    argv = shlex.split(lines[0])[1:]
    argv += ["--model", tiny_model, "--max-model-len", "512", "--enforce-eager"]
    path = os.pathsep.join(p for p in (str(tutorial_site), os.environ.get("PYTHONPATH")) if p)
    out = cli_json(run_cli(*argv, env={"PYTHONPATH": path, "VLLM_CPU_KVCACHE_SPACE": "1"}))
    assert out["errors"] == []
    assert out["counters"]["normtrack"]["rows"] > 0
    assert out["counters"]["runtime"]["bundles_delivered.normtrack"] > 0
    assert sorted(out["results"]["normtrack"]) == ["0/0", "0/1"]


def test_testing_page_example_runs_with_the_tutorial_package(tutorial_site, tiny_model):
    code = doc_blocks(DOCS / "testing-consumers.md")["test_normtrack_kit.py"]
    assert "MODEL = None" in code
    code = code.replace("MODEL = None", f"MODEL = {tiny_model!r}", 1)
    exec(compile(code, "test_normtrack_kit.py", "exec"), {"__name__": "__main__"})


# -- the DoLa example package (docs/example-dola.md) -----------------------------------------
DOLA = DOCS / "example-dola.md"


def _write_blocks(page: Path, names: tuple[str, ...], folder: Path) -> Path:
    blocks = doc_blocks(page)
    for name in names:
        assert name in blocks, f"{page.name} lacks the block titled {name!r}"
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(blocks[name])
    return folder


# ~40 s (a pytest process loading the kit's model); in the default suite: the same package
# in an engine (test_dola_example_runs_in_vllm below) and the kit itself (test_consumer_kit.py)
@pytest.mark.slow
def test_dola_example_tests_pass_with_the_kit(tiny_model, tmp_path):
    """The example's own kit tests, run by pytest as its author would, on the tiny model."""
    _write_blocks(DOLA, ("dola/__init__.py", "test_dola.py"), tmp_path)
    path = os.pathsep.join(p for p in (str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_dola.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path, "DOLA_MODEL": tiny_model},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "3 passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.vllm
def test_dola_example_runs_in_vllm(tiny_model, engines, tmp_path):
    """The same package, pip-installed with its entry point, in an engine."""
    src = _write_blocks(DOLA, ("pyproject.toml", "dola/__init__.py"), tmp_path / "src")
    site = tmp_path / "site"
    _pip_install(src, site)
    importlib.invalidate_caches()
    code = doc_blocks(DOLA)["run_dola.py"].replace("MODEL = None", f"MODEL = {tiny_model!r}", 1)
    engines.close()
    ns: dict = {"__name__": "__main__"}
    try:
        exec(compile(code, "run_dola.py", "exec"), ns)
    finally:
        if "llm" in ns:
            engines.llm, engines.key = ns["llm"], ("docs-dola",)
        sys.path.remove(str(site))
        sys.modules.pop("dola", None)
        importlib.invalidate_caches()
    assert ns["report"]["errors"] == []
    assert ns["report"]["consumers"]["dola"] == {"rows_contrasted": 8}


# -- every python example, as a script ------------------------------------------------------
_PY_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)
_MARK = re.compile(r"<!--\s*(not-run|run-by):\s*((?:(?!-->).)*?)\s*-->\s*\Z", re.S)


def python_blocks() -> list[tuple[str, str, str | None]]:
    """(``page:line``, body, the comment before it or None) of every ```python block."""
    out = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        if page.name in NOT_CHECKED:
            continue
        text = page.read_text()
        for m in _PY_FENCE.finditer(text):
            where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            mark = _MARK.search(text[: m.start()].rstrip() + "\n")
            body = textwrap.dedent(m.group("body"))  # a block inside a list item is indented
            out.append((where, body, mark and f"{mark.group(1)}: {mark.group(2)}"))
    return out


_BLOCKS = python_blocks()
_RUN = [
    pytest.param(body, id=where, marks=[pytest.mark.vllm, pytest.mark.slow])
    if "TllmLLM(" in body
    else pytest.param(body, id=where)
    for where, body, mark in _BLOCKS
    if mark is None
]


def test_python_blocks_that_are_not_run_say_why():
    """Each fragment says why, and each block run elsewhere names an existing test."""
    skipped = {where: mark for where, _, mark in _BLOCKS if mark is not None}
    for where, mark in skipped.items():
        kind, _, reason = mark.partition(": ")
        assert reason, f"{where}: <!-- {kind}: --> needs a reason"
        if kind == "run-by":
            path, _, test = reason.partition("::")
            assert f"def {test}(" in (ROOT / path).read_text(), f"{where}: no test {reason}"
    assert len(_RUN) + len(skipped) == len(_BLOCKS) and _RUN


def test_example_fields_declare_floats_as_finite_f32():
    """hooks.md tells authors to declare float config and request fields as FiniteF32 (a
    plain float lets 1e39 turn the model's tensors into inf/NaN): the examples do."""
    plain = re.compile(r"^[ \t]+\w+: float( \| None)? = ", re.M)
    bad = [where for where, body, _ in _BLOCKS if plain.search(body)]
    assert not bad, f"plain float fields (use tllm_core.FiniteF32) in {bad}"


# Runs each engine-free block as ``python3 example.py`` would (``__main__``, its folder first
# on sys.path, its own cwd, argv, atexit handlers, exit status), in a process forked from one
# that imported torch, numpy, pydantic and tllm_core once: a fresh interpreter per block spent
# 2-5 s of the block's 3-6 s importing them (24 blocks). A block's globals are its own, so a
# missing import still fails; blocks that start an engine keep a fresh interpreter.
FORK_RUNNER = r"""
import json, os, runpy, sys, traceback
import numpy, pydantic, torch  # noqa: F401  (no torch op: OpenMP's pool must not fork)
import tllm_core, tllm_core.testing  # noqa: F401

for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(job["cwd"])
            sys.argv = [job["script"]]
            sys.path[0] = job["cwd"]
            try:
                runpy.run_path(job["script"], run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            import atexit
            import threading

            threading._shutdown()  # as the interpreter's exit: wait for non-daemon threads
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class ForkRunner:
    """FORK_RUNNER in a subprocess: ``run(script)`` -> (exit status, output)."""

    TIMEOUT_S = 900

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        return subprocess.Popen(
            [sys.executable, "-c", FORK_RUNNER],
            env={**os.environ, "PYTHONPATH": path},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def run(self, script: Path) -> tuple[int, str]:
        import select

        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        log = script.with_suffix(".log")
        job = {"script": str(script), "cwd": str(script.parent), "log": str(log)}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.TIMEOUT_S)
        if not ready:
            self.close()
            raise AssertionError(f"{script.name} did not finish in {self.TIMEOUT_S} s")
        line = self.proc.stdout.readline()
        assert line, f"the block runner exited ({self.proc.wait(10)}) running {script.name}"
        output = log.read_text() if log.exists() else ""
        return json.loads(line)["status"], output

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def fork_runner():
    runner = ForkRunner()
    yield runner
    runner.close()


@pytest.mark.parametrize("body", _RUN)
def test_python_block_runs_as_a_script(body, tmp_path, request):
    script = tmp_path / "example.py"
    script.write_text(body)
    if "TllmLLM(" not in body:
        status, output = request.getfixturevalue("fork_runner").run(script)
        assert status == 0, output[-5000:]
        return
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, script.name],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


# -- completeness -------------------------------------------------------------------------
def _builtin_consumers() -> list[dict]:
    from tllm_core.plugins.registry import Registry

    # Built-ins register through the same entry points as third-party plugins.
    info = [
        c for c in Registry().describe() if c["module"].split(".")[0] in ("consumers", "algorithms")
    ]
    assert info, "no built-in consumer registered"
    return info


def test_every_builtin_consumer_has_a_page_naming_its_fields():
    index = (DOCS / "index.md").read_text()
    for c in _builtin_consumers():
        page = DOCS / "consumers" / f"{c['name']}.md"
        assert page.is_file(), f"consumer {c['name']!r} has no page {page.relative_to(ROOT)}"
        assert f"consumers/{c['name']}.md" in index, f"docs/index.md does not link {page.name}"
        text = page.read_text()
        for f in c["fields"]:
            assert f"`{f['name']}`" in text, f"{page.name} does not document field {f['name']!r}"


def test_every_runtime_counter_is_in_counters_md():
    names = counter_names(_py("tllm_core", "producers"))
    assert {"engine_steps", "rows_seen", "bundles_delivered", "consumer_errors"} <= names
    text = documented(DOCS / "counters.md")
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"runtime counters missing from docs/counters.md: {missing}"


CONSUMER_SOURCES = {
    "stats": ["consumers/stats.py"],
    "export": ["consumers/export"],
    "steer": ["consumers/steer"],
    "sae": ["consumers/sae"],
    "esamp": ["algorithms/esamp"],
}


def test_every_consumer_counter_is_on_its_page():
    assert set(CONSUMER_SOURCES) == {c["name"] for c in _builtin_consumers()}
    for name, sources in CONSUMER_SOURCES.items():
        files = []
        for s in sources:
            p = ROOT / s
            files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
        names = counter_names(files)
        if name == "esamp":
            from algorithms.esamp.consumer import COUNTER_NAMES

            names |= set(COUNTER_NAMES)
        text = documented(DOCS / "consumers" / f"{name}.md")
        missing = sorted(n for n in names if f"`{n}`" not in text)
        assert not missing, f"docs/consumers/{name}.md lacks counters {missing}"


def _help(args: tuple[str, ...], capsys) -> str:
    """``tllm ARGS --help`` through the command's ``main`` in this process (a subprocess
    each took ~5 s; that help imports neither vLLM nor torch is test_cli_fast_errors')."""
    from tllm_core.app.cli import main

    with pytest.raises(SystemExit) as done:
        main([*args, "--help"])
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    return out


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("run",),
        ("consumers",),
        ("serve",),
        ("export",),
        ("steer",),
        ("steer", "compute"),
        ("report",),
    ],
)
def test_cli_help_works_and_every_option_is_documented(args, capsys):
    out = _help(args, capsys)
    assert out.startswith("usage: tllm")
    text = (DOCS / "cli.md").read_text()
    for opt in sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", out))):
        assert opt == "--help" or f"`{opt}" in text, f"docs/cli.md does not mention {opt} ({args})"


def test_relative_links_between_pages_resolve():
    pages = [p for p in DOCS.rglob("*.md") if p.name not in NOT_CHECKED]
    pages.append(ROOT / "tllm_core" / "vllm_bridge" / "CONTRACT.md")
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            assert (page.parent / target).exists(), (
                f"{page.relative_to(ROOT)}: broken link {target}"
            )


def _anchor(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs make it (lower case, punctuation dropped)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_to_sections_name_a_heading_of_their_page():
    pages = [p for p in DOCS.rglob("*.md") if p.name not in NOT_CHECKED]
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            linked = (page.parent / target) if target else page
            if re.match(r"[a-z]+:", target) or linked.suffix != ".md" or not linked.exists():
                continue  # another site, a file's own anchor; missing pages: the test above
            prose = re.sub(r"^```.*?^```", "", linked.read_text(), flags=re.MULTILINE | re.DOTALL)
            headings = re.findall(r"^#+ (.+)$", prose, re.MULTILINE)
            assert anchor in {_anchor(h) for h in headings}, (
                f"{page.relative_to(ROOT)}: no heading of {linked.name} has anchor #{anchor}"
            )


# -- the sae worked example ----------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.slow  # ~21 s; SAE loading, records and steering: tests/test_sae_e2e.py
@pytest.mark.parametrize("model", ["tiny", "embedded"])
def test_sae_worked_example_runs(model, request, tmp_path):
    """docs/consumers/sae.md's example (two engines, in order): on the tiny model, and as
    written (the embedded SmolLM2-135M-Instruct) in the slow run."""
    code = doc_blocks(DOCS / "consumers" / "sae.md")["sae_example.py"]
    assert "MODEL = None" in code
    if model == "tiny":
        code = code.replace("MODEL = None", f"MODEL = {request.getfixturevalue('tiny_model')!r}")
    (tmp_path / "sae_example.py").write_text(code)
    proc = subprocess.run(
        [sys.executable, "sae_example.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # vLLM logs to stdout too: find the example's own lines
    lines = proc.stdout.splitlines()
    nums = [ln for ln in lines if re.fullmatch(r"\S+ \S+", ln) and _floats(ln)]
    mean_l0, rel_mse = _floats(nums[0])
    assert 0 < mean_l0 <= 16 and 0 <= rel_mse < 1  # a top-k SAE with k = 16
    records = [ln for ln in lines if re.match(r"\S+ \[\d+(, \d+)*\]$", ln)]
    assert len(records) == 2  # one feature record per request


def _floats(line: str) -> tuple[float, ...] | None:
    try:
        return tuple(float(v) for v in line.split())
    except ValueError:
        return None
