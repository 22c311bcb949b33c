"""``tllm serve`` behind an API key, as a stranger meets it (issue 26): ``/tllm/*`` asks the
key ``/v1`` asks, bodies past the limit get 413, float32 overflows get 400, counters stay JSON."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from conftest import SERVE_KEY

pytestmark = pytest.mark.vllm

KEY = SERVE_KEY


def _call(url: str, key: str | None = None, body: bytes | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_server_settings_reach_the_additional_config():
    from tllm_core.app.cli import build_parser
    from tllm_core.app.engine import validate_consumers
    from tllm_core.app.serve_command import server_argv
    from tllm_core.runtime.settings import MIB, RuntimeSettings, ServerSettings

    args = build_parser().parse_args(["serve", "--max-body-mib", "2", "--show-paths"])
    settings = RuntimeSettings(
        consumers=list(validate_consumers([]).specs),
        server=ServerSettings(max_body_bytes=args.max_body_mib * MIB, show_paths=args.show_paths),
    )
    argv = server_argv(args, "/m/tiny", settings)
    tllm = json.loads(argv[argv.index("--additional-config") + 1])["tllm"]
    assert tllm["server"]["max_body_bytes"] == 2 * MIB and tllm["server"]["show_paths"]


def test_guarded_server(tiny_model, guarded_server):
    """On the shared server (conftest's ``guarded_server``, behind ``KEY``, 1 MiB bodies: its
    stop after Ctrl-C, exit 0 and no traceback, is checked after its last test)."""
    url = guarded_server.url
    assert _call(f"{url}/v1/models")[0] == 401  # vLLM's own check
    for path in ("/tllm/counters", "/tllm/status"):
        assert _call(f"{url}{path}")[0] == 401
        assert _call(f"{url}{path}", "wrong")[0] == 401
        status, body = _call(f"{url}{path}", KEY)
        assert status == 200 and tiny_model not in body.decode(), body[:2000]

    def complete(xargs: dict, pad: int = 0) -> tuple[int, bytes]:
        payload = {
            "model": "default",
            "prompt": "The sea" + " " * pad,
            "max_tokens": 4,
            "vllm_xargs": xargs,
        }
        return _call(f"{url}/v1/completions", KEY, json.dumps(payload).encode())

    status, body = complete({"tllm_consumers": "esamp", "tllm_esamp_beta": 1e39})
    assert status == 400 and b"float32" in body, body
    status, body = complete({"tllm_consumers": "esamp"}, pad=2 * 1024 * 1024)
    assert status == 413 and b"1048576 bytes" in body, body

    def guided() -> int:  # the server is shared: this test's requests are the change
        status, body = _call(f"{url}/tllm/counters", KEY)
        assert status == 200, body
        return json.loads(body)["consumers"].get("esamp", {}).get("rows_guided", 0)

    before = guided()
    status, body = complete({"tllm_consumers": "esamp", "tllm_esamp_beta": 0.5})
    assert status == 200, body
    assert guided() > before
