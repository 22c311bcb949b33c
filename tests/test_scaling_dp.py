"""Data parallel (docs/scaling.md): units without vLLM, and ``tllm serve --data-parallel-size 2``
on loopback (real vLLM, two engine cores, marked ``slow``)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from reference import hf_states
from serve_util import get_json, tllm_serve

from tllm_core import decode_results
from tllm_core.vllm_bridge.parallel import data_parallel_layout

ROOT = Path(__file__).resolve().parent.parent
FULL = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}


def test_engine_reads_its_dp_rank_and_size_after_vllm_made_it_independent():
    # What vLLM 0.32 leaves in an engine core of a dense model at DP = 2, rank 1
    # (ParallelConfig.reconfigure_for_independent_dp_rank): size 1, rank 0, index 1.
    def dense(index: int, max_size: int) -> SimpleNamespace:
        return SimpleNamespace(
            data_parallel_size=1,
            data_parallel_rank=0,
            data_parallel_index=index,
            enable_elastic_ep=False,
            elastic_ep_max_dp_size=max_size,
        )

    assert data_parallel_layout(dense(1, 2)) == (1, 2)
    assert data_parallel_layout(dense(0, 2)) == (0, 2)
    assert data_parallel_layout(dense(0, 1)) == (0, 1)  # no data parallelism
    # MoE engines keep their DP fields
    moe = SimpleNamespace(data_parallel_size=4, data_parallel_rank=3, data_parallel_index=3)
    assert data_parallel_layout(moe) == (3, 4)


def test_serve_passes_the_dp_size_and_binds_one_core_group_per_rank():
    from tllm_core.app.cli import build_parser
    from tllm_core.app.cli_common import CliError
    from tllm_core.app.serve_command import followers_store, parallel_ranks, server_argv
    from tllm_core.runtime.settings import RuntimeSettings

    def parse(*argv):
        return build_parser().parse_args(["serve", *argv])

    args = parse("--data-parallel-size", "2")
    argv = server_argv(args, "/m/tiny", RuntimeSettings())
    assert argv[argv.index("--data-parallel-size") + 1] == "2"
    assert parallel_ranks(args) == 2
    assert parallel_ranks(parse("--tensor-parallel-size", "2", "--data-parallel-size", "2")) == 4
    assert "--data-parallel-size" not in server_argv(parse(), "/m/tiny", RuntimeSettings())
    # A size given to vLLM after `--` is the one vLLM uses: bind for it.
    assert parallel_ranks(parse("--", "--data-parallel-size", "2")) == 2
    assert parallel_ranks(parse("--", "-dp=3")) == 3
    with pytest.raises(CliError, match="--data-parallel-size: must be a whole number, got 'x'"):
        parallel_ranks(parse("--", "--data-parallel-size", "x"))
    with pytest.raises(CliError, match="--data-parallel-size: must be >= 1, got 0"):
        parallel_ranks(parse("--", "--data-parallel-size", "0"))  # as the flag's own check
    with pytest.raises(CliError, match="--nnodes: must be >= 1, got 0"):
        parallel_ranks(parse("--", "--nnodes", "0"))
    with pytest.raises(CliError, match="--node-rank: must be >= 0, got -1"):
        followers_store(["--nnodes", "2", "--node-rank", "-1"])
    # One API server: tllm's request checks and /tllm routes live in it.
    assert parallel_ranks(parse("--", "--api-server-count", "1")) == 1
    with pytest.raises(CliError, match="--api-server-count -1: .*allowed: 1"):
        parallel_ranks(parse("--", "-asc", "-1"))
    with pytest.raises(CliError, match="--api-server-count 2: tllm serve runs one API server"):
        parallel_ranks(parse("--data-parallel-size", "2", "--", "--api-server-count=2"))


def test_counters_route_asks_every_engine_core():
    from tllm_core.vllm_bridge import nodes, serving
    from tllm_core.vllm_bridge.serving import rpc_all

    calls = []

    class Core:
        core_engines = [b"e0", b"e1"]

        async def call_utility_all_async(self, method, *args):
            calls.append((method, args))
            return [[{"rank": 0}], [{"rank": 1}]]

    class Client:
        engine_core = Core()

        async def collective_rpc(self, method):
            raise AssertionError("the first engine only")

    out = asyncio.run(rpc_all(Client(), "tllm_collect"))
    assert out == [{"rank": 0}, {"rank": 1}]
    assert calls == [("collective_rpc", ("tllm_collect", None, (), None))]
    # The node check bounds the engine cores' own wait for their workers (a hung node's
    # ranks never answer: unbounded, the core could not stop, nor its workers close).
    calls.clear()
    with pytest.raises(RuntimeError, match="2 rank"):  # answers of another call: out of step
        asyncio.run(nodes.ask_node_check(rpc_all, Client(), 40.0))
    assert calls == [("collective_rpc", ("tllm_node_check", 45.0, (40.0,), None))]
    one = []

    class OneEngine:
        async def collective_rpc(self, method, timeout=None, args=()):
            one.append((method, timeout, args))
            return [0]

    asyncio.run(nodes.ask_node_check(rpc_all, OneEngine(), 40.0))
    assert one == [("tllm_node_check", 45.0, (40.0,))]
    # So does every tllm call to a multi-node engine (init_state sets the bound): the
    # server's counters reads would otherwise hold the core when a node hangs.
    lost = []
    engine = OneEngine()
    setattr(engine, serving.RPC_BOUND_ATTR, serving.RpcBound(45.0, lost.append))
    asyncio.run(rpc_all(engine, "tllm_collect"))
    assert one[-1] == ("tllm_collect", 45.0, ())
    calls.clear()
    client = Client()
    setattr(client, serving.RPC_BOUND_ATTR, serving.RpcBound(45.0, lost.append))
    asyncio.run(rpc_all(client, "tllm_collect"))
    assert calls == [("collective_rpc", ("tllm_collect", 45.0, (), None))] and lost == []

    # Past the bound the engine answers an error; a late answer would be taken as the next
    # call's, so a timed-out call is a lost node (other errors are not).
    class Late:
        def __init__(self, error):
            self.error = error

        async def collective_rpc(self, method, timeout=None, args=()):
            raise Exception(self.error)  # as vLLM's client raises a failed utility call

    for error, stops in (("Call failed: RPC call to tllm_collect timed out.", True),
                         ("Call failed: a consumer raised", False)):  # fmt: skip
        late = Late(error)
        setattr(late, serving.RPC_BOUND_ATTR, serving.RpcBound(45.0, lost.append))
        with pytest.raises(Exception, match=error[:11]):
            asyncio.run(rpc_all(late, "tllm_collect"))
        assert lost == (["a rank did not answer 'tllm_collect' within 45 s"] if stops else [])
        lost.clear()


def test_calls_to_an_engine_across_nodes_go_one_at_a_time_and_none_after_a_lost_node():
    """A call queued in the engine core behind one that waits for a hung node would hold the
    core as long again (past vLLM's stop: the workers are killed before their consumers
    close), so tllm's calls to an engine whose ranks span nodes go one at a time, and none is
    sent once one timed out; the responses' reads of their results too (batched: one call
    serves every response that reads meanwhile, ``IdBatches``)."""
    from tllm_core.vllm_bridge import serving
    from tllm_core.vllm_bridge.errors import EngineCallFailed, EngineLost, EngineNoAnswer

    sent, in_flight, most = [], [], [0]  # most: calls at once

    class Engine:
        async def collective_rpc(self, method, timeout=None, args=()):
            sent.append((method, timeout))
            in_flight.append(method)
            most[0] = max(most[0], len(in_flight))
            await asyncio.sleep(0.01)
            in_flight.remove(method)
            if method == "tllm_node_check":
                raise Exception(f"Call failed: RPC call to {method} timed out.")
            return [0]

    lost = []
    engine = Engine()
    setattr(engine, serving.RPC_BOUND_ATTR, serving.RpcBound(45.0, lost.append))

    async def calls(*names):
        return await asyncio.gather(
            *(serving.rpc_all(engine, m) for m in names), return_exceptions=True
        )

    take = "tllm_take_results"
    got = asyncio.run(calls("tllm_collect", take, "tllm_status", "tllm_node_check", "tllm_collect"))
    assert most == [1]
    assert [m for m, _ in sent] == ["tllm_collect", take, "tllm_status", "tllm_node_check"]
    assert {t for _, t in sent} == {45.0}
    assert got[:3] == [[0], [0], [0]] and "timed out" in str(got[3])
    why = "a rank did not answer 'tllm_node_check' within 45 s"
    assert lost == [why]
    assert isinstance(got[4], EngineNoAnswer) and str(got[4]) == f"'tllm_collect' not sent: {why}"
    (late,) = asyncio.run(calls(take))
    assert isinstance(late, EngineNoAnswer) and len(sent) == 4
    # A check that fails otherwise (the worker's barrier gave up: vLLM raises at the first
    # failed answer, not waiting for the hung rank) is a lost node too; the node watch tells.
    failed = Exception("Call to collective_rpc method failed: rank 0: no barrier")
    engine.collective_rpc = lambda *a, **k: sent.append(a) or _raise(failed)
    setattr(engine, serving.RPC_BOUND_ATTR, serving.RpcBound(45.0, lost.append))
    got = asyncio.run(calls("tllm_node_check", "tllm_collect"))
    assert isinstance(got[0], EngineCallFailed) and got[0].__cause__ is failed
    assert isinstance(got[1], EngineLost) and len(sent) == 5
    assert "not sent: the node check failed (Call to collective_rpc" in str(got[1])
    assert lost == [why]
    # A caller that stops waiting leaves its call in the core: the next goes once it ended.
    ends = []

    class Slow:
        async def collective_rpc(self, method, timeout=None, args=()):
            ends.append(f"{method} sent")
            await asyncio.sleep(0.2)
            ends.append(f"{method} ended")
            return [0]

    slow = Slow()
    setattr(slow, serving.RPC_BOUND_ATTR, serving.RpcBound(45.0, lost.append))

    async def impatient():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(serving.rpc_all(slow, "tllm_collect"), 0.05)
        return await serving.rpc_all(slow, "tllm_status")

    assert asyncio.run(impatient()) == [0]
    assert ends == [
        "tllm_collect sent",
        "tllm_collect ended",
        "tllm_status sent",
        "tllm_status ended",
    ]


async def _raise(e: Exception) -> None:
    raise e


def test_a_rank_error_leaves_no_answer_for_the_next_call():
    """vLLM's ``collective_rpc`` reads the ranks' answers in rank order and raises at the first
    error, leaving the later ranks' answers queued: the next call would read them as its own
    (a stale error, then each rank a call behind). So a tllm method that raises answers its
    error as a value; every rank's answer is read and the caller raises it."""
    from collections import deque

    from tllm_core.vllm_bridge import serving
    from tllm_core.vllm_bridge.errors import EngineCallFailed
    from tllm_core.vllm_bridge.worker_ext import TllmWorkerExtension

    class Runtime:
        calls = 0

        def collect(self):
            self.calls += 1
            return {"call": self.calls}

        def take_results(self, ids, wait_s):
            raise RuntimeError(f"no results for {ids}")

    class Worker(TllmWorkerExtension):
        def __init__(self, rank):
            hooks = SimpleNamespace(runtime=Runtime(), rank=SimpleNamespace(as_dict=lambda: rank))
            self.model_runner = SimpleNamespace(_tllm_hooks=hooks)

    class Executor:  # vLLM's MultiprocExecutor.collective_rpc, one response queue per rank
        def __init__(self):
            self.workers = [Worker(0), Worker(1)]
            self.queues = [deque(), deque()]

        async def collective_rpc(self, method, timeout=None, args=()):
            for w, q in zip(self.workers, self.queues, strict=True):
                try:
                    q.append((True, getattr(w, method)(*args)))
                except Exception as e:  # noqa: BLE001 - as WorkerProc answers it
                    q.append((False, str(e)))
            answers = []
            for q in self.queues:
                ok, answer = q.popleft()
                if not ok:
                    raise Exception(f"Worker failed with error '{answer}'")
                answers.append(answer)
            return answers

    engine = Executor()
    with pytest.raises(EngineCallFailed, match="tllm_take_results: RuntimeError: no results"):
        asyncio.run(serving.rpc_all(engine, "tllm_take_results", ["r1"], 0.0))
    assert [len(q) for q in engine.queues] == [0, 0]
    got = asyncio.run(serving.rpc_all(engine, "tllm_collect"))
    assert got == [{"call": 1, "rank": 0}, {"call": 1, "rank": 1}]


def test_the_requests_of_a_group_go_to_one_engine(monkeypatch):
    """vLLM balances each request and each of its n children alone; tllm's server sends a
    request's samples to the engine its first went to, a client's ``tllm_group`` to one engine
    (ESamp: one distiller per group), keeps a request's own ``data_parallel_rank``, leaves a
    single-engine client alone, and forgets aborted fan-outs (least recently routed first)."""
    from tllm_core.api.request_settings import GROUP_KEY, OWN_GROUP, SAMPLES_KEY
    from tllm_core.vllm_bridge import serving

    class Core:  # DPLBAsyncMPClient: round robin, a set rank obeyed, in-flight books kept
        core_engines = [b"e0", b"e1"]

        def __init__(self):
            self.next, self.in_flight = 0, {}

        def get_core_engine_for_request(self, request):
            if (rank := request.data_parallel_rank) is None:
                rank, self.next = self.next, (self.next + 1) % 2
            self.in_flight[request.request_id] = self.core_engines[rank]
            return self.core_engines[rank]

    def client(dp_size: int = 2) -> SimpleNamespace:
        parallel = SimpleNamespace(data_parallel_size=dp_size)
        out = SimpleNamespace(engine_core=Core(), vllm_config=SimpleNamespace())
        out.vllm_config.parallel_config = parallel
        serving.install_group_affinity(out)
        return out

    def req(rid: str, n: int = 4, rank: int | None = None, group: str = "") -> SimpleNamespace:
        group = group or OWN_GROUP + rid.partition("_")[2]  # as assign_request_id sets it
        params = SimpleNamespace(extra_args={SAMPLES_KEY: n, GROUP_KEY: group}, n=1)
        return SimpleNamespace(request_id=rid, sampling_params=params, data_parallel_rank=rank)

    c = client()
    core = c.engine_core
    route = core.get_core_engine_for_request
    got, sent = {}, []
    for parent in ("a-1", "b-2"):  # vLLM alone: e0, e1, e0, e1 for each
        for i in range(4):
            sent.append(req(f"{i}_{parent}"))
            got.setdefault(parent, []).append(route(sent[-1]))
    assert got == {"a-1": [b"e0"] * 4, "b-2": [b"e1"] * 4}
    assert all(r.data_parallel_rank is None for r in sent)  # sent to the engine unchanged
    assert core.in_flight["3_a-1"] == b"e0"  # vLLM's books (aborts) know where each went
    assert route(req("x_1-1", n=1)) == b"e0" and route(req("y_2-1", n=1)) == b"e1"
    set_rank = [req(f"{i}_c-3", rank=1) for i in range(4)]
    assert [route(r) for r in set_rank] == [b"e1"] * 4
    assert [r.data_parallel_rank for r in set_rank] == [1] * 4
    assert route.placed == {}  # every request's samples routed in full are forgotten
    # A client's group: its requests (n = 1 or more) go to the engine its name hashes to,
    # whatever vLLM says, in any API server process, however many groups there are.
    # vLLM would send the first to e0 (round robin), then e1: the group's engine is e1.
    g = next(f"client-x/g{i}" for i in range(100) if serving.group_engine(f"x/g{i}", 2) == 1)
    pooled = [req("p-1", n=1, group=g), req("0_p-2", group=g)]
    pooled += [req(f"{i}_p-3", group=g) for i in range(3)]
    assert core.next == 0 and [route(r) for r in pooled] == [b"e1"] * 5
    assert all(r.data_parallel_rank is None for r in pooled)
    # Another client's group of that name, in another API server process: there too.
    other = client().engine_core.get_core_engine_for_request
    assert other(req("q-1", n=1, group="client-y/" + g.partition("/")[2])) == b"e1"
    counts = [serving.group_engine(f"client-y/{i}", 2) for i in range(1000)]
    assert 400 < counts.count(0) < 600  # spread over the engines
    assert route.placed == {}  # nothing remembered for them
    # A third engine: only the groups it takes move (rendezvous hashing), a third of them.
    moved = [
        serving.group_engine(f"c/{i}", 2) != serving.group_engine(f"c/{i}", 3) for i in range(999)
    ]
    assert all(serving.group_engine(f"c/{i}", 3) == 2 for i, m in enumerate(moved) if m)
    assert 250 < sum(moved) < 420
    monkeypatch.setattr(serving, "MAX_FAN_OUTS", 3)
    for i in range(10):  # fan-outs aborted after their first child: the oldest dropped
        route(req(f"0_gone-{i}"))
    assert list(route.placed) == [f"request/gone-{i}" for i in (7, 8, 9)]
    # An engine removed mid fan-out (elastic EP): the next sibling is balanced again.
    core.core_engines = [b"e0"]
    core.next = 0
    assert route(req("1_gone-9")) == b"e0"
    single = client(dp_size=1)
    assert "get_core_engine_for_request" not in vars(single.engine_core)
    broken = SimpleNamespace(engine_core=SimpleNamespace(), vllm_config=c.vllm_config)
    with pytest.raises(Exception, match="client lacks 'core_engines'"):  # vLLM changed: loud
        serving.install_group_affinity(broken)


def test_worker_shutdown_closes_the_runtime_once():
    from tllm_core.vllm_bridge.hooks import RunnerHooks
    from tllm_core.vllm_bridge.worker_ext import TllmWorkerExtension
    from tllm_core.vllm_bridge.worker_setup import close_on_shutdown

    events = []

    class Runtime:
        def close(self):
            events.append("close")
            return {"runtime": {"closed": 1}}

    def make_worker():
        hooks = RunnerHooks.__new__(RunnerHooks)  # only the close() bookkeeping
        hooks.runtime, hooks._final, hooks._pending = Runtime(), None, None

        class Worker(TllmWorkerExtension):
            model_runner = SimpleNamespace(_tllm_hooks=hooks)
            rank = None

            def shutdown(self):
                events.append("shutdown")

        w = Worker()
        hooks.rank = SimpleNamespace(as_dict=lambda: {"dp_rank": 0})
        close_on_shutdown(w)
        return w

    make_worker().shutdown()  # a server stopping: consumers closed, then vLLM's shutdown
    assert events == ["close", "shutdown"]
    events.clear()
    w = make_worker()
    assert w.tllm_close()["runtime"] == {"closed": 1}  # TllmLLM.close(), then the engine stops
    w.shutdown()
    assert events == ["close", "shutdown"]


# -- real vLLM ---------------------------------------------------------------------------------
def _post(url: str, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.mark.vllm
@pytest.mark.slow  # two engine cores start one after the other: ~3-6 min on 2 cores
def test_serve_dp2_per_request_consumer_counters_summed_and_export_parts(tiny_model, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from consumers.export import DataParallelExport, open_export

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("data parallel 2 needs 2 CPU cores (one per engine)")
    out = tmp_path / "exp"
    err_path = tmp_path / "serve.err"
    export = json.dumps({"out": str(out), "layers": [0, "final"], "shard_rows": 16})
    args = [
        "--model", tiny_model, "--data-parallel-size", "2", "--max-model-len", "256",
        "--consumer", "esamp", "--consumer", "stats", "--consumer", f"export:{export}",
        "--per-request", "--", "--enforce-eager", "--max-num-seqs", "4", "--no-enable-prefix-caching",
        "--dtype", "float32",
    ]  # fmt: skip
    with tllm_serve(args, err_path, ready_timeout=900, stop_timeout=180) as url:
        status = get_json(f"{url}/tllm/status")
        assert [r["rank"]["dp_rank"] for r in status["ranks"]] == [0, 1]
        assert {r["rank"]["dp_size"] for r in status["ranks"]} == {2}

        # Several requests at once: the load balancer spreads them over both engines.
        # Odd requests name every consumer (ESamp guides them), even ones only stats.
        def complete(i: int) -> dict:
            consumers = "esamp,stats,export" if i % 2 else "stats"
            xargs = {"tllm_consumers": consumers}
            if i % 2:
                xargs["tllm_esamp_beta"] = 0.5
                # Capture windows at DP: the last prompt token or the last row, returned
                # with the completion too.
                xargs["tllm_export_window"] = "last_prompt" if i % 4 == 1 else "last"
                xargs["tllm_results"] = "export"
            body = {
                "model": "default",
                "prompt": f"Story number {i}: once upon a time",
                "max_tokens": 8,
                "temperature": 1.0,
                "ignore_eos": True,
                "vllm_xargs": xargs,
            }
            return _post(f"{url}/v1/completions", body)

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(complete, range(16)))
        assert all(r["usage"]["completion_tokens"] == 8 for r in results)
        rep = get_json(f"{url}/tllm/counters")

        ranks = rep["ranks"]
        assert [r["rank"]["dp_rank"] for r in ranks] == [0, 1]
        finished = [r["runtime"].get("requests_finished", 0) for r in ranks]
        print("requests finished per engine:", finished)
        assert all(f > 0 for f in finished), f"one engine got no request: {finished}"
        # Summed over the engines, and every request counted once.
        assert rep["runtime"]["requests_finished"] == sum(finished) == 16
        for name, key in (("esamp", "rows_guided"), ("stats", "bundles")):
            per_rank = [r["consumers"][name].get(key, 0) for r in ranks]
            assert rep["consumers"][name][key] == sum(per_rank) > 0
        # Only the 8 requests naming esamp are guided: at most 7 decode rows each.
        assert 0 < rep["consumers"]["esamp"]["rows_guided"] <= 8 * 7
        assert len(rep["results"]["export"]) == 2
        assert rep["errors"] == []

        def four_more_since(before: list[dict]) -> tuple[list[int], list[int], list[dict]]:
            """Per engine: requests finished and ESamp groups created since ``before`` (once
            4 more finished; bounded: the engines count a finish at their next step), and
            the ranks' counters now."""
            for _ in range(20):
                after = get_json(f"{url}/tllm/counters")["ranks"]
                more = [
                    a["runtime"].get("requests_finished", 0)
                    - b["runtime"].get("requests_finished", 0)
                    for a, b in zip(after, before, strict=True)
                ]
                if sum(more) == 4:
                    break
                time.sleep(0.25)
            groups = [
                a["consumers"]["esamp"].get("groups_created", 0)
                - b["consumers"]["esamp"].get("groups_created", 0)
                for a, b in zip(after, before, strict=True)
            ]
            return more, groups, after

        # The n = 4 samples of one prompt all run on one engine (vLLM alone balances each
        # sample: 2 + 2 here), so ESamp trains one distiller over all four.
        body = {"model": "default", "prompt": "Four tellings of one tale", "n": 4, **FULL}
        body.update(max_tokens=4, temperature=1.0)
        body["vllm_xargs"] = {"tllm_consumers": "esamp,stats", "tllm_esamp_beta": 0.5}
        assert len(_post(f"{url}/v1/completions", body)["choices"]) == 4
        more, groups, after = four_more_since(ranks)
        assert sorted(more) == [0, 4], f"the samples split over the engines: {more}"
        assert sorted(groups) == [0, 1], groups

        # Four requests of one client's tllm_group, sent at once: all on one engine.
        body["vllm_xargs"] = {**body["vllm_xargs"], "tllm_group": "tale"}
        body.update(n=1)
        with ThreadPoolExecutor(4) as pool:
            assert all(len(r["choices"]) == 1 for r in pool.map(
                lambda i: _post(f"{url}/v1/completions", {**body, "prompt": f"Tale {i}"}),
                range(4),
            ))  # fmt: skip
        more, groups, _ = four_more_since(after)
        assert sorted(more) == [0, 4], f"the group split over the engines: {more}"
        # One engine's distillers (one, or more if a request ended before the next came).
        assert min(groups) == 0 < max(groups), groups

        # Full rows (no window), one request sent to each engine (vLLM's header): 31+ rows each,
        # so each part's record spans shards of 16 rows, and the result comes from one rank.
        def full(rank: int) -> dict:
            xargs = {"tllm_consumers": "export", "tllm_results": "export"}
            body = {"model": "default", "prompt": f"Engine {rank} tells a long story", **FULL}
            body["vllm_xargs"] = xargs
            return _post(f"{url}/v1/completions", body, {"X-data-parallel-rank": str(rank)})

        with ThreadPoolExecutor(2) as pool:
            full_results = list(pool.map(full, (0, 1)))
    log = err_path.read_text()
    assert "Traceback" not in log, log[-4000:]

    # Export: one part per engine in one folder, merged by the reader; the 8 requests that
    # named export, each with its prompt and 8 generated tokens.
    exp = open_export(out, verify=True)
    assert isinstance(exp, DataParallelExport) and exp.data_parallel_size == 2
    assert exp.complete  # each engine closed its consumers when the server stopped
    records = exp.records()
    # The full-row records: one per part, every row (all shards of both parts), rows equal
    # to transformers' on the same tokens and to the rows returned with the completion.
    whole = sorted((r for r in records if len(r.positions) > 1), key=lambda r: r.data_parallel_rank)
    assert [r.data_parallel_rank for r in whole] == [0, 1]
    assert all(len(p.shards) > 1 for _, p in exp.parts)
    for rec, r in zip(whole, full_results, strict=True):
        seq = rec.token_ids.tolist()
        assert len(rec.generated_token_ids) == FULL["max_tokens"]
        assert rec.positions.tolist() == list(range(len(seq) - 1)), rec.positions
        got = decode_results(r["tllm"][0])["export"]
        assert got["positions"].tolist() == rec.positions.tolist()
        ref = hf_states(tiny_model, seq)
        for key in ("layer.0", "final"):
            assert np.array_equal(got[key], rec.hidden[key].numpy()), key
            torch.testing.assert_close(
                rec.hidden[key], ref[key][rec.positions], rtol=1e-4, atol=1e-4
            )
    assert exp.num_rows == 8 + sum(len(r.positions) for r in whole)
    records = [r for r in records if len(r.positions) == 1]
    assert len(records) == 8
    assert {r.data_parallel_rank for r in records} <= {0, 1}
    for rec in records:
        assert len(rec.generated_token_ids) == 8
        n = rec.num_prompt_tokens
        assert rec.positions.tolist() in ([n - 1], [n + 6]), rec.positions  # the two windows
        assert set(rec.hidden) == {"layer.0", "final"}
    # Each asking request got its row back: the one its engine's export wrote.
    for i, r in enumerate(results):
        if i % 2 == 0:
            assert "tllm" not in r
            continue
        got = decode_results(r["tllm"][0])["export"]
        want = "last_prompt" if i % 4 == 1 else "last"
        position = int(got["positions"][0])
        assert len(got["positions"]) == 1, got["positions"]
        matches = [
            rec
            for rec in records
            if rec.positions.tolist() == [position]
            and np.array_equal(rec.hidden["layer.0"].numpy(), got["layer.0"])
        ]
        assert matches, (i, want, position)
        n = matches[0].num_prompt_tokens
        assert position == (n - 1 if want == "last_prompt" else n + 6), (i, want, position, n)
