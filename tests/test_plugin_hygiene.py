"""Plugin hygiene (docs/hooks.md): a misspelled hook implementation is an error naming it
(pluggy's ``check_pending``); a broken plugin is named once, skipped and listed as broken while
everything else works; ``TLLM_PLUGINS`` limits which third-party entry points load.

Fake plugins are installed as distributions on a temporary ``sys.path`` entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pluggy
import pytest

from tllm_core.plugins.loader import ALLOW_ENV, Plugins, TllmPluginWarning, allowed_plugins
from tllm_core.plugins.registry import ConsumerSpecError, Registry

ROOT = Path(__file__).resolve().parent.parent

GOOD = """
from tllm_core import Consumer, hookimpl

class Fine(Consumer):
    name = "fine"
    description = "a working fake consumer"

@hookimpl
def tllm_consumers():
    return [Fine]
"""
MISSPELLED = """
from tllm_core import hookimpl

@hookimpl
def tllm_consumer():  # no such hook: tllm_consumers
    return []
"""
RAISES = """
from tllm_core import hookimpl

@hookimpl
def tllm_consumers():
    raise RuntimeError("boom in tllm_consumers")
"""
# Its producer is fine, its consumer is not: neither may stay registered.
HALF = """
from tllm_core import Consumer, LayerPort, Producer, TapRequest, hookimpl

class HalfPort(LayerPort):
    prefix = "half"

class HalfProducer(Producer):
    name = "half"
    ports = (HalfPort,)
    def taps(self, port):
        return [TapRequest("residual", port.layer)]

@hookimpl
def tllm_producers():
    return [HalfProducer]

@hookimpl
def tllm_consumers():
    return [object]
"""


def install(root: Path, dist: str, plugins: dict[str, str | None]) -> None:
    """A distribution ``dist`` on ``root`` whose ``tllm`` entry points are ``plugins``
    (entry-point name -> module source; None: the module is missing)."""
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = ["[tllm]"]
    for ep, source in plugins.items():
        module = f"fake_{ep}_plugin"
        lines.append(f"{ep} = {module}")
        if source is not None:
            (root / f"{module}.py").write_text(textwrap.dedent(source))
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture(autouse=True, scope="module")
def _no_leaked_allow_list():
    """``tllm``'s main() sets TLLM_PLUGINS for the processes it starts when a plugin is
    broken; the module leaves the variable as it found it, so later tests load every plugin."""
    before = os.environ.get(ALLOW_ENV)
    yield
    if before is None:
        os.environ.pop(ALLOW_ENV, None)
    else:
        os.environ[ALLOW_ENV] = before


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    return tmp_path


def registry_warnings() -> tuple[Registry, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reg = Registry()
    return reg, [str(w.message) for w in caught if issubclass(w.category, TllmPluginWarning)]


def test_an_unimportable_plugin_is_named_once_and_skipped(site):
    install(site, "tllm-broken-example", {"broken": None, "fine": GOOD})
    reg, warned = registry_warnings()
    assert len(warned) == 1, warned
    assert "'broken'" in warned[0] and "'tllm-broken-example'" in warned[0]
    assert "ModuleNotFoundError" in warned[0] and "pip uninstall tllm-broken-example" in warned[0]
    assert "fine" in reg.names and "stats" in reg.names  # the others still load
    assert [b.name for b in reg.broken] == ["broken"]
    listed = {c["name"]: c for c in reg.describe()}
    assert listed["broken"]["broken"] and "ModuleNotFoundError" in listed["broken"]["error"]
    assert not listed["fine"]["broken"]
    with pytest.raises(ConsumerSpecError, match=r"unknown consumer 'nope'.*skipped.*'broken'"):
        reg.get("nope")


def test_a_misspelled_hook_is_an_error_naming_it(site):
    install(site, "tllm-typo", {"typo": MISSPELLED, "fine": GOOD})
    reg, warned = registry_warnings()
    assert len(warned) == 1 and "'typo'" in warned[0]
    assert "unknown hook 'tllm_consumer'" in warned[0]
    assert "fine" in reg.names and not reg.pm.has_plugin("typo")

    # Registered at run time, it raises (and leaves nothing registered).
    import fake_typo_plugin

    reg = Registry(load_entry_points=False)
    with pytest.raises(pluggy.PluginValidationError, match="unknown hook 'tllm_consumer'"):
        reg.register(fake_typo_plugin, name="typo")
    assert not reg.pm.has_plugin("typo")


def test_a_plugin_whose_hook_fails_is_skipped_whole(site):
    install(site, "tllm-failing", {"raises": RAISES, "half": HALF, "fine": GOOD})
    reg, warned = registry_warnings()
    assert len(warned) == 2, warned
    text = "\n".join(warned)
    assert "'raises'" in text and "boom in tllm_consumers" in text
    assert "'half'" in text and "expected a named Consumer subclass" in text
    assert "fine" in reg.names and "stats" in reg.names
    assert sorted(b.name for b in reg.broken) == ["half", "raises"]
    # half's producer went with it: its port prefix is not served
    with pytest.raises(ValueError, match="bad port 'half.0'"):
        reg.parse_port("half.0")
    assert not reg.pm.has_plugin("half") and not reg.pm.has_plugin("raises")


def test_allow_list_limits_third_party_entry_points(site, monkeypatch):
    install(site, "tllm-two", {"fine": GOOD, "broken": None})
    assert allowed_plugins({}) is None
    assert allowed_plugins({ALLOW_ENV: " fine , other,"}) == {"fine", "other"}
    assert allowed_plugins({ALLOW_ENV: ""}) == frozenset()

    monkeypatch.setenv(ALLOW_ENV, "fine")
    reg, warned = registry_warnings()
    assert warned == [] and "fine" in reg.names and reg.broken == []
    assert "stats" in reg.names and "esamp" in reg.names  # built-ins always load

    monkeypatch.setenv(ALLOW_ENV, "")
    reg, warned = registry_warnings()
    assert warned == [] and "fine" not in reg.names and "recorder" not in reg.names
    assert "stats" in reg.names

    plugins = Plugins.load(environ={ALLOW_ENV: "recorder"}, on_broken=pytest.fail)
    assert "recorder" in plugins.loaded and "fine" not in plugins.loaded


def _tllm(site: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != ALLOW_ENV}
    return subprocess.run(
        [sys.executable, "-m", "tllm_core.app.cli", *argv],
        capture_output=True,
        text=True,
        env={**base, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), **env},
        timeout=120,
    )


def test_tllm_command_names_a_broken_plugin_once_and_keeps_working(site):
    install(site, "tllm-broken-example", {"broken": None})
    proc = _tllm(site, "consumers", "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("tllm plugin 'broken'") == 1, proc.stderr
    assert "tllm: warning:" in proc.stderr and "Traceback" not in proc.stderr
    listed = {c["name"]: c for c in json.loads(proc.stdout)}
    assert listed["broken"]["broken"] is True and not listed["stats"]["broken"]

    proc = _tllm(site, "consumers")
    assert proc.returncode == 0 and "BROKEN (skipped)" in proc.stdout
    proc = _tllm(site, "--help")
    assert proc.returncode == 0 and "recorder-hello" in proc.stdout, proc.stderr
    proc = _tllm(site, "consumers", **{ALLOW_ENV: "recorder"})
    assert proc.returncode == 0 and proc.stderr == "" and "BROKEN" not in proc.stdout


def test_tllm_command_passes_the_working_plugins_to_its_processes(site, monkeypatch):
    from tllm_core.app import cli

    install(site, "tllm-broken-example", {"broken": None})
    seen = {}
    monkeypatch.setattr(cli, "cmd_run", lambda args: seen.setdefault("env", os.environ[ALLOW_ENV]))
    monkeypatch.setattr(cli, "print_broken", lambda b: seen.setdefault("named", []).append(b.name))
    cli.main(["run"])
    allowed = set(seen["env"].split(","))
    assert "broken" not in allowed and {"recorder", "consumers", "producers"} <= allowed
    assert seen["named"] == ["broken"]


CLASHES = """
from tllm_core import Consumer, hookimpl

class MyStats(Consumer):
    name = "stats"

@hookimpl
def tllm_consumers():
    return [MyStats]

@hookimpl
def tllm_commands(subparsers):
    subparsers.add_parser("clash-cmd", help="a command of the clashing plugin")
"""


def test_a_consumer_name_clash_is_named_once_by_the_command_before_anything_starts(
    site, monkeypatch
):
    """Found when its consumers are collected (not at import): the command names it once,
    in its own words, refuses its commands and keeps it from the engine processes."""
    from tllm_core.app import cli

    install(site, "tllm-clash", {"clash": CLASHES})
    seen = {}
    monkeypatch.setattr(cli, "cmd_run", lambda args: seen.setdefault("env", os.environ[ALLOW_ENV]))
    monkeypatch.setattr(cli, "print_broken", lambda b: seen.setdefault("named", []).append(b))
    with warnings.catch_warnings():
        warnings.simplefilter("error", TllmPluginWarning)  # no Python warning besides
        cli.main(["run"])
    [broken] = seen["named"]
    assert broken.name == "clash" and "clash" not in seen["env"].split(",")
    assert (
        "consumer name 'stats' is taken by plugin 'consumers' (consumers.stats.StatsConsumer); "
        "fake_clash_plugin.MyStats needs another name"
    ) in broken.error
    monkeypatch.delenv(ALLOW_ENV)
    assert cli.main(["clash-cmd"]) == 2  # listed (found broken after parsing), refused


def test_one_plugin_registering_one_name_twice_is_told_so():
    from tllm_core import Consumer, hookimpl

    def named(cls_name: str) -> type[Consumer]:
        return type(cls_name, (Consumer,), {"name": "twice"})

    class Plugin:
        @hookimpl
        def tllm_consumers(self):
            return [named("First"), named("Second")]

    reg = Registry()
    with pytest.raises(ValueError, match="plugin 'mine' registers two consumers named 'twice'"):
        reg.register(Plugin(), "mine")
    assert "twice" not in reg.names


def test_the_allow_list_set_by_the_command_is_undone(site):
    assert ALLOW_ENV not in os.environ  # the test above's main() changed it under monkeypatch


COMMAND_FAILS = """
from tllm_core import hookimpl

@hookimpl
def tllm_commands(subparsers):
    subparsers.add_parser("halfmade", help="added before the hook failed")
    raise RuntimeError("boom in tllm_commands")
"""


def test_a_plugin_whose_command_hook_fails_leaves_the_other_commands(site):
    from tllm_core.app.cli import build_parser

    install(site, "tllm-bad-command", {"badcmd": COMMAND_FAILS})
    named = []
    plugins = Plugins.load(on_broken=named.append)
    help_text = build_parser(plugins).format_help()
    assert "recorder-hello" in help_text and "export" in help_text
    assert [b.name for b in named] == ["badcmd"] and "boom in tllm_commands" in named[0].error
    assert not plugins.pm.has_plugin("badcmd")
    # What it added before it failed goes too: not listed, and an unknown command if typed.
    assert "halfmade" not in help_text
    with pytest.raises(SystemExit) as e:
        build_parser(Plugins.load(on_broken=named.append)).parse_args(["halfmade"])
    assert e.value.code == 2


def test_a_plugin_named_like_a_built_in_replaces_nothing(site):
    """A third-party entry point named ``consumers`` (a built-in's name) is skipped and
    named; the built-in consumers stay, whatever order the distributions are found in."""
    install(site, "tllm-evil", {"consumers": None})
    named = []
    plugins = Plugins.load(on_broken=named.append)
    assert [b.name for b in named] == ["consumers (tllm-evil)"], named
    assert "built-in's" in named[0].error
    names = {c["name"] for c in Registry(plugins=plugins).describe()}
    assert {"export", "stats", "steer", "sae", "esamp"} <= names


def test_esamp_entry_point_imports_no_torch():
    """``algorithms/esamp/plugin.py`` imports torch only when its hook is called (the package
    and ``tllm_core`` import their names on first use)."""
    code = (
        "import sys, algorithms.esamp.plugin as p\n"
        "assert 'torch' not in sys.modules, 'torch imported with the entry point'\n"
        "from algorithms.esamp import ESampConsumer\n"
        "assert p.tllm_consumers() == [ESampConsumer] and 'torch' in sys.modules\n"
        "from tllm_core import Consumer, TllmLLM, hookimpl\n"
        "assert issubclass(ESampConsumer, Consumer)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("bad", ["a:b", "a,b", "my consumer"])
def test_a_consumer_name_specs_cannot_spell_is_refused_at_registration(bad):
    """'a:b' reads as consumer 'a' with config 'b' ("NAME:{json}"), 'a,b' as two names in
    tllm_consumers: such a name is refused where the plugin registers, naming it."""
    from tllm_core import Consumer, hookimpl

    class Named(Consumer):
        name = bad

    class Plugin:
        @staticmethod
        @hookimpl
        def tllm_consumers():
            return [Named]

    reg = Registry(load_entry_points=False)
    with pytest.raises(ValueError, match=f"consumer {bad!r}: name it with letters, digits"):
        reg.register(Plugin, name="badname")
    assert bad not in reg.names
