"""Serving: real OpenAI servers on loopback, called with the ``openai`` client.

Two servers start side by side (module fixture, bounded wait, stopped at the end):

- ``on``: the command of docs/serving.md (block ``serve.sh``: esamp and steer, both
  per-request), on the tiny model, plus the third-party per-request consumer ``tally`` of
  tests/plugin_pkg (its own request key ``tllm_tally_weight``);
- ``off``: the same server without ``--additional-config``.

Every server process records which tllm modules it imports (a ``sitecustomize`` with a
recording meta-path finder), so the switch-off test can show that no request-path module of tllm was
ever loaded there.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "serving.md"
START_TIMEOUT = 300
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]
# Modules that implement tllm's request path; none may be imported when the switch is off.
REQUEST_PATH_MODULES = (
    "tllm_core.vllm_bridge.hooks",
    "tllm_core.runtime.runtime",
    "tllm_core.vllm_bridge.serving",
    "tllm_core.serving",
    "tllm_core.vllm_bridge.sites",
    "algorithms.esamp",
    "consumers.steer",
)

AUDIT = """
import os, sys
_log = os.environ.get("TLLM_TEST_IMPORT_LOG")
if _log:
    class _RecordTllmImports:  # sees every import, importlib.import_module included
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] in ("tllm_core", "algorithms", "consumers"):
                with open(f"{_log}.{os.getpid()}", "a") as f:
                    f.write(name + "\\n")
            return None
    sys.meta_path.insert(0, _RecordTllmImports)
"""


_FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
_TITLE = re.compile(r'title="([^"]+)"')


def doc_blocks() -> dict[str, str]:
    """Fenced blocks of docs/serving.md that carry ``title="..."``, by title."""
    out = {}
    for m in _FENCE.finditer(DOC.read_text()):
        t = _TITLE.search(m.group("info"))
        if t:
            out[t.group(1)] = m.group("body")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, argv: list[str], workdir: Path, port: int):
        self.name, self.port, self.workdir = name, port, workdir
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = workdir / "server.log"
        self.import_log = workdir / "imports"
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's default layout
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            HF_HUB_OFFLINE="1",
            VLLM_LOGGING_LEVEL="INFO",
            TLLM_TEST_IMPORT_LOG=str(self.import_log),
        )
        site = workdir / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(AUDIT)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(site), str(ROOT), env.get("PYTHONPATH")) if p
        )
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1)
        raise TimeoutError(f"server {self.name} not up in {START_TIMEOUT}s:\n{self.tail()}")

    def tail(self, n: int = 6000) -> str:
        return self.log_path.read_text()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)

    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=60) as r:
                body = r.read()
                return r.status, json.loads(body) if body else {}
        except urllib.error.HTTPError as e:
            return e.code, {}

    def imported(self) -> set[str]:
        names = set()
        for f in self.workdir.glob("imports.*"):
            names |= set(f.read_text().split())
        return names


def doc_serve_argv(model: str, port: int, more_consumers: tuple[dict, ...] = ()) -> list[str]:
    """The docs' ``vllm serve`` line, run as ``python -m vllm.entrypoints.openai.api_server``
    (vllm-cpu's ``vllm`` command is broken), on the tiny model and a free port, with
    ``more_consumers`` appended to its consumers."""
    line = doc_blocks()["serve.sh"].replace("\\\n", " ").strip()
    argv = shlex.split(line)
    assert argv[:2] == ["vllm", "serve"], argv
    rest = argv[3:]
    rest[rest.index("--port") + 1] = str(port)
    i = rest.index("--additional-config") + 1
    cfg = json.loads(rest[i])
    cfg["tllm"]["consumers"] += list(more_consumers)
    rest[i] = json.dumps(cfg)
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        *rest,
        *ENGINE_ARGS,
    ]


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    import torch
    from safetensors.torch import save_file

    hidden = json.loads((Path(tiny_model) / "config.json").read_text())["hidden_size"]
    on_dir, off_dir = tmp_path_factory.mktemp("server-on"), tmp_path_factory.mktemp("server-off")
    gen = torch.Generator().manual_seed(0)
    save_file({"v": torch.randn(hidden, generator=gen)}, str(on_dir / "steer_vector.safetensors"))
    p_on, p_off = _free_port(), _free_port()
    off_argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        tiny_model,
        "--host",
        "127.0.0.1",
        "--port",
        str(p_off),
        *ENGINE_ARGS,
    ]
    started = []
    try:
        tally = {"name": "tally", "per_request": True}
        started.append(Server("on", doc_serve_argv(tiny_model, p_on, (tally,)), on_dir, p_on))
        started.append(Server("off", off_argv, off_dir, p_off))
        deadline = time.monotonic() + START_TIMEOUT
        for s in started:
            s.wait(deadline)
        yield {"on": started[0], "off": started[1], "model": tiny_model}
    finally:
        for s in started:
            s.stop()


def _complete(server: Server, model: str, xargs: dict | None = None, **kw):
    body = {"vllm_xargs": xargs} if xargs else None
    args = dict(prompt="The quick brown fox", max_tokens=12, temperature=1.0, seed=7)
    args.update(kw)
    return server.client().completions.create(model=model, extra_body=body, **args)


def _chat_stream(
    server: Server, model: str, xargs: dict | None = None, n: int = 2, max_tokens: int = 10
) -> dict[int, str]:
    body = {"vllm_xargs": xargs} if xargs else None
    stream = server.client().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=max_tokens,
        temperature=1.0,
        seed=11,
        n=n,
        stream=True,
        extra_body=body,
    )
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return texts


def _esamp(server: Server) -> dict:
    status, report = server.get("/tllm/counters")
    assert status == 200
    assert report["errors"] == []
    return report["consumers"]["esamp"]


# -- tests ------------------------------------------------------------------------------------
def test_esamp_on_and_off_per_request(servers):
    on, model = servers["on"], servers["model"]
    c0 = _esamp(on)
    plain = _complete(on, model).choices[0].text
    c1 = _esamp(on)
    assert c1["rows_guided"] == c0["rows_guided"] and c1["rows_trained"] == c0["rows_trained"]

    # On with beta 0.5: 12 tokens, the first comes from prefill: 11 guided rows.
    r = _complete(on, model, {"tllm_consumers": "esamp", "tllm_esamp_beta": 0.5})
    assert r.choices[0].finish_reason == "length"
    c2 = _esamp(on)
    assert c2["rows_guided"] - c1["rows_guided"] == 11
    assert c2["rows_trained"] > c1["rows_trained"]

    # Off again for the next request: counters stand still.
    assert _complete(on, model).choices[0].text == plain
    c3 = _esamp(on)
    assert c3["rows_guided"] == c2["rows_guided"] and c3["rows_trained"] == c2["rows_trained"]

    # beta 0 runs the guidance path but must leave sampling as it was; a large beta changes it.
    zero = _complete(on, model, {"tllm_consumers": "esamp", "tllm_esamp_beta": "0"})
    assert zero.choices[0].text == plain
    strong = _complete(on, model, {"tllm_consumers": "esamp", "tllm_esamp_beta": 4})
    assert strong.choices[0].text != plain
    c4 = _esamp(on)
    # beta 0 visits its 11 rows but changes none: only the strong request's rows are guided
    assert c4["rows_guided"] - c3["rows_guided"] == 11
    assert c4["rows_visited"] - c3["rows_visited"] == 22

    # Chat, n=2, streaming: both samples guided (9 decode rows each).
    texts = _chat_stream(on, model, {"tllm_consumers": "esamp", "tllm_esamp_beta": 0.5})
    assert sorted(texts) == [0, 1] and all(texts.values())
    c5 = _esamp(on)
    assert c5["rows_guided"] - c4["rows_guided"] == 18
    # Finished requests are reported on a later engine step; one more request makes one.
    _complete(on, model, max_tokens=2)
    c6 = _esamp(on)
    assert c6["groups_alive"] == 0 and c6["groups_freed"] == c6["groups_created"]


def test_steered_beside_unsteered_in_flight(servers):
    on, off, model = servers["on"], servers["off"], servers["model"]
    prompt = " ".join(["The sea was calm and the sky was grey over the harbour."] * 20)
    kw = dict(prompt=prompt, max_tokens=24)
    steer = {"tllm_consumers": "steer", "tllm_steer_scale": 8}
    # Warm the prefix cache with steered KV first: the unsteered request must not reuse it.
    warm = _complete(on, model, steer, **kw).choices[0].text

    results: dict[str, object] = {}

    def run(key, fn):
        try:
            results[key] = fn()
        except Exception as e:  # noqa: BLE001
            results[key] = e

    jobs = {
        "steered": lambda: _complete(on, model, steer, **kw).choices[0].text,
        "plain": lambda: _complete(on, model, **kw).choices[0].text,
        "chat": lambda: _chat_stream(on, model, max_tokens=16),
        "steered_chat": lambda: _chat_stream(on, model, steer, max_tokens=16),
    }
    threads = [threading.Thread(target=run, args=(k, f)) for k, f in jobs.items()]
    c0 = on.get("/tllm/counters")[1]["runtime"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for k, v in results.items():
        assert not isinstance(v, Exception), f"{k}: {v!r}"
    c1 = on.get("/tllm/counters")[1]["runtime"]
    assert c1["rows_edited"] > c0["rows_edited"]

    ref_plain = _complete(off, model, **kw).choices[0].text
    ref_chat = _chat_stream(off, model, max_tokens=16)
    assert results["plain"] == ref_plain
    assert results["chat"] == ref_chat
    assert results["steered"] == warm  # same settings, same seed: reproducible
    assert results["steered"] != ref_plain
    assert results["steered_chat"] != ref_chat


BAD = [
    ({"tllm_consumers": "nope"}, "unknown consumer 'nope'"),
    ({"tllm_consumers": "esamp", "tllm_esamp_beta": -0.5}, "must be >= 0"),
    ({"tllm_consumers": "esamp", "tllm_esamp_beta": "lots"}, "must be a number"),
    ({"tllm_consumers": "steer", "tllm_steer_scale": "big"}, "must be a number"),
    ({"tllm_steer_scale": 2}, "not active for this request"),
    ({"tllm_colour": "red"}, "unknown tllm key"),
    ({"tllm_consumers": ["esamp"]}, "flat string or number"),
    ({"tllm_steer": 1}, "unknown tllm key"),  # steer's own flag of old: tllm_consumers now
    # A third-party consumer's own key is checked the same way.
    ({"tllm_consumers": "tally", "tllm_tally_weight": -1}, "['tllm_tally_weight'] must be >= 0"),
    (
        {"tllm_consumers": "tally", "tllm_tally_weight": 2.5},
        "'tllm_tally_weight'] must be a whole number, got 2.5",
    ),
]


def test_bad_settings_are_400_and_do_not_disturb_a_running_request(servers):
    import openai

    on, model = servers["on"], servers["model"]
    good: dict[str, object] = {}

    def run_good():
        try:
            good["r"] = _complete(on, model, {"tllm_consumers": "esamp,steer"}, max_tokens=64)
        except Exception as e:  # noqa: BLE001
            good["r"] = e

    t = threading.Thread(target=run_good)
    t.start()
    client = on.client()
    for xargs, msg in BAD:
        for kind in ("completion", "chat"):
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as ei:
                    if kind == "completion":
                        client.completions.create(
                            model=model,
                            prompt="Hi",
                            max_tokens=4,
                            stream=stream,
                            extra_body={"vllm_xargs": xargs},
                        )
                    else:
                        client.chat.completions.create(
                            model=model,
                            messages=[{"role": "user", "content": "Hi"}],
                            max_tokens=4,
                            stream=stream,
                            extra_body={"vllm_xargs": xargs},
                        )
                assert ei.value.status_code == 400
                assert msg in ei.value.message, (xargs, ei.value.message)
    t.join(180)
    r = good["r"]
    assert not isinstance(r, Exception), repr(r)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 64
    assert on.get("/health")[0] == 200
    assert on.get("/tllm/counters")[1]["errors"] == []


def test_plugin_request_key_changes_what_the_consumer_does(servers):
    on, model = servers["on"], servers["model"]

    def tally() -> dict:
        status, report = on.get("/tllm/counters")
        assert status == 200 and report["errors"] == []
        return report["consumers"]["tally"]

    t0 = tally()
    _complete(on, model, max_tokens=6)  # tally not named: it does nothing
    r = _complete(on, model, {"tllm_consumers": "tally"}, max_tokens=6)
    n = r.usage.completion_tokens
    t1 = tally()
    assert n > 0 and t1["tokens"] - t0.get("tokens", 0) == n
    assert t1["weighted_tokens"] - t0.get("weighted_tokens", 0) == n  # config weight 1
    r = _complete(on, model, {"tllm_consumers": "tally", "tllm_tally_weight": 4}, max_tokens=6)
    n = r.usage.completion_tokens
    t2 = tally()
    assert t2["tokens"] - t1["tokens"] == n
    assert t2["weighted_tokens"] - t1["weighted_tokens"] == 4 * n
    # /tllm/status lists every consumer's request keys with their descriptions.
    status, info = on.get("/tllm/status")
    assert status == 200
    (key,) = info["consumers"]["tally"]["request_keys"]
    assert key["key"] == "tllm_tally_weight" and "weight of this request" in key["description"]
    assert info["consumers"]["esamp"]["request_keys"][0]["key"] == "tllm_esamp_beta"
    assert {"tllm_consumers", "tllm_group", "tllm_steer_scale", "tllm_tally_weight"} <= set(
        info["keys"]
    )


def test_switch_off_keeps_tllm_out_of_the_request_path(servers):
    on, off, model = servers["on"], servers["off"], servers["model"]
    # tllm settings mean nothing there: vLLM ignores unknown vllm_xargs, nothing validates them.
    r = _complete(off, model, {"tllm_consumers": "nope", "tllm_esamp_beta": -1})
    assert r.choices[0].finish_reason == "length"
    assert off.get("/tllm/counters")[0] == 404
    assert off.get("/tllm/status")[0] == 404
    assert "tllm: serving" not in off.tail(10**7)
    imported = off.imported()
    assert "tllm_core.vllm_bridge.plugin" in imported, "the tllm plugin was not even loaded"
    leaked = sorted(m for m in imported if m.startswith(REQUEST_PATH_MODULES))
    assert not leaked, f"switch off, yet tllm request-path modules were imported: {leaked}"
    # Contrast: the switched-on server imports them (in its API server and worker).
    assert {"tllm_core.vllm_bridge.hooks", "tllm_core.vllm_bridge.serving"} <= on.imported()
    assert "tllm: serving" in on.tail(10**7)


def test_docs_client_example_runs(servers):
    on = servers["on"]
    code = doc_blocks()["client.py"]
    assert 'BASE_URL = "http://localhost:8000"' in code
    code = code.replace('BASE_URL = "http://localhost:8000"', f"BASE_URL = {on.url!r}")
    ns: dict = {"__name__": "__main__"}
    exec(compile(code, "client.py", "exec"), ns)
    assert len(ns["explored"].choices) == 2 and ns["plain"].choices[0].text
    assert ns["steered"]
    assert "unknown consumer 'nope'" in ns["rejected"]
    assert ns["MODEL"] == servers["model"]
    assert ns["report"]["consumers"]["esamp"]["rows_guided"] > 0


# -- no server --------------------------------------------------------------------------------
def test_key_validation_units():
    from tllm_core.serving import EngineConsumers, request_salt, validate_extra_args

    engine = EngineConsumers.from_settings(
        {
            "consumers": [
                {"name": "esamp", "per_request": True},
                {"name": "stats"},
            ]
        }
    )
    validate_extra_args({"tllm_consumers": "esamp", "tllm_esamp_beta": "0.5", "other": [1]}, engine)
    validate_extra_args({"tllm_consumers": "stats"}, engine)  # always on: naming it is fine
    for bad, msg in [
        ({"tllm_esamp_beta": 1}, "not active"),
        ({"tllm_consumers": "esamp", "tllm_esamp_beta": float("inf")}, "finite"),
        ({"tllm_consumers": "esamp", "tllm_esamp_beta": True}, "number"),
        ({"tllm_consumers": "esamp,x"}, "unknown consumer 'x'"),
        ({"tllm_steer_scale": 1}, "does not run"),
        ({"tllm_steer": 1}, "unknown tllm key"),  # steer's old flag: gone
        ({"tllm_n": 2}, "unknown tllm key"),  # internal tag, not for clients
    ]:
        with pytest.raises(ValueError, match=msg):
            validate_extra_args(bad, engine)
    with pytest.raises(ValueError, match=r"extra_args\['tllm_esamp_beta'\] must be >= 0"):
        validate_extra_args(
            {"tllm_consumers": "esamp", "tllm_esamp_beta": -1}, engine, where="extra_args"
        )
    described = engine.describe()
    assert described["consumers"]["esamp"]["request_keys"][0]["key"] == "tllm_esamp_beta"
    assert "tllm_esamp_beta" in described["keys"] and "tllm_steer_scale" not in described["keys"]
    assert request_salt({"x": 1}) is None
    a = request_salt({"tllm_consumers": "steer", "tllm_steer_scale": 8})
    assert a == request_salt({"tllm_steer_scale": 8, "tllm_consumers": "steer"})
    assert a != request_salt({"tllm_consumers": "steer", "tllm_steer_scale": 4})
