"""A long day in the server: mixed traffic against vLLM's OpenAI server with tllm consumers.

    python benchmarks/soak.py [--model PATH] [--requests N] [--concurrency C] [--max-tokens T]
        [--enforce-eager] [--json]

Starts ``python -m vllm.entrypoints.openai.api_server`` with ``esamp``, ``steer`` and the test
package's crashing consumer ``crasher`` (raises from its 3rd bundle), all per request, then
sends a seeded mix of ``--requests`` requests (``--concurrency`` in flight): plain, ESamp
(n = 1, 2) and steered completions, streamed chats, streams cancelled after two chunks,
requests switching the crasher on, and bad ones. Checks: good requests complete, bad ones get
400; the crasher is isolated (3 errors switch it off, later requests complete); ESamp's groups
are all freed; the engine's memory after warm-up and at the end within 5%; guided and edited
rows only for the requests that asked. Exit status 1 when a check fails. Needs the test
package ``tests/plugin_pkg`` installed (``bash install.sh --test``).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import (  # noqa: E402
    add_model_args,
    code_version,
    command_line,
    free_port,
    model_path,
    section,
    server_env,
    start_server,
    stop_server,
    table,
)

CRASH_AFTER = 3


@dataclass
class Outcome:
    kind: str
    status: int  # HTTP status, 0 for a cancelled stream
    tokens: int = 0
    finished: bool = False


@dataclass
class Soak:
    url: str
    model: str
    max_tokens: int

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="EMPTY", max_retries=0, timeout=300)

    # -- one request of each kind ---------------------------------------------------------
    def complete(self, kind: str, xargs: dict | None, n: int = 1) -> Outcome:
        import openai

        try:
            r = self.client().completions.create(
                model=self.model,
                prompt="Write about the sea and its colours:",
                max_tokens=self.max_tokens,
                temperature=1.0,
                n=n,
                extra_body={"vllm_xargs": xargs} if xargs else None,
            )
        except openai.BadRequestError:
            return Outcome(kind, 400)
        ok = all(c.finish_reason in ("length", "stop") for c in r.choices) and len(r.choices) == n
        return Outcome(kind, 200, r.usage.completion_tokens, ok)

    def chat_stream(self, kind: str, xargs: dict | None, cancel_after: int | None = None):
        stream = self.client().chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": "Tell me a short story about a fox."}],
            max_tokens=self.max_tokens,
            temperature=1.0,
            stream=True,
            extra_body={"vllm_xargs": xargs} if xargs else None,
        )
        chunks, finished = 0, False
        for chunk in stream:
            chunks += 1
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                finished = True
            if cancel_after is not None and chunks >= cancel_after:
                stream.close()  # the client goes away mid-stream: vLLM aborts the request
                return Outcome(kind, 0, chunks, False)
        return Outcome(kind, 200, chunks, finished)

    def run_one(self, kind: str, rng: random.Random) -> Outcome:
        esamp = {"tllm_consumers": "esamp", "tllm_esamp_beta": rng.choice([0.25, 0.5, 1.0])}
        steer = {"tllm_consumers": "steer", "tllm_steer_scale": rng.choice([2.0, 4.0])}
        if kind in ("stream_esamp", "stream_plain", "cancel"):
            xargs = None if kind == "stream_plain" else esamp
            return self.chat_stream(kind, xargs, cancel_after=2 if kind == "cancel" else None)
        xargs = {"plain": None, "esamp": esamp, "esamp_n2": esamp, "steer": steer}
        xargs |= {"crash": {"tllm_consumers": "crasher"}, "bad_key": {"tllm_no_such_key": 1}}
        xargs |= {"bad_beta": {"tllm_consumers": "esamp", "tllm_esamp_beta": -1}}
        xargs |= {"bad_consumer": {"tllm_consumers": "nobody"}}
        if kind not in xargs:
            raise ValueError(f"unknown request kind {kind!r}")
        return self.complete(kind, xargs[kind], n=2 if kind == "esamp_n2" else 1)


GOOD = ["plain", "esamp", "esamp_n2", "steer", "stream_esamp", "stream_plain"]
WEIGHTS = {k: 3 for k in GOOD} | {"cancel": 1, "crash": 1, "bad_beta": 1, "bad_key": 1}
WEIGHTS["bad_consumer"] = 1
BAD = ("bad_beta", "bad_key", "bad_consumer")
ESAMP_COUNTERS = ("rows_guided", "rows_visited", "rows_trained")
ESAMP_COUNTERS += ("groups_created", "groups_freed", "groups_alive")
RUNTIME_COUNTERS = ("engine_steps", "rows_edited", "rows_guided", "consumer_errors")
RUNTIME_COUNTERS += ("consumer_errors.crasher", "requests_finished")


def server_settings(vector_path: str) -> dict[str, Any]:
    return {
        "consumers": [
            {"name": "esamp", "per_request": True, "config": {"beta": 0.25}},
            {
                "name": "steer",
                "per_request": True,
                "config": {"vectors": [{"layer": 1, "path": vector_path, "scale": 4.0}]},
            },
            {"name": "crasher", "per_request": True, "config": {"after": CRASH_AFTER}},
        ]
    }


def start_vllm_server(model: str, workdir: Path, enforce_eager: bool) -> tuple[Any, str]:
    import torch
    from safetensors.torch import save_file

    hidden = json.loads((Path(model) / "config.json").read_text())["hidden_size"]
    g = torch.Generator().manual_seed(0)
    save_file({"v": torch.randn(hidden, generator=g)}, str(workdir / "vector.safetensors"))
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    argv += ["--max-model-len", "512", "--served-model-name", "m"]
    argv += ["--additional-config", json.dumps({"tllm": server_settings("vector.safetensors")})]
    if enforce_eager:
        argv.append("--enforce-eager")
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    return start_server(argv, server_env(), workdir / "server.log", healthy), url


def engine_rss(server_pid: int) -> int:
    """Resident bytes of the server's child processes (the engine core and its worker)."""
    import psutil

    return sum(c.memory_info().rss for c in psutil.Process(server_pid).children(recursive=True))


def soak(
    model: str,
    requests: int = 300,
    concurrency: int = 8,
    max_tokens: int = 16,
    seed: int = 0,
    enforce_eager: bool = False,
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="tllm-soak-"))
    proc, url = start_vllm_server(model, workdir, enforce_eager)
    try:
        s = Soak(url, "m", max_tokens)
        rng = random.Random(seed)
        kinds = [rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0] for _ in range(requests)]
        warm = [s.run_one(k, random.Random(i)) for i, k in enumerate(GOOD * 2)]
        rss_warm = engine_rss(proc.pid)
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(concurrency) as pool:
            futs = [pool.submit(s.run_one, k, random.Random(seed + i)) for i, k in enumerate(kinds)]
            # bounded: each request has the client's 300 s timeout
            outcomes = [f.result() for f in futs]
        wall = time.monotonic() - t0
        after = [s.run_one(k, random.Random(i)) for i, k in enumerate(GOOD)]  # after the crash
        s.complete("flush", None)  # finished requests are reported on a later engine step
        time.sleep(1)
        s.complete("flush", None)
        rss_end = engine_rss(proc.pid)
        with urllib.request.urlopen(f"{url}/tllm/counters", timeout=120) as r:
            report = json.loads(r.read())
    finally:
        stop_server(proc)
    return summarize(warm, outcomes, after, report, rss_warm, rss_end, wall, requests, concurrency)


def summarize(warm, outcomes, after, report, rss_warm, rss_end, wall, requests, concurrency):
    by_kind: dict[str, dict[str, int]] = {}
    for o in outcomes:
        k = by_kind.setdefault(o.kind, {"sent": 0, "ok": 0, "400": 0, "other": 0})
        k["sent"] += 1
        if o.kind in BAD:
            k["400" if o.status == 400 else "other"] += 1
        elif o.kind == "cancel" or o.finished:
            k["ok"] += 1
        else:
            k["other"] += 1
    es = report["consumers"]["esamp"]
    st = report["consumers"]["steer"]
    rt = report["runtime"]
    esamp_tokens = sum(o.tokens for o in [*warm, *outcomes, *after] if "esamp" in o.kind)
    esamp_tokens += sum(o.tokens for o in outcomes if o.kind == "cancel")
    checks = {
        "good_requests_completed": all(v["other"] == 0 for k, v in by_kind.items() if k not in BAD)
        and all(o.finished for o in [*warm, *after]),
        "bad_requests_got_400": all(v["400"] == v["sent"] for k, v in by_kind.items() if k in BAD),
        # it raises on every bundle from its 3rd: 3 failures in a row switch it off
        "crasher_isolated": rt.get("consumer_errors.crasher") == 3
        and rt.get("consumer_errors") == 3
        and rt.get("consumers_disabled") == 1
        and all(o.finished for o in after),
        "groups_back_to_zero": es.get("groups_alive") == 0
        and es.get("groups_freed") == es.get("groups_created"),
        "esamp_guided_only_esamp_rows": 0 < es.get("rows_guided", 0) <= esamp_tokens,
        "steer_edited": st.get("rows_selected", 0) > 0 and rt.get("rows_edited", 0) > 0,
        "memory_within_5_percent": abs(rss_end - rss_warm) <= 0.05 * rss_warm,
    }
    return {
        "requests": requests,
        "concurrency": concurrency,
        "wall_s": round(wall, 1),
        "requests_per_s": round(requests / wall, 2),
        "by_kind": by_kind,
        "engine_rss_mib_after_warmup": round(rss_warm / 2**20, 1),
        "engine_rss_mib_end": round(rss_end / 2**20, 1),
        "engine_rss_change_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2),
        "counters": {
            "esamp": {k: es.get(k) for k in ESAMP_COUNTERS},
            "steer": {"rows_selected": st.get("rows_selected")},
            "runtime": {k: rt.get(k) for k in RUNTIME_COUNTERS},
            "esamp_request_tokens": esamp_tokens,
        },
        "errors": report["errors"],
        "checks": checks,
        "passed": all(checks.values()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    out = soak(
        model_path(a.model), a.requests, a.concurrency, a.max_tokens, a.seed, a.enforce_eager
    )
    out["command"] = command_line("soak.py")
    out["code"] = code_version()
    print(json.dumps(out) if a.json else render(out))
    return 0 if out["passed"] else 1


def render(sk: dict[str, Any]) -> str:
    """The docs/results.md section of a ``--json`` result: the checks, then the figures."""
    c = sk["counters"]
    figures = [
        ["requests, in flight", f"{sk['requests']}, {sk['concurrency']}"],
        ["requests/s", sk["requests_per_s"]],
        [
            "engine RSS after warm-up → end (MiB)",
            f"{sk['engine_rss_mib_after_warmup']} → {sk['engine_rss_mib_end']} "
            f"({sk['engine_rss_change_pct']:+.2f}%)",
        ],
        [
            "ESamp groups created / freed / alive",
            f"{c['esamp']['groups_created']} / {c['esamp']['groups_freed']} / "
            f"{c['esamp']['groups_alive']}",
        ],
        ["consumer errors (the crashing test consumer)", c["runtime"]["consumer_errors"]],
        *([k.replace("_", " "), "yes" if v else "**no**"] for k, v in sk["checks"].items()),
    ]
    return section("A long day in the server (soak)", sk, table(["figure", "value"], figures))


if __name__ == "__main__":
    sys.exit(main())
