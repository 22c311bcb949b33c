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
package ``tests/plugin_pkg`` installed (``bash install.sh --test``); it sets
``TLLM_TEST_PLUGINS=1`` for it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from bench_setup import (
    code_version,
    command_line,
    free_port,
    model_path,
    section,
    server,
    table,
)
from load import Outcome, Traffic, add_traffic_args, process_rss, run_mix

CRASH_AFTER = 3
GOOD = ["plain", "esamp", "esamp_n2", "steer", "stream_esamp", "stream_plain"]
WEIGHTS = {k: 3 for k in GOOD} | {"cancel": 1, "crash": 1, "bad_beta": 1, "bad_key": 1}
WEIGHTS["bad_consumer"] = 1
BAD = ("bad_beta", "bad_key", "bad_consumer")
ESAMP_COUNTERS = ("rows_guided", "rows_visited", "rows_trained")
ESAMP_COUNTERS += ("groups_created", "groups_freed", "groups_alive")
RUNTIME_COUNTERS = ("engine_steps", "rows_edited", "rows_guided", "consumer_errors")
RUNTIME_COUNTERS += ("consumer_errors.crasher", "requests_finished")
# The server's consumers (the steering vector is written to its working folder).
STEER = {"vectors": [{"layer": 1, "path": "vector.safetensors", "scale": 4.0}]}
CONSUMERS = [
    {"name": "esamp", "per_request": True, "config": {"beta": 0.25}},
    {"name": "steer", "per_request": True, "config": STEER},
    {"name": "crasher", "per_request": True, "config": {"after": CRASH_AFTER}},
]


async def send(t: Traffic, kind: str, rng: random.Random) -> Outcome:
    """One request of the soak mix (streams are chats; ``cancel`` drops one after two chunks)."""
    esamp = {"tllm_consumers": "esamp", "tllm_esamp_beta": rng.choice([0.25, 0.5, 1.0])}
    steer = {"tllm_consumers": "steer", "tllm_steer_scale": rng.choice([2.0, 4.0])}
    if kind in ("stream_esamp", "stream_plain", "cancel"):
        xargs = None if kind == "stream_plain" else esamp
        cancel_after = 2 if kind == "cancel" else 0
        # plain streams without usage, as clients that do not ask for it send them
        return await t.stream(kind, True, xargs, cancel_after, usage=kind != "stream_plain")
    xargs = {"plain": None, "esamp": esamp, "esamp_n2": esamp, "steer": steer}
    xargs |= {"crash": {"tllm_consumers": "crasher"}, "bad_key": {"tllm_no_such_key": 1}}
    xargs |= {"bad_beta": {"tllm_consumers": "esamp", "tllm_esamp_beta": -1}}
    xargs |= {"bad_consumer": {"tllm_consumers": "nobody"}}
    if kind not in xargs:
        raise ValueError(f"unknown request kind {kind!r}")
    return await t.post(kind, False, xargs[kind], n=2 if kind == "esamp_n2" else 1)


def soak(
    model: str,
    requests: int = 300,
    concurrency: int = 8,
    max_tokens: int = 16,
    seed: int = 0,
    enforce_eager: bool = False,
) -> dict[str, Any]:
    """vLLM's OpenAI server with the consumers, the traffic, the checks."""
    import torch
    from safetensors.torch import save_file

    workdir = Path(tempfile.mkdtemp(prefix="tllm-soak-"))
    hidden = json.loads((Path(model) / "config.json").read_text())["hidden_size"]
    g = torch.Generator().manual_seed(0)
    save_file({"v": torch.randn(hidden, generator=g)}, str(workdir / "vector.safetensors"))
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    argv += ["--max-model-len", "512", "--served-model-name", "m"]
    argv += ["--additional-config", json.dumps({"tllm": {"consumers": CONSUMERS}})]
    if enforce_eager:
        argv.append("--enforce-eager")
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:  # urllib.error.URLError is one
            return False

    with server(argv, workdir / "server.log", healthy) as pid:
        run = asyncio.run(traffic(url, pid, requests, concurrency, max_tokens, seed))
    return summarize(*run, requests, concurrency, max_tokens)


async def traffic(
    url: str, pid: int, requests: int, concurrency: int, max_tokens: int, seed: int
) -> tuple[Any, ...]:
    """Warm-up, the seeded mix, every good kind once more after the crasher, the counters;
    the engine's resident bytes (the server's child processes) after warm-up and at the end."""
    import httpx

    kinds = random.Random(seed).choices(list(WEIGHTS), list(WEIGHTS.values()), k=requests)
    limits = httpx.Limits(max_connections=concurrency + 4)
    # bounded: each request has the client's 300 s timeout
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        t = Traffic(client, max_tokens, model="m")
        one = functools.partial(send, t)
        warm = [await one(k, random.Random(i)) for i, k in enumerate(GOOD * 2)]
        rss_warm = process_rss(pid)[1]
        outcomes, wall = await run_mix(one, kinds, concurrency, seed)
        after = [await one(k, random.Random(i)) for i, k in enumerate(GOOD)]  # after the crash
        await t.post("flush", False, None)  # finished requests are reported on a later step
        await asyncio.sleep(1)
        await t.post("flush", False, None)
        rss_end = process_rss(pid)[1]
        report = await t.counters()
    return warm, outcomes, after, report, rss_warm, rss_end, wall


def summarize(
    warm, outcomes, after, report, rss_warm, rss_end, wall, requests, concurrency, max_tokens
):
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
    # Each token of an ESamp request is one guided row (streams report usage); a cancelled
    # stream may run on to max_tokens before the abort reaches the engine.
    esamp_tokens = sum(o.tokens for o in [*warm, *outcomes, *after] if "esamp" in o.kind)
    esamp_tokens += max_tokens * sum(o.kind == "cancel" for o in outcomes)
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
    add_traffic_args(p, requests=300, concurrency=8)
    a = p.parse_args()
    # Its crasher is the test package's, which contributes only when this is set.
    os.environ.setdefault("TLLM_TEST_PLUGINS", "1")
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
