"""A server's state stays flat however many requests it served, a response whose request a
consumer failed on says so, and a request whose client went away is recorded as cut short
(issue 26)."""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from serve_util import get_json, tllm_serve

pytestmark = pytest.mark.vllm


def _complete(url: str, i: int, n: int = 1) -> str | None:
    """A short completion of ``n`` samples; its X-Tllm-Failed header."""
    body = {"model": "default", "prompt": f"Note {i}:", "max_tokens": 2, "n": n}
    body["temperature"] = 0 if n == 1 else 1  # vLLM: n > 1 is not greedy
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        assert r.status == 200, r.read()[:500]
        r.read()
        return r.getheader("X-Tllm-Failed")
    finally:
        conn.close()


def _serve(url: str, first: int, count: int) -> list[str | None]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda i: _complete(url, i), range(first, first + count)))


def _state(url: str) -> dict:
    """What grows with the requests served if it is not pruned."""
    with urllib.request.urlopen(f"{url}/tllm/counters", timeout=60) as r:
        body = r.read()
    counters = json.loads(body)
    return {
        "counters_bytes": len(body),
        "export_open": counters["results"]["export"]["requests_open"],
        "runner_open": get_json(f"{url}/tllm/status")["worker"]["requests_open"],
        "requests": counters["results"]["export"]["requests"],
    }


def _disconnect_while_running(
    url: str,
    prompt: str | list[int] = "Long story:",
    max_tokens=2000,
    xargs=None,
    key=None,
    stream=False,
) -> bool:
    """A long request whose client closes the connection once the engine runs it (vLLM
    then cancels the handler and aborts the request); ``key``: the server's API key. False
    where its answer came first: the request ended before its client could leave."""
    u = urllib.parse.urlsplit(url)
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    body["stream"] = stream
    if xargs:
        body["vllm_xargs"] = xargs
    body = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        + (f"Authorization: Bearer {key}\r\n" if key else "")
        + "\r\n"
    )
    with socket.create_connection((u.hostname, u.port), timeout=120) as sock:
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 60
        answer = b""
        running = False
        while True:
            # A stream's 200 may come before the engine runs it, and its first token proves it
            # runs (the status may not show it yet); a whole answer: it ran to its end first;
            # any other answer before the engine ran it (a refusal) says why.
            if select.select([sock], [], [], 0)[0]:
                answer += sock.recv(4096)
                if answer.startswith(b"HTTP/1.1 200") and not stream:
                    return False
                if not (stream and answer.startswith(b"HTTP/1.1 200")):
                    raise AssertionError(f"answered before it ran: {answer[:600]!r}")
                if b"data: " in answer:
                    return True
            if running:  # looked once more since the status said so: it runs, unanswered
                return True
            running = bool(get_json(f"{url}/tllm/status", key)["worker"]["requests_open"])
            assert running or time.monotonic() < deadline, "the long request never ran"
            if not running:
                time.sleep(0.05)


def _leave_while_running(
    url: str, *args: Any, watch: Callable[[], Callable[[], bool | None]], tries: int = 5, **kw: Any
) -> None:
    """:func:`_disconnect_while_running` until the engine hears the client leave. ``watch()``,
    called before each try, returns that try's check: True once the leaving was heard, False
    once the request ran to its end, None while not known. On a starved machine a client may
    learn that its request runs only after it ended (vLLM's front end, busy with the
    request's queued outputs, sends the status read's answer late), so such a try is made
    again, after a pause that grows (a busy moment of the machine may pass)."""
    ends = []
    for attempt in range(tries):
        time.sleep(attempt)
        heard = watch()
        left = _disconnect_while_running(url, *args, **kw)
        deadline = time.monotonic() + 60
        while (outcome := heard()) is None:
            assert time.monotonic() < deadline, f"neither heard to leave nor ended: {ends}"
            time.sleep(0.2)
        if outcome:
            return
        ends.append("ran to its end" + ("" if left else ", answered before the client left"))
    raise AssertionError(f"the client's leaving was never heard in {tries} tries: {ends}")


@pytest.mark.parametrize(
    "small_n",
    [pytest.param(20, marks=pytest.mark.slow), pytest.param(200, marks=pytest.mark.slow)],
    ids=["20-200", "200-2000"],
)
def test_state_stays_flat_and_disconnects_are_cut_short(tiny_model, tmp_path, small_n):
    from consumers.export import IncompleteExportWarning, read_export

    out = tmp_path / "acts"
    export = {"out": str(out), "layers": ["final"], "shard_rows": 64}
    args = ["--model", tiny_model, "--consumer", "export:" + json.dumps(export)]
    args += ["--consumer", 'stats:{"max_requests": 8}', "--consumer", "esamp"]
    # The test package's consumer that raises on every bundle from its first: switched off
    # after 3 failures in a row, having failed on the requests of those bundles.
    args += ["--consumer", 'crasher:{"after": 1}']
    args += ["--max-model-len", "2048", "--kv-cache-gib", "1", "--", "--enforce-eager"]
    with tllm_serve(args, tmp_path / "serve.err") as url:
        # The workers see a request's samples; its response is marked all the same.
        assert _complete(url, -1, n=2) == "crasher"
        marks = _serve(url, 0, small_n)
        small = _state(url)
        assert "crasher" in marks and set(marks) <= {"crasher", None}, marks
        assert get_json(f"{url}/tllm/status")["failed_consumers"] == ["crasher"]
        assert _serve(url, small_n, 9 * small_n) == [None] * 9 * small_n  # it is off
        large = _state(url)
        print(f"server state after {small_n} and {10 * small_n} requests: {small} {large}")
        assert (small["requests"], large["requests"]) == (small_n + 2, 10 * small_n + 2)
        assert small["export_open"] == large["export_open"] == 0
        assert small["runner_open"] == large["runner_open"] == 0
        # Ten times the requests: the counters grow by digits only (measured: docs/results.md).
        assert large["counters_bytes"] < small["counters_bytes"] * 1.05, (small, large)
        assert _disconnect_while_running(url), "it ran to its end before the client left"
        deadline = time.monotonic() + 60
        while (
            get_json(f"{url}/tllm/counters")["consumers"]["export"].get("requests_cut_short", 0) < 1
        ):
            assert time.monotonic() < deadline, "the aborted request was not cut short"
            time.sleep(0.5)
        assert _state(url)["runner_open"] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(json.dumps(manifest["requests"])) < 1000  # running requests only: none
    with pytest.warns(IncompleteExportWarning, match="requests_unfinished: 1"):
        records = list(read_export(out))
    assert len(records) == 2 + 10 * small_n + 1
    (cut,) = [r for r in records if not r.finished]
    assert 1 <= len(cut.generated_token_ids) < 2000  # stopped early, not at max_tokens
    # No traceback but the crasher's own (its first error and its switch-off are logged).
    tracebacks = (tmp_path / "serve.err").read_text().split("Traceback")[1:]
    others = [t for t in tracebacks if "crasher: deliberate failure" not in t[:3000]]
    assert len(tracebacks) == 2 and not others, others
