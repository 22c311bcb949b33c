"""``tllm serve`` under load: concurrency 16 of a mixed workload, with and without a
client polling ``/tllm/counters``.

    python benchmarks/load.py [--model PATH] [--requests N] [--rounds R] [--concurrency C]
        [--max-tokens T] [--poll-interval S] [--enforce-eager] [--json]

Starts ``tllm serve --consumer esamp --consumer stats --per-request --max-body-mib 1`` on
loopback, warms it up, then alternates phases A (a second client reads ``/tllm/counters``
every ``--poll-interval`` s) and B (nobody polls) for ``--rounds`` rounds of ``--requests``
requests, a seeded mix with at most ``--concurrency`` in flight: good ones (completions, plain
or naming ``esamp``; chats naming ``stats``; streamed chats and completions read to ``[DONE]``)
must finish; streams dropped after two chunks; bad ``tllm_*`` keys or values must get 400; a
body past 1 MiB must get 413.

Per phase: good tokens/s, status codes (no 5xx), good requests completed, polls (all strict
JSON) and the counters the phase added; overall: the ratio of A's tokens/s to B's and the
resident memory of the server's process tree along the run. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_setup import (
    add_model_args,
    command_line,
    free_port,
    model_path,
    run_machine,
    section,
    server,
    table,
)

MIB = 1 << 20
LIMIT_MIB = 1
PROMPT = "Write about the sea and its colours:"
CHAT = [{"role": "user", "content": "Tell me a short story about a fox."}]
ESAMP = {"tllm_consumers": "esamp", "tllm_esamp_beta": 0.5}
BAD_XARGS = [
    {"tllm_consumers": "esamp", "tllm_esamp_beta": -1},
    {"tllm_consumers": "esamp", "tllm_esamp_beta": 1e39},
    {"tllm_no_such_key": 1},
    {"tllm_consumers": "nobody"},
    {"tllm_group": ["not", "flat"]},
]
GOOD = ("plain", "esamp", "chat_stats", "stream_esamp", "stream_plain")
WEIGHTS = {k: 3 for k in GOOD} | {"cancel": 2, "bad": 2, "huge": 1}
EXPECTED = {"bad": 400, "huge": 413}
# Counters whose growth per phase is reported (missing ones count 0).
COUNTERS = {
    "runtime": ("engine_steps", "requests_finished", "rows_guided", "bundles_delivered"),
    "esamp": ("rows_guided", "groups_created", "groups_freed"),
    "stats": ("bundles",),
}


@dataclass
class Outcome:
    kind: str
    status: int  # HTTP status (a cancelled stream: 200, the status it had when dropped)
    tokens: int = 0  # completion tokens; a stream without usage or cut short: chunks read
    finished: bool = False


@contextlib.contextmanager
def tllm_serve(model: str, workdir: Path, eager: bool) -> Iterator[tuple[str, int]]:
    """``tllm serve`` (vLLM's multiprocess layout) until it prints ``tllm: ready``; yields its
    URL and process id; stops it (SIGTERM to its process group)."""
    port = free_port()
    argv = [sys.executable, "-m", "tllm_core.app.cli", "serve", "--model", model]
    argv += ["--port", str(port), "--consumer", "esamp", "--consumer", "stats", "--per-request"]
    argv += ["--max-body-mib", str(LIMIT_MIB), "--max-model-len", "512", "--kv-cache-gib", "1"]
    if eager:
        argv += ["--", "--enforce-eager"]
    log = workdir / "serve.log"
    with server(argv, log, lambda: "tllm: ready" in log.read_text()) as pid:
        yield f"http://127.0.0.1:{port}", pid


def process_rss(pid: int) -> tuple[int, int]:
    """Resident bytes of a process and of all its descendants."""
    import psutil

    root = psutil.Process(pid)
    return root.memory_info().rss, sum(p.memory_info().rss for p in root.children(True))


def tree_rss_mib(pid: int) -> dict[str, float]:
    """Resident memory (MiB) of a process and all its descendants (``total``), and of the
    process alone (``front_end``: the API server, which reads every body)."""
    own, children = process_rss(pid)
    return {"total": round((own + children) / MIB, 1), "front_end": round(own / MIB, 1)}


class Traffic:
    """Requests of each shape to an OpenAI-compatible server (``client``: an
    ``httpx.AsyncClient`` on its URL), each read to an :class:`Outcome`."""

    def __init__(self, client: Any, max_tokens: int, model: str = "default"):
        self.client, self.max_tokens, self.model = client, max_tokens, model

    def body(
        self, chat: bool, xargs: dict | None, stream: bool = False, n: int = 1, usage: bool = True
    ) -> dict:
        """``usage``: a stream asks for the token count (else its tokens are chunks read)."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "n": n}
        body |= {"messages": CHAT} if chat else {"prompt": PROMPT}
        body["temperature"] = 1.0  # ESamp guides sampled rows only
        if xargs:
            body["vllm_xargs"] = xargs
        if stream:
            body["stream"] = True
        if stream and usage:
            body["stream_options"] = {"include_usage": True}
        return body

    async def post(self, kind: str, chat: bool, xargs: dict | None, n: int = 1) -> Outcome:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        r = await self.client.post(path, json=self.body(chat, xargs, n=n))
        if r.status_code != 200:
            return Outcome(kind, r.status_code)
        out = r.json()
        done = len(out["choices"]) == n and all(
            c.get("finish_reason") in ("length", "stop") for c in out["choices"]
        )
        return Outcome(kind, 200, out["usage"]["completion_tokens"], done)

    async def stream(
        self, kind: str, chat: bool, xargs: dict | None, cancel_after: int = 0, usage: bool = True
    ) -> Outcome:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        tokens, finished, chunks = 0, False, 0
        async with self.client.stream(
            "POST", path, json=self.body(chat, xargs, True, usage=usage)
        ) as r:
            if r.status_code != 200:
                await r.aread()
                return Outcome(kind, r.status_code)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:  # an error after the stream started
                    return Outcome(kind, event["error"].get("code", 500))
                chunks += 1
                if cancel_after and chunks >= cancel_after:
                    return Outcome(kind, 200, chunks)  # leaving the block drops the connection
                choices = event.get("choices") or []
                finished |= any(c.get("finish_reason") for c in choices)
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return Outcome(kind, 200, tokens or chunks, finished)

    async def huge(self) -> Outcome:
        body = json.dumps(self.body(False, ESAMP)).encode()
        pad = b" " * (LIMIT_MIB * MIB + MIB // 2)  # whitespace: still valid JSON, 1.5 MiB
        headers = {"Content-Type": "application/json"}
        r = await self.client.post("/v1/completions", content=body + pad, headers=headers)
        return Outcome("huge", r.status_code)

    async def counters(self) -> dict[str, Any]:
        r = await self.client.get("/tllm/counters")
        r.raise_for_status()

        def refuse(name: str) -> None:
            raise ValueError(f"not strict JSON: {name}")

        return json.loads(r.content, parse_constant=refuse)

    async def poll(self, interval: float, polls: Counter, stop: asyncio.Event) -> None:
        """Reads the counters every ``interval`` s until ``stop``; ``polls`` counts the reads
        (``count``) and those not 200 or not strict JSON (``failed``)."""
        while not stop.is_set():
            try:
                await self.counters()
                polls["count"] += 1
            except Exception:  # noqa: BLE001 - a failed read is counted, the load goes on
                polls["failed"] += 1
            with contextlib.suppress(TimeoutError):  # bounded: wait_for
                await asyncio.wait_for(stop.wait(), interval)


async def send(t: Traffic, kind: str, rng: random.Random) -> Outcome:
    """One request of the load mix."""
    if kind == "huge":
        return await t.huge()
    if kind in ("stream_esamp", "stream_plain", "cancel"):
        chat, xargs = kind != "stream_plain", None if kind == "stream_plain" else ESAMP
        return await t.stream(kind, chat, xargs, cancel_after=2 if kind == "cancel" else 0)
    xargs = {"plain": None, "esamp": ESAMP, "chat_stats": {"tllm_consumers": "stats"}}
    if kind == "bad":
        return await t.post(kind, False, rng.choice(BAD_XARGS))
    if kind in xargs:
        return await t.post(kind, kind == "chat_stats", xargs[kind])
    raise ValueError(f"unknown request kind {kind!r}; known: {sorted(WEIGHTS)}")


async def run_mix(
    send: Callable[[str, random.Random], Awaitable[Outcome]],
    kinds: list[str],
    concurrency: int,
    seed: int,
    name: str = "",
) -> tuple[list[Outcome], float]:
    """``kinds`` sent with at most ``concurrency`` in flight, request i drawing from
    ``Random(seed + i)``: their outcomes and the wall time; progress on stderr when ``name``."""
    queue = list(enumerate(kinds))
    outcomes: list[Outcome] = []
    t0 = time.monotonic()

    async def worker() -> None:
        while queue:
            i, kind = queue.pop(0)
            outcomes.append(await send(kind, random.Random(seed + i)))
            if name and len(outcomes) % 25 == 0:
                tok_s = _good_tokens(outcomes) / (time.monotonic() - t0)
                msg = f"phase {name}: {len(outcomes)}/{len(kinds)} answered, {tok_s:.1f} good tok/s"
                print(f"load: {msg}", file=sys.stderr, flush=True)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes, time.monotonic() - t0


def picked(report: dict[str, Any]) -> dict[str, float]:
    out = {}
    for part, names in COUNTERS.items():
        src = report["runtime"] if part == "runtime" else report["consumers"].get(part, {})
        out |= {f"{part}.{n}": src.get(n, 0) for n in names}
    return out


async def phase(
    t: Traffic, name: str, kinds: list[str], concurrency: int, poll_s: float | None, seed: int
) -> dict[str, Any]:
    """One round of a phase: its outcomes, wall time, polls and the counters it added."""
    before = picked(await t.counters())
    polls, stop = Counter(), asyncio.Event()
    poller = asyncio.create_task(t.poll(poll_s, polls, stop)) if poll_s else None
    outcomes, wall = await run_mix(functools.partial(send, t), kinds, concurrency, seed, name)
    stop.set()
    if poller is not None:
        await poller
    after = picked(await t.counters())
    added = {k: after[k] - before[k] for k in after}
    return {"outcomes": outcomes, "wall_s": wall, "polls": polls, "counters_added": added}


def _good_tokens(outcomes: list[Outcome]) -> int:
    return sum(o.tokens for o in outcomes if o.kind in GOOD)


def summarize(name: str, poll_s: float | None, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A phase over all its rounds; tokens/s over their total wall time."""
    outcomes = [o for r in rounds for o in r["outcomes"]]
    good = [o for o in outcomes if o.kind in GOOD]
    wall = sum(r["wall_s"] for r in rounds)
    good_tokens = _good_tokens(outcomes)
    added: Counter = Counter()
    for r in rounds:
        added.update(r["counters_added"])
    return {
        "phase": name,
        "polling_s": poll_s,
        "requests": len(outcomes),
        "good_tokens": good_tokens,
        "good_sent": len(good),
        "good_completed": sum(o.status == 200 and o.finished for o in good),
        "cancelled": sum(o.kind == "cancel" for o in outcomes),
        "wall_s": round(wall, 2),
        "good_tok_s": round(good_tokens / wall, 2),
        "good_tok_s_rounds": [round(_good_tokens(r["outcomes"]) / r["wall_s"], 2) for r in rounds],
        "rss_mib_after_rounds": [r["rss_mib_after"] for r in rounds],  # a leak would climb
        "status_codes": dict(sorted(Counter(str(o.status) for o in outcomes).items())),
        "by_kind": dict(sorted(Counter(o.kind for o in outcomes).items())),
        "counters_added": dict(sorted(added.items())),
        "status_5xx": sum(o.status >= 500 for o in outcomes),
        "polls": sum(r["polls"]["count"] for r in rounds),
        "polls_failed": sum(r["polls"]["failed"] for r in rounds),
        "unexpected": [
            o.kind
            for o in outcomes
            if (o.kind in GOOD and not (o.status == 200 and o.finished))
            or (o.kind in EXPECTED and o.status != EXPECTED[o.kind])
            or (o.kind == "cancel" and o.status != 200)
        ],
    }


async def drive(url: str, pid: int, a: argparse.Namespace) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=a.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t = Traffic(client, a.max_tokens)
        rss_start = tree_rss_mib(pid)
        warm = [await send(t, k, random.Random(i)) for i, k in enumerate(GOOD * 2)]
        rss_warm = tree_rss_mib(pid)
        rng = random.Random(a.seed)
        phases: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        for r in range(a.rounds):
            # every kind at least once (given the requests), the rest drawn by weight
            kinds = list(WEIGHTS)[: a.requests]
            kinds += rng.choices(list(WEIGHTS), list(WEIGHTS.values()), k=a.requests - len(kinds))
            rng.shuffle(kinds)
            for name, poll_s in (("A", a.poll_interval), ("B", None)):
                seed = a.seed + 1000 * r
                phases[name].append(await phase(t, name, kinds, a.concurrency, poll_s, seed))
                phases[name][-1]["rss_mib_after"] = tree_rss_mib(pid)["total"]
        final = await t.counters()
        rss_end = tree_rss_mib(pid)
    a_, b_ = summarize("A", a.poll_interval, phases["A"]), summarize("B", None, phases["B"])
    warm_ok = all(o.status == 200 and o.finished for o in warm)
    checks = {
        "no_5xx": a_["status_5xx"] + b_["status_5xx"] == 0,
        "every_good_request_completed": warm_ok
        and a_["good_completed"] == a_["good_sent"]
        and b_["good_completed"] == b_["good_sent"],
        "every_expectation_met": not a_["unexpected"] and not b_["unexpected"],
        "polls_all_strict_json": a_["polls"] > 0 and a_["polls_failed"] == 0,
        "no_consumer_errors": not final.get("errors"),
    }
    return {
        "same_server": True,
        "phase_order": ", ".join(["A", "B"] * a.rounds),
        "tok_s_ratio_polled_to_unpolled": round(a_["good_tok_s"] / b_["good_tok_s"], 3),
        "phases": {"A": a_, "B": b_},
        "rss_mib": {"start": rss_start, "after_warmup": rss_warm, "end": rss_end},
        "counters_end": picked(final)
        | {"esamp.groups_alive": final["consumers"].get("esamp", {}).get("groups_alive", 0)},
        "errors": final.get("errors", []),
        "checks": checks,
        "passed": all(checks.values()),
    }


def add_traffic_args(p: argparse.ArgumentParser, requests: int, concurrency: int) -> None:
    """The model options, ``--requests``, ``--concurrency``, ``--max-tokens`` and ``--seed``."""
    add_model_args(p)
    p.add_argument(
        "--requests", type=int, default=requests, help="requests (load.py: per phase and round)"
    )
    p.add_argument(
        "--concurrency", type=int, default=concurrency, help="requests in flight at most"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_traffic_args(p, requests=200, concurrency=16)
    p.add_argument("--rounds", type=int, default=1, help="rounds of phase A then phase B")
    p.add_argument(
        "--poll-interval", type=float, default=0.2, help="seconds between counter reads in A"
    )
    a = p.parse_args(argv)
    for name in ("requests", "rounds", "concurrency", "max_tokens", "poll_interval"):
        if not getattr(a, name) > 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    load_start = os.getloadavg()[0]
    model = model_path(a.model)
    with (
        tempfile.TemporaryDirectory(prefix="tllm-load-") as workdir,
        tllm_serve(model, Path(workdir), a.enforce_eager) as (url, pid),
    ):
        out = asyncio.run(drive(url, pid, a))
    out["workload"] = {
        k: getattr(a, k)
        for k in ("requests", "rounds", "concurrency", "max_tokens", "poll_interval", "seed")
    } | {"model": Path(model).name, "enforce_eager": a.enforce_eager}
    out["machine"] = run_machine(load_start)
    out["command"] = command_line("load.py", argv)
    print(json.dumps(out) if a.json else render(out))
    return 0 if out["passed"] else 1


def render(ld: dict[str, Any]) -> str:
    """The docs/results.md section of a ``--json`` result: both phases (A: with a counters
    poller, B: without), memory and the checks."""
    w = ld["workload"]
    rows = [
        [
            p["phase"],
            "yes" if p["phase"] == "A" else "no",
            f"{p['good_tok_s']:.1f}",
            f"{p['wall_s']:.0f}",
            f"{p['good_completed']}/{p['good_sent']}",
            ", ".join(f"{k}: {v}" for k, v in p["status_codes"].items()),
            p["status_5xx"],
        ]
        for p in (ld["phases"]["A"], ld["phases"]["B"])
    ]
    head = ["phase", "counters polled", "good tok/s", "wall s", "good completed", "status codes"]
    rss = {k: v["total"] if isinstance(v, dict) else v for k, v in ld["rss_mib"].items()}
    summary = [
        [
            "workload",
            f"{w['rounds']} rounds x {w['requests']} requests, {w['concurrency']} in "
            f"flight, max_tokens {w['max_tokens']}, {w['model']}",
        ],
        ["tok/s polled / unpolled", f"{ld['tok_s_ratio_polled_to_unpolled']:.3f}"],
        ["server RSS (MiB): ready, after warm-up, end", ", ".join(str(v) for v in rss.values())],
        *([k.replace("_", " "), "yes" if v else "**no**"] for k, v in ld["checks"].items()),
    ]
    return section(
        "Server under load", ld, table([*head, "5xx"], rows), table(["figure", "value"], summary)
    )


if __name__ == "__main__":
    sys.exit(main())
