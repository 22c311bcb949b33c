"""A hung consumer callback in ``tllm serve`` (issue 46, item 2): ``/health`` fails while the
callback is past its deadline, ``/tllm/status`` names the consumer, and the server stops by
itself after the second deadline (``--hung-stop``) with an error naming it."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from node_util import exit_within, start, wait_for
from serve_util import ROOT, free_port

DEADLINE_S = 3
HUNG_STOP_S = 10


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _complete(url: str) -> None:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 32}).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    try:
        urllib.request.urlopen(req, timeout=120).read()
    except OSError:
        pass  # the server stops under it


@pytest.mark.vllm
@pytest.mark.slow  # a server start; the offline case (test_hang_faults.py) is the default one
def test_a_hung_callback_fails_health_names_it_and_stops_the_server(tiny_model, tmp_path):
    log = tmp_path / "serve.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spec = 'hang:{"callback": "on_bundle", "after": 3}'
    argv = ["serve", "--port", str(port), "--model", tiny_model, "--consumer", spec]
    argv += ["--callback-deadline", str(DEADLINE_S), "--hung-stop", str(HUNG_STOP_S)]
    argv += ["--max-model-len", "512", "--kv-cache-gib", "1", "--", "--enforce-eager"]
    proc = start(argv, log, PYTHONPATH=str(ROOT / "tests" / "plugin_pkg"))
    try:
        wait_for(log, "tllm: ready", proc, 300)
        assert _get(f"{url}/health")[0] == 200
        threading.Thread(target=_complete, args=(url,), daemon=True).start()
        deadline = time.monotonic() + DEADLINE_S + HUNG_STOP_S
        while (code := _get(f"{url}/health"))[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert code[0] == 503 and "consumer 'hang' is stuck in on_bundle" in code[1]["error"]
        status, body = _get(f"{url}/tllm/status")
        assert status == 503 and body["hung"]["consumer"] == "hang", body
        exit_code = exit_within(proc, HUNG_STOP_S + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert exit_code == 1, text[-4000:]
    assert "tllm: error: the server stopped itself: consumer 'hang' is stuck in on_bundle" in text
