"""A real ``tllm serve`` fed random request bodies (issue 26): random ``vllm_xargs`` of every
JSON type and size, tllm keys or not, on ``/v1/completions`` and ``/v1/chat/completions``,
streamed or not. Every answer is 200 or 4xx (never 5xx, on a stream: no error event with a
5xx code), the engine still serves a good request, and ``/tllm/counters`` stays strict JSON.

``TLLM_FUZZ_EXAMPLES`` sets the default test's number of bodies; the slow test sends 2000.
``TLLM_FUZZ_RESULTS=path.json`` writes what a run sent and got (docs/results.md renders
``benchmarks/results/fuzz.json``).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from conftest import SERVE_KEY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.vllm

MIB = 1 << 20
LIMIT_MIB = 1
# Bodies stay under the server's drain budget (4 x the limit): past it the server may answer
# 413 before reading the body, and the client sees a reset instead (serving.XargsCheck.refuse).
MAX_BODY = 3 * MIB
TLLM_KEYS = ["tllm_consumers", "tllm_steer_scale", "tllm_esamp_beta", "tllm_group"]
TLLM_KEYS += ["tllm_sae_steer", "tllm_no_such_key", "tllm_", "tllm_results", "tllm_steer_vectors"]
TLLM_KEYS += ["tllm_export_window", "tllm_stats_window"]
# Values the validators treat specially, beside what hypothesis draws.
SPECIAL = ["esamp", "steer", "stats", "esamp,steer,stats", "esamp,,", "sae", "nobody", "NaN"]
SPECIAL += ["Infinity", "-inf", "1e39", "0.25", '[{"feature": 1, "scale": 2.0}]', "g" * 1025]
SPECIAL += ['[{"feature": 1, "scale": Infinity}]', 1e39, -1.0, 0.5, 3.4028235e38, 2**63]


def raw(value: object) -> str:
    """JSON text; non-finite floats as the bare literals NaN, Infinity that Python's parser
    (and so vLLM's) accepts."""
    return json.dumps(value, allow_nan=True)


def obj(items: list[tuple[str, str]]) -> str:
    """A JSON object from keys and value texts (duplicate keys kept, as a client may send)."""
    return "{" + ",".join(f"{raw(k)}:{v}" for k, v in items) + "}"


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(),  # NaN and +-Infinity included
    st.text(max_size=40),
    st.sampled_from(SPECIAL),
).map(raw)
composite = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5).map(lambda xs: "[" + ",".join(xs) + "]"),
        st.lists(st.tuples(st.text(max_size=10), inner), max_size=5).map(obj),
    ),
    max_leaves=12,
)
# Sizes of every magnitude (hypothesis alone favours small ones); some past the 1 MiB limit.
size = st.one_of(st.integers(1, 3 * MIB // 2), st.sampled_from([10**4, 10**5, 10**6, MIB + 1]))
huge = st.one_of(
    size.map(lambda n: raw("x" * n)),
    size.map(lambda n: "[" + ",".join(["7"] * (n // 2)) + "]"),
    size.map(lambda n: "[" * (n // 2) + "]" * (n // 2)),  # deeper than parsers recurse
    size.map(lambda n: '{"a":' * (n // 6) + "0" + "}" * (n // 6)),
    st.integers(20, 5000).map(lambda n: "9" * n),  # integers past any machine type
)
keys = st.one_of(st.sampled_from(TLLM_KEYS), st.text(max_size=12))
# Valid settings, so that some requests reach the consumers beside the random keys.
valid = st.sampled_from(
    [
        ("tllm_consumers", '"esamp,steer,stats"'),
        ("tllm_consumers", '"esamp"'),
        ("tllm_esamp_beta", "0.5"),
        ("tllm_steer_scale", "-2"),
        ("tllm_steer_scale", "3.4e38"),  # times the vector: past the model's dtype
        ("tllm_group", '"g1"'),
        ("tllm_consumers", '"stats,export"'),
        ("tllm_results", '"stats,export"'),
        ("tllm_results", '"export"'),
        ("tllm_export_window", '"generated[0:2]"'),
    ]
)
pair = st.one_of(valid, st.tuples(keys, st.one_of(composite, composite, composite, huge)))


@st.composite
def xargs(draw) -> str:
    """Mostly an object of tllm and other keys; else any JSON value (vLLM wants an object)."""
    kind = draw(st.sampled_from(["object"] * 6 + ["composite", "huge"]))
    if kind == "object":
        return obj(draw(st.lists(pair, min_size=1, max_size=6)))
    return draw(composite if kind == "composite" else huge)


@st.composite
def bodies(draw) -> tuple[str, str, bool]:
    """(path, JSON body text, streamed)."""
    chat = draw(st.booleans())
    stream = draw(st.booleans())
    head = {"model": "default", "max_tokens": draw(st.integers(1, 4)), "stream": stream}
    head["n"] = draw(st.integers(1, 2))
    if chat:
        head["messages"] = [{"role": "user", "content": "Tell me about the sea."}]
    else:
        head["prompt"] = "The sea"
    text = raw(head)[:-1] + ', "vllm_xargs": ' + draw(xargs()) + "}"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, text[:MAX_BODY], stream  # a cut body is still past the limit: 413


def post(url: str, body: bytes | None) -> tuple[int, bytes]:
    """(status, body) of a POST, or of a GET when ``body`` is None."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {SERVE_KEY}"}
    req = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _no_constants(name: str) -> None:
    raise ValueError(f"not strict JSON: {name}")


def strict_json(data: bytes) -> object:
    return json.loads(data, parse_constant=_no_constants)


def check_answer(status: int, data: bytes, stream: bool) -> None:
    assert status == 200 or 400 <= status < 500, (status, data[:2000])
    if status != 200:
        return
    if not stream:
        assert strict_json(data)["choices"], data[:2000]
        return
    events = [ln[6:] for ln in data.decode().splitlines() if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", data[-2000:]
    for event in events[:-1]:
        error = strict_json(event.encode()).get("error")
        assert error is None or error.get("code", 500) < 500, event[:2000]


@pytest.fixture
def server(guarded_server):
    """The shared server (conftest's ``guarded_server``: per-request esamp, steer and stats,
    ``LIMIT_MIB`` bodies; its stop, exit 0 and no traceback, is checked after its last test)."""
    return guarded_server.url


def fuzz(url: str, examples: int) -> None:
    seen: Counter = Counter()
    started = time.monotonic()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(bodies())
    def one(request: tuple[str, str, bool]) -> None:
        path, text, stream = request
        answer = post(f"{url}{path}", text.encode())
        seen[f"{path} {'stream' if stream else 'plain'} {answer[0]}"] += 1
        check_answer(*answer, stream)
        status, data = post(f"{url}/tllm/counters", None)
        assert status == 200, data[:2000]
        strict_json(data)

    one()
    good = {"model": "default", "prompt": "The sea", "max_tokens": 3}
    good["vllm_xargs"] = {"tllm_consumers": "esamp,steer,stats", "tllm_esamp_beta": 0.5}

    def guided() -> int:  # the server is shared: the good request's rows are the change
        counters = strict_json(post(f"{url}/tllm/counters", None)[1])
        return counters["consumers"].get("esamp", {}).get("rows_guided", 0)

    before = guided()
    status, data = post(f"{url}/v1/completions", raw(good).encode())
    assert status == 200, data
    assert strict_json(data)["choices"][0]["finish_reason"] in ("length", "stop"), data
    assert guided() > before
    if os.environ.get("TLLM_FUZZ_RESULTS"):
        record = {
            "command": "TLLM_FUZZ_RESULTS=benchmarks/results/fuzz.json python -m pytest tests/test_serve_fuzz.py"
            + ("" if examples == 50 else " -m slow -k many"),
            "bodies": sum(seen.values()),
            "answers": dict(sorted(seen.items())),
            "seconds": round(time.monotonic() - started, 1),
            "good_request_after": "200",
            "counters_reads_strict_json": sum(seen.values()),
        }
        Path(os.environ["TLLM_FUZZ_RESULTS"]).write_text(json.dumps(record, indent=1) + "\n")


def test_fuzzed_requests_get_200_or_4xx(server):
    fuzz(server, int(os.environ.get("TLLM_FUZZ_EXAMPLES", "50")))


@pytest.mark.slow
def test_fuzzed_requests_get_200_or_4xx_many(server):
    fuzz(server, 2000)
