"""Bad input fails before generation with a message naming the bad value and what is allowed."""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest

from tllm_core.api.consumer_spec import ConsumerSpec
from tllm_core.vllm_bridge.version import UnsupportedEngineError, check_version


@pytest.fixture
def run_cli(capsys):
    """``tllm ARGS`` through the command's ``main`` in this process: each case fails before
    vLLM starts, and a subprocess (~5-8 s of imports each) would add nothing to what is
    checked (the exit status and stderr; the installed command is test_cli_fast_errors')."""
    from tllm_core.app.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's refusals
            code = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["tllm", *args], code, out, err)

    return run


def _fails(proc, *needles):
    assert proc.returncode == 2, proc.stderr[-2000:]
    for n in needles:
        assert n in proc.stderr, proc.stderr[-2000:]
    # nothing was generated: no engine start in the log
    assert "Processed prompts" not in proc.stderr


def test_unknown_consumer_lists_available(run_cli):
    _fails(
        run_cli("run", "--consumer", "nope", "--prompt", "x"),
        "unknown consumer 'nope'",
        "esamp",
        "stats",
    )


def test_invalid_config_names_the_field(run_cli):
    _fails(
        run_cli("run", "--consumer", 'esamp:{"beta": -1}', "--prompt", "x"),
        "invalid config for consumer 'esamp'",
        "beta",
    )
    _fails(run_cli("run", "--consumer", "esamp:{oops", "--prompt", "x"), "not valid JSON")


def test_layer_out_of_range_names_layer_count(tiny_model, run_cli):
    _fails(
        run_cli(
            "run", "--model", tiny_model, "--consumer", 'stats:{"layers": [9]}', "--prompt", "x"
        ),
        "consumer 'stats': config field 'layers' = 9 is out of range",
        "4 decoder layers (valid: -4..3",
    )


def test_export_to_unwritable_dir_and_bad_layer_spec(tiny_model, tmp_path, run_cli):
    f = tmp_path / "file"
    f.write_text("x")
    for layers, out, error in (
        ("0", f / "sub", str(f)),
        ("zero", tmp_path / "o", "bad layers entry 'zero'"),
    ):
        argv = ["--model", tiny_model, "--layers", layers, "--out", str(out), "--prompt", "x"]
        _fails(run_cli("export", *argv), error)


def test_steer_vector_checks(tiny_model, tmp_path, run_cli):
    bad = tmp_path / "v.npy"
    np.save(bad, np.ones(7, dtype=np.float32))
    cfg = {"vectors": [{"layer": 1, "path": str(bad)}]}
    _fails(
        run_cli(
            "run", "--model", tiny_model, "--consumer", f"steer:{json.dumps(cfg)}", "--prompt", "x"
        ),
        "v.npy",
        "128",
    )
    cfg = {"vectors": [{"layer": 1, "path": str(tmp_path / "missing.pt")}]}
    _fails(
        run_cli(
            "run", "--model", tiny_model, "--consumer", f"steer:{json.dumps(cfg)}", "--prompt", "x"
        ),
        "missing.pt",
    )


def test_bad_cli_values(run_cli):
    proc = run_cli("run", "--prompts", "/nonexistent/prompts.txt")
    assert proc.returncode != 0 and "/nonexistent/prompts.txt" in proc.stderr
    proc = run_cli("run", "-n", "0", "--prompt", "x")
    assert proc.returncode != 0 and "argument -n: must be >= 1, got 0" in proc.stderr


def test_unsupported_vllm_version_is_refused(monkeypatch):
    monkeypatch.delenv("TLLM_ALLOW_UNSUPPORTED_VLLM", raising=False)
    with pytest.raises(UnsupportedEngineError, match="found 0.20.1"):
        check_version("0.20.1")
    assert check_version("0.33.0") == "0.33.0"


def test_python_api_fails_before_engine_start(tiny_model):
    from tllm_core.app.engine import TllmLLM
    from tllm_core.plugins.registry import ConsumerSpecError

    with pytest.raises(ValueError, match="out of range"):
        TllmLLM(tiny_model, ['stats:{"layers": [-5]}'])
    with pytest.raises(ConsumerSpecError, match="unknown consumer"):
        TllmLLM(tiny_model, ["nope"])


@pytest.fixture
def no_engine(monkeypatch):
    """``TllmLLM`` stops right after its input checks: check_version is its next step."""
    import tllm_core.app.engine as engine

    def passed(*a, **k):
        raise AssertionError("the input checks passed (TllmLLM went on to check vLLM)")

    monkeypatch.setattr(engine, "check_version", passed)
    return engine


@pytest.mark.parametrize(
    "setting, bad",
    [
        ("queue_size", None),
        ("overflow", None),
        ("background_threads", None),
        ("max_consecutive_failures", None),
        ("queue_size", 0),
        ("overflow", "spill"),
        ("callback_deadline_s", 0),
        ("close_deadline_s", float("nan")),
    ],
)
def test_tllmllm_refuses_a_bad_setting_naming_it_before_anything_starts(no_engine, setting, bad):
    """An explicit None is refused where the setting has no None meaning (pydantic's message,
    as the engine and a server would give it), before vLLM or the default model."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        no_engine.TllmLLM(consumers=["stats"], **{setting: bad})
    assert setting in str(e.value) and f"input_value={bad!r}" in str(e.value), str(e.value)


def test_none_means_the_default_only_for_the_deadlines(no_engine):
    """The deadlines document None as "the default" (TllmLLM's signature, --callback-deadline
    not given); the same None for another setting is refused on every path."""
    from pydantic import ValidationError

    from tllm_core.runtime.settings import RuntimeSettings

    checked = no_engine.validate_consumers(["stats"])
    deadlines = dict.fromkeys(no_engine.NONE_IS_DEFAULT)
    assert checked.settings(**deadlines) == RuntimeSettings(consumers=list(checked.specs))
    for name, field in RuntimeSettings.model_fields.items():
        if name == "consumers" or field.default is None or name in no_engine.NONE_IS_DEFAULT:
            continue  # None is the default itself (fault_file, start_error_file), or a deadline's
        with pytest.raises(ValidationError, match=name):
            checked.settings(**{name: None})
        with pytest.raises(ValidationError, match=name):  # a server's --additional-config
            RuntimeSettings.model_validate({name: None})


@pytest.mark.parametrize(
    "argv, says",
    [
        (["run", "--callback-deadline", "0"], "callback_deadline_s must be > 0, got 0.0"),
        (["export", "--callback-deadline", "inf"], "callback_deadline_s must be finite, got 'inf'"),
        (["serve", "--hung-stop", "nan"], "hung_stop_s must be finite, got 'nan'"),
        (["serve", "--callback-deadline", "x"], "callback_deadline_s must be a number, got 'x'"),
        (["serve", "--hung-stop", "-1"], "hung_stop_s must be >= 0, got -1.0"),
    ],  # flags in other units than their setting's (--max-body-mib): test_cli_bounds
)
def test_a_settings_flag_is_checked_by_its_settings_field_at_parsing(argv, says, run_cli):
    """Each flag of a runtime setting is refused by the field's own constraints (the check
    TllmLLM and a server's JSON get) when parsed: the flag, the setting, the value, what is
    allowed, before anything loads (a too large --max-body-mib went on to the default model
    and the dry build, then failed as pydantic's byte count only)."""
    from tllm_core.runtime.settings import RuntimeSettings, ServerSettings

    proc = run_cli(*argv, "--prompt", "x") if argv[0] != "serve" else run_cli(*argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    field = says.split()[0]
    model = ServerSettings if field in ServerSettings.model_fields else RuntimeSettings
    bounds = model.model_fields[field].metadata
    assert f"argument {argv[1]}: {says}" in proc.stderr, proc.stderr[-2000:]
    assert all(
        str(getattr(b, a)) in proc.stderr
        for b in bounds
        for a in ("ge", "gt", "le")
        if hasattr(b, a)
    )


def test_settings_flags_not_given_are_the_settings_defaults():
    """The CLI path of the None rule: --callback-deadline not given is None, the default; every
    other settings flag has the field's default or a value the field accepts."""
    from tllm_core.app.cli import build_parser
    from tllm_core.app.engine import validate_consumers
    from tllm_core.app.serve_command import serve_settings
    from tllm_core.runtime.settings import RuntimeSettings

    args = build_parser().parse_args(["serve", "--max-body-mib", "2048", "--max-result-kib", "1"])
    assert args.callback_deadline is None
    settings = serve_settings(args, validate_consumers([]), "")  # what tllm serve sends
    assert settings.callback_deadline_s == RuntimeSettings().callback_deadline_s == 120
    assert settings.server.max_body_bytes == 2**31 and settings.max_result_bytes == 1024


@pytest.mark.parametrize(
    "config, hint",
    [
        ({"beta": -1}, "0: sampling bit-identical to vanilla"),
        ({"grad_clip": 0}, "None disables clipping"),
        ({"max_groups": 0}, "None: unlimited"),
        ({"warm_start_steps": -1}, "0: off"),
        ({"fit_decay": 1}, "fit_decay: float, >= 0, < 1"),
    ],
)
def test_a_bad_config_value_says_what_the_field_allows_and_means(config, hint):
    """Field constraints replaced ESamp's hand-written errors ("beta must be >= 0 (0 disables
    guidance)"): the error now carries the field's bounds and description, the words that say
    what 0 or None means there (as `tllm consumers` lists them), for every consumer."""
    from tllm_core.plugins.registry import ConsumerSpecError, Registry

    with pytest.raises(ConsumerSpecError) as e:
        Registry().check([ConsumerSpec(name="esamp", config=config)])
    assert hint in str(e.value) and f", got {next(iter(config.values()))}" in str(e.value)
    assert "unknown field" not in str(e.value)


def test_tllmllm_refuses_its_own_settings_in_additional_config(no_engine):
    """TllmLLM writes additional_config["tllm"] itself: one given there was silently replaced."""
    with pytest.raises(ValueError, match=r"additional_config\['tllm'\] is set by TllmLLM"):
        no_engine.TllmLLM(consumers=[], additional_config={"tllm": {"results_wait_s": 5}})
    with pytest.raises(AssertionError, match="input checks passed"):  # vLLM's own keys pass
        no_engine.TllmLLM(consumers=[], additional_config={"other": 1})


@pytest.mark.parametrize(
    "tllm, error, says",
    [
        ({"queue_size": 0}, "ValidationError", "queue_size"),
        ({"consumers": [{"name": "esamp", "config": {"beta": -1}}]}, "ConsumerSpecError", "beta"),
    ],
)
def test_a_bare_vllm_engine_refuses_bad_settings_before_its_device(monkeypatch, tllm, error, says):
    """``vllm serve --additional-config '{"tllm": ...}'`` has no tllm front end before the
    engine: the engine process refuses bad settings or a bad consumer config before vLLM's own
    init_device (device, model runner, weights), naming the setting; it refused them only once
    the weights had loaded. A fake worker: vLLM's init_device is never reached."""
    from types import SimpleNamespace

    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from tllm_core.vllm_bridge import plugin

    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "0")  # before_device's own setting, restored
    plugin._wrap_init_device()
    worker = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={"tllm": tllm}))
    with pytest.raises(Exception) as e:  # noqa: PT011 - the type is checked below
        WorkerWrapperBase.init_device(worker)
    assert type(e.value).__name__ == error and says in str(e.value), repr(e.value)


@pytest.mark.parametrize("bad", ["esamp", {"name": "esamp"}, None, 5])
def test_tllmllm_refuses_consumers_that_are_not_a_list(no_engine, bad):
    """A bare "esamp" was read as the consumers 'e', 's', ... ("unknown consumer 'e'"), a spec
    dict as its keys, None as a TypeError: each is refused naming what consumers must be."""
    from tllm_core.plugins.registry import ConsumerSpecError

    with pytest.raises(
        ConsumerSpecError, match=r"consumers must be a list .*, got " + re.escape(repr(bad))
    ):
        no_engine.TllmLLM(consumers=bad)


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "export", "config": {"out": " "}},
        {"name": "sae", "config": {"path": "/nowhere/sae", "out": ""}},
        {"name": "sae", "config": {"path": " "}},
    ],
)
def test_an_empty_folder_is_refused_by_the_config_of_export_and_sae_alike(spec):
    """One check of a folder (consumers.export.format.Folder) where the config is given: sae's
    empty out passed its config and was refused only when the consumer was built, as
    "export: 'out' must be ...", by a second copy of export's check in the writer."""
    from tllm_core.plugins.registry import ConsumerSpecError, Registry

    with pytest.raises(ConsumerSpecError) as e:
        Registry().check([ConsumerSpec(**spec)])
    says = str(e.value)
    assert f"consumer {spec['name']!r}" in says and "must be a path" in says, says
    assert "export:" not in says and ("out: str | None" in says or "SAELens" in says), says


def test_a_bad_value_of_a_field_given_by_its_alias_is_not_an_unknown_field():
    """A third-party config may name a field by an alias: its bad value gets the field's
    bounds and words, not "unknown field 'max-rows'"."""
    from pydantic import Field

    from tllm_core import Consumer, ConsumerConfig, SampledTokens
    from tllm_core.plugins.registry import ConsumerSpecError, Registry

    class AliasedConfig(ConsumerConfig):
        max_rows: int = Field(1, ge=1, alias="max-rows", description="rows kept")

    class Aliased(Consumer):
        name = "aliased"
        Config = AliasedConfig

        def reads(self):
            return [SampledTokens()]

    registry = Registry()
    registry.use(Aliased)
    with pytest.raises(ConsumerSpecError) as e:
        registry.check([ConsumerSpec(name="aliased", config={"max-rows": 0})])
    assert "max_rows: int, >= 1; rows kept" in str(e.value), str(e.value)
    assert "unknown field" not in str(e.value)
    with pytest.raises(ConsumerSpecError, match="unknown field.*'rows'.*takes: max_rows"):
        registry.check([ConsumerSpec(name="aliased", config={"rows": 2})])


def test_a_multi_node_bare_vllm_engine_compares_its_settings_before_it_refuses_them(
    monkeypatch,
):
    """Nodes of a bare ``vllm serve`` each read their own settings: one node refusing its own
    before the nodes compared them would leave the others waiting in vLLM's distributed start;
    compared first, every node stops (differ) or every node refuses the same bad value."""
    from types import SimpleNamespace

    from pydantic import ValidationError
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from tllm_core.vllm_bridge import nodes, plugin

    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "0")  # before_device's own setting, restored
    calls = []
    monkeypatch.setattr(WorkerWrapperBase, "init_device", lambda self: calls.append("device"))
    monkeypatch.setattr(nodes, "check_same_settings", lambda *a: calls.append("compared"))
    plugin._wrap_init_device()  # wraps the stand-in above; monkeypatch restores vLLM's
    config = SimpleNamespace(
        additional_config={"tllm": {"queue_size": 0}}, parallel_config=SimpleNamespace(nnodes=2)
    )
    with pytest.raises(ValidationError, match="queue_size"):
        WorkerWrapperBase.init_device(SimpleNamespace(vllm_config=config))
    assert calls == ["device", "compared"]


def test_a_consumer_config_that_json_cannot_carry_is_refused_naming_the_consumer():
    """A NumPy number in a config passed validation and then failed inside vLLM's LLM()
    (the settings travel as JSON), naming no consumer."""
    import numpy as np

    from tllm_core.api.consumer_spec import ConsumerSpec, ConsumerSpecError

    with pytest.raises(ConsumerSpecError, match="consumer 'steer': its config must be plain JSON"):
        ConsumerSpec.coerce({"name": "steer", "config": {"scale": np.float32(2)}})
    with pytest.raises(ConsumerSpecError, match="consumer 'stats'.*float32"):
        ConsumerSpec.coerce(ConsumerSpec(name="stats", config={"x": np.float32(1)}))
