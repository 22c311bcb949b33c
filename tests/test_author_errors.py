"""Errors an algorithm author can act on (issue 37): each names the consumer, the field or
port, the bad value and what is allowed, and comes before vLLM starts where it can."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from tllm_core import Consumer, ConsumerConfig, HiddenStates, Phase, ResidualEdit, hookimpl
from tllm_core.api.ports import resolve_layer
from tllm_core.plugins.registry import Registry


# -- port constructors ------------------------------------------------------------------------
def test_port_constructors_accept_the_documented_grammar_and_refuse_the_rest():
    from producers import AttentionOutput

    assert HiddenStates("layer.8") == HiddenStates(8) and HiddenStates(8).key == "layer.8"
    assert HiddenStates(" layer.-1 ", "decode") == HiddenStates(-1, Phase.DECODE)
    assert HiddenStates("final").key == "final"
    assert HiddenStates(np.int64(3)).layer == 3 and type(HiddenStates(np.int64(3)).layer) is int
    assert AttentionOutput("attn.2") == AttentionOutput(2)
    assert ResidualEdit("layer.2") == ResidualEdit(2) and ResidualEdit(2).target == HiddenStates(2)
    for bad in ("8", 8.0, True, "attn.3", "layer.x", "Final", None):
        with pytest.raises(ValueError) as e:
            HiddenStates(bad)
        msg = str(e.value)
        assert f"HiddenStates(layer={bad!r})" in msg and "'layer.{i}' or 'final'" in msg, msg
    with pytest.raises(ValueError, match=r"AttentionOutput\(layer='layer.2'\): .*'attn.\{i\}'$"):
        AttentionOutput("layer.2")  # 'final' is not offered: an attention port has no final
    with pytest.raises(ValueError, match=r"ResidualEdit\(layer='final'\)"):
        ResidualEdit("final")
    with pytest.raises(ValueError, match=r"phase='dec'.*'prefill', 'decode', 'all'"):
        HiddenStates(1, "dec")


# -- consumers built before vLLM starts ---------------------------------------------------------
class LayerConfig(ConsumerConfig):
    layer: int = -1


class AtLayer(Consumer):
    """Resolves its layer in __init__, as the tutorial's consumer does."""

    name = "at_layer"
    Config = LayerConfig

    def __init__(self, config, context):
        super().__init__(config, context)
        self.layer = context.resolve_layer(config.layer)

    def reads(self):
        return [HiddenStates(self.layer, Phase.DECODE)]


class PortOnly(Consumer):
    """Never resolves its layer itself: the port does."""

    name = "port_only"
    Config = LayerConfig

    def reads(self):
        return [HiddenStates(self.config.layer)]


class GuideOnly(Consumer):
    """Reads a port at guide time only, but never guides: a mistake named at build."""

    name = "guide_only"

    def reads(self):
        return [HiddenStates(0, Phase.GUIDE)]


class Swapped(Consumer):
    """A write port in reads() and a read port in writes()."""

    name = "swapped"

    class Config(ConsumerConfig):
        method: str = "reads"

    def reads(self):
        return [ResidualEdit(1)] if self.config.method == "reads" else []

    def writes(self):
        return [HiddenStates(1)] if self.config.method == "writes" else []


class Broken(Consumer):
    name = "broken"

    def __init__(self, config, context):
        super().__init__(config, context)
        self.table = context.model.lm_head_weight.float()  # None in the dry build: a bug


def _registry() -> Registry:
    plugin = types.ModuleType("author_errors_plugin")
    plugin.tllm_consumers = hookimpl(lambda: [AtLayer, PortOnly, Broken, GuideOnly, Swapped])
    reg = Registry()
    reg.register(plugin)
    return reg


def test_an_out_of_range_layer_names_the_consumer_the_field_and_the_range(tiny_model):
    from tllm_core.app.engine import validate_consumers
    from tllm_core.runtime.build_error import ConsumerBuildError

    reg = _registry()
    for spec, what in [
        ('at_layer:{"layer": 40}', "config field 'layer' = 40"),
        ('port_only:{"layer": -5}', "config field 'layer' = -5"),
        ('stats:{"layers": [0, 9]}', "config field 'layers' = 9"),
    ]:
        with pytest.raises(ConsumerBuildError) as e:
            validate_consumers([spec], tiny_model, registry=reg)
        msg = str(e.value)
        name = spec.split(":")[0]
        assert msg.startswith(f"consumer {name!r}: {what} is out of range"), msg
        assert "has 4 decoder layers (valid: -4..3" in msg and "final" not in msg, msg
        assert tiny_model in msg and e.value.consumer == name
    validate_consumers(['at_layer:{"layer": -4}'], tiny_model, registry=reg)  # in range
    with pytest.raises(ValueError, match=r"valid: -3..2, negative counts") as e:
        resolve_layer(3, 3)
    assert "final" not in str(e.value)


def test_an_exception_in_init_during_the_dry_build_says_where_it_happened(tiny_model):
    from tllm_core.app.engine import validate_consumers
    from tllm_core.runtime.build_error import ConsumerBuildError

    with pytest.raises(ConsumerBuildError) as e:
        validate_consumers(["broken"], tiny_model, registry=_registry())
    msg = str(e.value)
    assert msg.startswith("consumer 'broken' raised AttributeError while being built in the dry")
    assert "device 'meta'" in msg and "before vLLM starts" in msg
    # the author's own line, not the runtime's
    assert f"(at {__file__}:" in msg and "in __init__)" in msg, msg
    assert isinstance(e.value, ValueError)  # the command exits 2


def test_a_guide_time_port_without_a_guide_is_refused_at_build(tiny_model):
    from tllm_core.app.engine import validate_consumers

    with pytest.raises(ValueError) as e:
        validate_consumers(["guide_only"], tiny_model, registry=_registry())
    msg = str(e.value)
    assert msg.startswith(
        "consumer 'guide_only': read port HiddenStates(layer=0, phase=<Phase.GUIDE"
    )
    assert "declares no SamplerGuide" in msg


def test_a_port_declared_in_the_wrong_method_is_named_with_where_it_goes(tiny_model):
    from tllm_core.app.engine import validate_consumers

    for method, other, port in (("reads", "writes", "ResidualEdit"), ("writes", "reads", "Hidden")):
        with pytest.raises(ValueError) as e:
            spec = f'swapped:{{"method": "{method}"}}'
            validate_consumers([spec], tiny_model, registry=_registry())
        msg = str(e.value)
        assert msg.startswith(f"consumer 'swapped': {method}() returned {port}"), msg
        assert msg.endswith(f"declare it in {other}()") and "meta" not in msg, msg


def test_a_key_no_port_captured_is_named_in_the_error_with_those_captured(tiny_model):
    """``bundle.hidden`` is a plain dict (saved and loaded as one); a consumer's ``KeyError``
    of a port key its bundle lacks is reported with the keys the bundle holds."""
    from tllm_core.app.engine import ConsumerDisabledError
    from tllm_core.testing import ConsumerKit

    class WrongKey(Consumer):
        name = "wrong_key"

        def reads(self):
            return [HiddenStates(1)]

        def on_bundle(self, bundle):
            assert type(bundle.hidden) is dict
            bundle.hidden["layer.2"]

    kit = ConsumerKit(tiny_model, [WrongKey])
    with pytest.raises(ConsumerDisabledError) as e:
        kit.generate(["a b"], max_tokens=6, temperature=0.0)
    said = "raised in on_bundle: KeyError: 'layer.2' ('layer.2' is not captured in this step "
    assert said + "(captured: ['layer.1']); declare a read port" in str(e.value), str(e.value)


def _args(**kw) -> argparse.Namespace:
    base = dict(
        prompt=None, prompts=None, n=1, max_tokens=4, temperature=1.0, top_p=1.0, top_k=0,
        min_p=0.0, seed=None, ignore_eos=False, model=None, kv_cache_gib=None, chat=None,
        json=False, verbose=False,
    )  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_the_default_model_is_dry_built_before_starting_vllm(tiny_model, monkeypatch, capsys):
    """`tllm run` without --model: a bad layer fails before "starting vLLM" is printed."""
    from tllm_core.app import cli_common, default_model, engine

    monkeypatch.setattr(default_model, "default_model_path", lambda **_: Path(tiny_model))

    def no_engine(*a, **k):
        raise AssertionError("vLLM was started")

    monkeypatch.setattr(engine, "TllmLLM", no_engine)
    monkeypatch.setattr(cli_common, "prepare_engine_processes", lambda args: None)
    with pytest.raises(ValueError, match=r"consumer 'stats': config field 'layers' = 40"):
        cli_common.generate_with(_args(), ['stats:{"layers": [40]}'])
    assert "starting vLLM" not in capsys.readouterr().err


def _plugin_site(tmp_path: Path) -> Path:
    """A third-party package whose consumer raises in __init__, found by its entry point."""
    site = tmp_path / "site"
    (site / "failinit").mkdir(parents=True)
    (site / "failinit" / "__init__.py").write_text(
        "from tllm_core import Consumer, hookimpl\n\n\n"
        "class FailInit(Consumer):\n"
        "    name = 'failinit'\n\n"
        "    def __init__(self, config, context):\n"
        "        super().__init__(config, context)\n"
        "        raise KeyError('no such table')\n\n\n"
        "@hookimpl\n"
        "def tllm_consumers():\n"
        "    return [FailInit]\n"
    )
    info = site / "failinit-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: failinit\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[tllm]\nfailinit = failinit\n")
    return site


def test_cli_exits_2_before_starting_vllm_on_build_errors(tiny_model, tmp_path):
    site = _plugin_site(tmp_path)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    runs: dict[str, str] = {}
    for consumer, expected in [
        # where, and the author's own line
        ("failinit", "raised KeyError while being built in the dry build (before vLLM starts"),
        ("failinit", "failinit/__init__.py:9 in __init__)"),
        ('stats:{"layers": [40]}', "consumer 'stats': config field 'layers' = 40 is out of"),
    ]:
        if consumer not in runs:
            proc = subprocess.run(
                [sys.executable, "-m", "tllm_core.app.cli", "run", "--model", tiny_model]
                + ["--consumer", consumer],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "PYTHONPATH": path},
            )
            assert proc.returncode == 2, proc.stderr[-2000:]
            runs[consumer] = proc.stderr
        err = runs[consumer]
        assert expected in err and "starting vLLM" not in err and "Traceback" not in err, err


# -- offline runs fail loudly when a consumer was disabled --------------------------------------
def test_json_runs_print_consumer_errors_on_stderr(capsys):
    from tllm_core.app.cli_common import exit_status, print_report

    first = {"consumer": "c", "where": "guide", "error": "consumer 'c' raised in guide: X", "disabled": False}  # fmt: skip
    err = {**first, "disabled": True}
    report = {"runtime": {"consumers_disabled": 1}, "consumers": {"c": {"n": 1}}, "results": {}}
    report["errors"] = [first, err]
    for as_json in (True, False):
        print_report(["p"], [["t"]], report, as_json)
        out, errs = capsys.readouterr()
        said = "ERROR: consumer 'c' raised in guide: X"
        assert f"{said}\n{said} (switched off for the rest of the run)\n" in errs, errs
        assert "1 consumer(s) switched off after repeated failures: 'c'" in errs
        assert "ERROR" not in out
        if as_json:
            assert json.loads(out)["errors"] == [first, err]
    assert exit_status(report) == 1


def test_a_command_reports_a_disabled_consumer_in_one_line(monkeypatch, capsys):
    """A plugin command whose own TllmLLM raises ConsumerDisabledError: exit 1, one line."""
    from tllm_core.app import cli
    from tllm_core.app.engine import ConsumerDisabledError

    err = {"consumer": "c", "where": "guide", "error": "consumer 'c' raised in guide: X"}

    def boom(args):
        raise ConsumerDisabledError([err])

    monkeypatch.setattr(cli, "cmd_run", boom)
    assert cli.main(["run"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("tllm: consumer 'c' was disabled during the run; its first")


def test_disabled_consumers_are_raised_once_with_their_first_error():
    from tllm_core.app.engine import ConsumerDisabledError, first_errors_of_disabled

    errors = [
        {"consumer": "a", "where": "guide", "error": "first a", "disabled": False},
        {"consumer": "b", "where": "on_bundle", "error": "only b", "disabled": False},
        {"consumer": "a", "where": "guide", "error": "third a", "disabled": True},
    ]
    assert first_errors_of_disabled(errors) == [errors[0]]  # b survived its error
    e = ConsumerDisabledError(first_errors_of_disabled(errors), outputs=["o"])
    assert "consumer 'a' was disabled" in str(e) and "first a (in guide)" in str(e)
    assert "raise_on_disabled=False" in str(e) and e.outputs == ["o"]


def test_tllmllm_and_the_cli_share_the_cpu_kv_cache_default(monkeypatch):
    from tllm_core.app.cli_common import set_cpu_kv_cache
    from tllm_core.app.defaults import DEFAULT_KV_CACHE_GIB, KV_ENV, default_kv_cache

    monkeypatch.delenv(KV_ENV, raising=False)
    with default_kv_cache({}):
        assert os.environ[KV_ENV] == str(DEFAULT_KV_CACHE_GIB) == "2"
    assert KV_ENV not in os.environ  # the caller's environment as it was
    with default_kv_cache({"kv_cache_memory_bytes": 1 << 30}):
        assert KV_ENV not in os.environ  # the caller chose
    set_cpu_kv_cache(None)
    assert os.environ[KV_ENV] == str(DEFAULT_KV_CACHE_GIB)
    monkeypatch.setenv(KV_ENV, "5")
    with default_kv_cache({}):
        assert os.environ[KV_ENV] == "5"
    set_cpu_kv_cache(None)
    assert os.environ[KV_ENV] == "5"
    set_cpu_kv_cache(1)
    assert os.environ[KV_ENV] == "1"


@pytest.mark.vllm
def test_tllmllm_raises_when_a_consumer_is_disabled(tiny_model, engines):
    from vllm import SamplingParams

    from tllm_core.app.engine import ConsumerDisabledError, TllmLLM

    engines.close()
    llm = TllmLLM(
        tiny_model,
        ["stats", 'crasher:{"after": 1}'],
        max_consecutive_failures=1,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
    )
    engines.llm, engines.key = llm, ("author-errors-crasher",)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=0)
    with pytest.raises(ConsumerDisabledError) as e:
        llm.generate(["a b c"], params, use_tqdm=False)
    assert "consumer 'crasher' was disabled" in str(e.value)
    assert "RuntimeError: crasher: deliberate failure (in on_bundle)" in str(e.value)
    assert len(e.value.outputs) == 1 and e.value.outputs[0].outputs[0].token_ids
    # raised once: the next call and close go on, the report keeps the error
    assert len(llm.generate(["d e"], params, use_tqdm=False)) == 1
    report = llm.close()
    assert [(x["consumer"], x["disabled"]) for x in report["errors"]] == [("crasher", True)]
    assert report["consumers"]["stats"]["bundles"] > 0
    with pytest.raises(RuntimeError, match="this TllmLLM is closed .*; make a new one"):
        llm.generate(["f g"], params, use_tqdm=False)  # vLLM's own: "EngineCore encountered..."
    assert llm.collect() is report  # the final report stays readable


@pytest.mark.vllm
def test_an_engine_start_failure_reaches_the_caller_as_one_line_with_its_cause(tiny_model):
    """vLLM's default multiprocess layout: a KV cache larger than the machine fails in the
    worker process; TllmLLM raises one line naming vLLM's own error, not "see root cause
    above"."""
    from cli_util import cli_env

    script = (
        "from tllm_core import TllmLLM\n"
        "from tllm_core.vllm_bridge.errors import UnsupportedEngineError\n"
        "if __name__ == '__main__':\n"
        "    try:\n"
        f"        TllmLLM({tiny_model!r}, [], kv_cache_memory_bytes=1 << 50,\n"
        "                max_model_len=512, enforce_eager=True, dtype='float32')\n"
        "    except UnsupportedEngineError as e:\n"
        "        print('CAUGHT', e)\n"
    )
    root = str(Path(__file__).parent.parent)
    env = cli_env(PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env
    )
    caught = [ln for ln in proc.stdout.splitlines() if ln.startswith("CAUGHT")]
    assert caught, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert caught[0].startswith("CAUGHT the engine refused to start: ValueError: Available memory")
    assert "requested memory for kv" in caught[0]
