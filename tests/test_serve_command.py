"""``tllm serve`` on loopback: vLLM's OpenAI server with a per-request ESamp (issue 15)."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
from serve_util import get_json

pytestmark = pytest.mark.vllm


def test_serve_argv_and_description_units():
    from tllm_core.app.cli import build_parser
    from tllm_core.app.engine import validate_consumers
    from tllm_core.app.serve_command import describe, server_argv
    from tllm_core.runtime.settings import RuntimeSettings

    args = build_parser().parse_args(
        ["serve", "--consumer", 'esamp:{"beta": 0.5}', "--per-request", "--", "--enforce-eager"]
    )
    checked = validate_consumers(args.consumer)
    argv = server_argv(args, "/m/tiny", RuntimeSettings(consumers=list(checked.specs)))
    i = argv.index("--served-model-name")
    assert argv[i + 1 : i + 3] == ["tiny", "default"]
    assert argv[-1] == "--enforce-eager" and "--" not in argv
    assert "--max-model-len" not in argv  # vLLM derives it from the model (issue 27)
    tllm = json.loads(argv[argv.index("--additional-config") + 1])["tllm"]
    assert tllm["consumers"][0]["name"] == "esamp"
    assert tllm["consumers"][0]["config"] == {"beta": 0.5}
    from tllm_core.serving.keys import EngineConsumers

    engine = EngineConsumers.of(checked.specs, checked.configs, checked.registry)
    lines = "\n".join(describe("http://127.0.0.1:8000", engine))
    assert "http://127.0.0.1:8000/v1" in lines and "tllm_esamp_beta" in lines
    # A bad consumer fails before anything starts, with the validation TllmLLM uses.
    from conftest import run_cli

    bad = run_cli("serve", "--consumer", 'esamp:{"beta": -1}', timeout=120)
    assert bad.returncode == 2 and "beta" in bad.stderr and "starting vLLM" not in bad.stderr


def test_serve_per_request_esamp_on_loopback(tiny_model, guarded_server):
    """On the shared server (conftest's ``guarded_server``: its stop after Ctrl-C, exit 0 and
    no traceback, is checked after its last test)."""
    import openai

    url, key = guarded_server.url, guarded_server.key
    startup = guarded_server.log.read_text()
    assert f"{url}/v1" in startup and "tllm_esamp_beta" in startup
    models = {m["id"] for m in get_json(f"{url}/v1/models", key)["data"]}
    assert {"default", Path(tiny_model).name} <= models

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    before = get_json(f"{url}/tllm/counters", key)["consumers"]["esamp"]
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=12,
        extra_body={"vllm_xargs": {"tllm_consumers": "esamp", "tllm_esamp_beta": 0.5}},
    )
    assert r.choices[0].message.content
    after = get_json(f"{url}/tllm/counters", key)["consumers"]["esamp"]
    assert after["rows_guided"] > before.get("rows_guided", 0)
    assert after["optimizer_steps"] > before.get("optimizer_steps", 0)

    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_body={"vllm_xargs": {"tllm_consumers": "esamp", "tllm_esamp_beta": -1}},
        )
    assert ei.value.status_code == 400 and "tllm_esamp_beta" in ei.value.message


def test_tllm_serve_validates_its_consumer_configs_once_in_its_process(tiny_model, monkeypatch):
    """The command checks ESamp's config before vLLM starts; the API server it runs in the
    same process (its endpoint gate) reuses that check instead of validating again. A
    server started without the command still checks the configs it is given."""

    import vllm.entrypoints.launchers.api_server.entry as entry
    from test_core_unit import _CountingValidator

    import tllm_core.app.serve_command as serve_command
    import tllm_core.vllm_bridge.serving as bridge_serving
    from algorithms.esamp.config import ESampConfig
    from tllm_core.app.cli import build_parser
    from tllm_core.app.engine import validate_consumers
    from tllm_core.vllm_bridge.plugin import EndpointGate
    from tllm_core.vllm_bridge.server_entry import run_openai_server

    gates = []

    def fake_vllm_server():  # what vLLM's build_app does with an endpoint plugin
        import sys

        raw = sys.argv[sys.argv.index("--additional-config") + 1]
        app = types.SimpleNamespace(
            state=types.SimpleNamespace(args=types.SimpleNamespace(additional_config=raw))
        )
        gate = EndpointGate()
        gate.attach_router(app)
        gates.append(gate)

    counting = _CountingValidator(ESampConfig.__pydantic_validator__)
    monkeypatch.setattr(ESampConfig, "__pydantic_validator__", counting)
    monkeypatch.setattr(entry, "main", fake_vllm_server)
    monkeypatch.setattr(bridge_serving, "attach_routes", lambda *a: None)
    monkeypatch.setattr(serve_command.LastCounters, "start", lambda self: None)
    monkeypatch.setattr(serve_command.stop.os, "_exit", lambda code: None)
    monkeypatch.setattr("tllm_core.vllm_bridge.parallel.bind_cpu_threads", lambda ranks: None)
    # Logging and engine-process settings are the command's business, not this test's: left
    # out, so that nothing of this process's environment leaks into later tests' servers.
    monkeypatch.setattr(serve_command.cli_common, "quiet", lambda args: None)
    monkeypatch.setattr(serve_command.cli_common, "prepare_engine_processes", lambda args: None)
    args = build_parser().parse_args(
        ["serve", "--model", tiny_model, "--consumer", 'esamp:{"beta": 0.5}', "--per-request"]
    )
    env_before = dict(os.environ)
    serve_command.cmd_serve(args)
    assert dict(os.environ) == env_before  # nothing leaks into later tests
    assert counting.calls == 1  # the command's check; the gate took it over
    assert gates[0].active and gates[0].engine.configs["esamp"].beta == 0.5
    assert gates[0].engine.per_request == {"esamp": True}

    # `python -m vllm...api_server --additional-config ...` without the command: one check.
    counting.calls = 0
    checked = validate_consumers(args.consumer, tiny_model)
    argv = serve_command.server_argv(args, tiny_model, checked.settings())
    counting.calls = 0
    run_openai_server(argv)
    assert counting.calls == 1 and gates[1].engine.configs["esamp"].beta == 0.5


def test_a_gate_set_up_without_its_routes_refuses_to_start():
    """vLLM calls ``init_state`` on the endpoint plugins it attached (CONTRACT.md): a gate
    whose routes were never attached, in a server switched on for tllm, is an unsupported
    vLLM, refused rather than served without tllm's request checks."""
    import asyncio

    from tllm_core.vllm_bridge.plugin import EndpointGate

    def client(additional_config):
        return types.SimpleNamespace(
            vllm_config=types.SimpleNamespace(additional_config=additional_config)
        )

    gate = EndpointGate()
    asyncio.run(gate.init_state(client({}), types.SimpleNamespace(), None))  # tllm off: inert
    with pytest.raises(RuntimeError, match="without attaching its routes"):
        asyncio.run(gate.init_state(client({"tllm": {}}), types.SimpleNamespace(), None))
