"""Bad consumer settings fail before vLLM is imported (a second, not the ten of importing it).

Each case runs the ``tllm`` command (its console script's ``main``) or ``TllmLLM`` in a fresh
Python process that notes where vLLM (or torch) is first imported, without blocking it: a
check moved back behind the import fails here with the line that imported it. No times are
asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Notes the first import of each watched package (the stack lines of this tree), then runs
# the command as the console script does (sys.argv) and prints what it saw as the last line.
DRIVER = """
import json, sys, traceback
WATCH = ("vllm", "torch")
first = {}

class Watch:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in WATCH and top not in first:
            first[top] = [
                f"{f.filename}:{f.lineno} {f.line}"
                for f in traceback.extract_stack()
                if "/tllm_core/" in f.filename or "/consumers/" in f.filename
                or "/producers/" in f.filename or "/algorithms/" in f.filename
            ]
        return None

sys.meta_path.insert(0, Watch())
what, argv = sys.argv[1], sys.argv[2:]
status, error = None, None
try:
    if what == "cli":
        from tllm_core.app.cli import main

        sys.argv = ["tllm", *argv]
        status = main()
    else:
        from tllm_core import TllmLLM

        TllmLLM(consumers=argv)
except SystemExit as e:
    status = e.code
except Exception as e:
    error = f"{type(e).__name__}: {e}"
sys.stderr.flush()
print("\\n" + json.dumps({"status": status, "error": error, "first": first}))
"""


def _run(what: str, *argv: str) -> tuple[dict, str]:
    """(what the driver saw, stderr) of one run; built-in plugins only."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TLLM_PLUGINS": ""}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, what, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def assert_no_vllm(seen: dict) -> None:
    where = seen["first"].get("vllm")
    assert where is None, f"vLLM was imported before the error, at {where}"


BAD_BETA = 'esamp:{"beta": "x"}'
# The consumer, the field, the bad value and what is allowed (pydantic's words).
BAD_BETA_SAYS = (
    "invalid config for consumer 'esamp'",
    "beta",
    "got 'x'",
    "Input should be a valid number",
)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--consumer", BAD_BETA, "--prompt", "hi"],
        ["run", "--consumer", "nope", "--prompt", "hi"],
        ["export", "--layers", "0", "--out", "{tmp}/out", "--consumer", BAD_BETA],
        ["serve", "--consumer", BAD_BETA],
    ],
    ids=["run-bad-config", "run-unknown-consumer", "export", "serve"],
)
def test_a_bad_consumer_exits_2_before_vllm_is_imported(argv, tmp_path):
    seen, err = _run("cli", *(a.replace("{tmp}", str(tmp_path)) for a in argv))
    assert seen["status"] == 2, (seen, err[-2000:])
    if "nope" in argv:
        assert "unknown consumer 'nope'" in err and "esamp" in err, err
    else:
        assert all(s in err for s in BAD_BETA_SAYS), err
    assert "starting vLLM" not in err and "Traceback" not in err, err
    assert_no_vllm(seen)


def test_an_out_of_range_layer_exits_2_before_vllm_is_imported(tiny_model):
    """The dry build reads the model's config.json only: a model-dependent check that also
    runs before vLLM."""
    seen, err = _run("cli", "run", "--model", tiny_model, "--consumer", 'stats:{"layers": [40]}')
    assert seen["status"] == 2, (seen, err[-2000:])
    assert "consumer 'stats': config field 'layers' = 40 is out of" in err, err
    assert_no_vllm(seen)


def test_tllmllm_refuses_a_bad_config_before_vllm_is_imported():
    seen, _ = _run("python", BAD_BETA)
    assert seen["error"] and seen["error"].startswith("ConsumerSpecError"), seen
    assert all(s in seen["error"] for s in BAD_BETA_SAYS), seen
    assert_no_vllm(seen)


@pytest.mark.parametrize(
    "spec",
    [
        'export:{"out": null, "phase": "x"}',
        'stats:{"phase": "x"}',
        'sae:{"path": "p", "phase": "x"}',
    ],
)
def test_a_bad_phase_names_the_consumer_and_the_setting(spec):
    from tllm_core.app.engine import validate_consumers

    name = spec.partition(":")[0]
    with pytest.raises(ValueError, match=rf"{name}: phase: expected a Phase \('prefill'"):
        validate_consumers([spec])


def test_a_bad_phase_says_the_same_from_tllmllm_run_and_serve():
    spec, says = '{"out": null, "phase": "x"}', "export: phase: expected a Phase ('prefill'"
    seen, _ = _run("python", "export:" + spec)
    assert seen["error"] and says in seen["error"], seen
    for argv in (
        ["run", "--consumer", "export:" + spec, "--prompt", "hi"],
        ["serve", "--consumer", "export:" + spec],
    ):
        seen, err = _run("cli", *argv)
        assert seen["status"] == 2 and says in err, (argv, seen, err[-2000:])
        assert_no_vllm(seen)


def test_help_imports_neither_vllm_nor_torch():
    """``tllm --help`` loads every plugin (their commands) and imports no torch: the built-in
    packages import their names on first use."""
    seen, _ = _run("cli", "--help")
    assert seen["status"] == 0, seen
    assert seen["first"] == {}, f"imported for --help: {seen['first']}"


@pytest.mark.parametrize(
    "argv, says",
    [
        (["run", "--kv-cache-gib", "0"], "--kv-cache-gib: must be >= 1, got 0"),
        (["run", "--max-model-len", "0"], "--max-model-len: must be >= 1, got 0"),
        (["run", "--tensor-parallel-size", "0"], "--tensor-parallel-size: must be >= 1, got 0"),
        (["serve", "--kv-cache-gib", "0"], "--kv-cache-gib: must be >= 1, got 0"),
        (["serve", "--data-parallel-size", "0"], "--data-parallel-size: must be >= 1, got 0"),
    ],
)
def test_engine_sizes_below_one_are_refused_by_the_parser(argv, says):
    """vLLM refused these only after importing (``--max-model-len 0``: 14 s) or starting the
    engine (``--kv-cache-gib 0``: 50 s, "No available memory for the cache blocks")."""
    seen, err = _run("cli", *argv)
    assert seen["status"] == 2 and says in err, (seen, err[-2000:])
    assert_no_vllm(seen)


def test_a_bad_sampling_option_is_vllms_message_with_exit_2(tiny_model):
    """vLLM's own rule (its ``VLLMValidationError`` is no ``ValueError``): one line naming
    the option and what is allowed, no traceback."""
    seen, err = _run("cli", "run", "--model", tiny_model, "--top-p", "2", "--prompt", "hi")
    assert seen["status"] == 2, (seen, err[-2000:])
    assert "tllm: bad sampling option: top_p must be in (0, 1], got 2.0" in err, err
    assert "Traceback" not in err and "starting vLLM" not in err, err


def test_the_first_run_converts_only_after_the_config_check(tiny_model, monkeypatch):
    """Without --model and no converted model yet: a bad config fails before the conversion
    child starts; a config that is bad for the model only (a layer) fails in the dry build
    after the conversion, before the engine."""
    import argparse
    import types

    from tllm_core.app import cli_common, default_model, engine

    events: list[str] = []

    def convert():
        events.append("convert")
        return types.SimpleNamespace(wait=lambda timeout: events.append("wait"))

    def no_engine(*a, **k):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(default_model, "convert_in_background", convert)
    monkeypatch.setattr(default_model, "default_model_path", lambda **_: Path(tiny_model))
    monkeypatch.setattr(engine, "TllmLLM", no_engine)
    monkeypatch.setattr(cli_common, "prepare_engine_processes", lambda args: None)
    monkeypatch.setattr(
        cli_common, "sampling", lambda args: types.SimpleNamespace(n=1, max_tokens=4)
    )
    args = dict(prompt=["hi"], prompts=None, n=1, max_tokens=4, model=None, chat=None)
    with pytest.raises(ValueError, match="invalid config for consumer 'esamp'"):
        cli_common.generate_with(argparse.Namespace(**args), [BAD_BETA])
    assert events == []
    with pytest.raises(ValueError, match=r"consumer 'stats': config field 'layers' = 40"):
        cli_common.generate_with(argparse.Namespace(**args), ['stats:{"layers": [40]}'])
    assert events == ["convert", "wait"]


def test_an_unready_default_model_is_one_line_not_a_traceback(monkeypatch, capsys):
    from tllm_core.app import cli, default_model

    def unready(**_):
        raise default_model.DefaultModelUnavailable("converting took too long")

    monkeypatch.setattr(default_model, "convert_in_background", lambda: None)
    monkeypatch.setattr(default_model, "default_model_path", unready)
    assert cli.main(["run", "--max-tokens", "4"]) == 1
    assert capsys.readouterr().err.strip().endswith("tllm: converting took too long")
