"""Tensor and data parallel across two "nodes" (two ``tllm serve`` processes on 127.0.0.1): the
leader serves the API, the follower (``--headless``) runs TP rank 1 or DP engine 1; consumers
run where the rows are, export writes one dataset equal to transformers; settings that differ
between the nodes are refused naming both sides; a follower that dies stops the leader with an
error, a leader that is gone stops the follower (issue 38, docs/scaling.md). Loopback only.
The logic without engines: tests/test_dp_nodes.py and the units below."""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest
import torch
from node_util import (
    descendants,
    exit_codes,
    exit_within,
    kill_group,
    leftover_shm,
    shm_entries,
    start,
    wait_for,
)
from serve_util import free_port, get_json

from tllm_core.vllm_bridge.nodes import comparable, differ_message, differences


# -- units -------------------------------------------------------------------------------------
def test_settings_compared_across_nodes_ignore_per_process_fields():
    a = {"consumers": [{"name": "stats"}], "queue_size": 64, "start_error_file": "/tmp/a"}
    b = {**a, "start_error_file": "/tmp/b", "server": {"max_body_bytes": 1}}
    b["hung_stop_s"] = 60.0  # a `tllm serve --headless` follower of a TllmLLM leader (0)
    b["front_end"] = [4242, 1.5]  # each node's own TllmLLM
    assert comparable(a) == comparable(b)
    c = {**a, "consumers": [{"name": "esamp"}]}
    assert comparable(c) != comparable(a) and differences(a, c) == ["consumers"]
    assert differences(a, None) == ["tllm"] and comparable(None) == "null"
    msg = differ_message("node_rank 0", a, "node_rank 1 (rank 1)", c)
    assert "leader node_rank 0 runs" in msg and "node_rank 1 (rank 1) runs" in msg
    assert '"stats"' in msg and '"esamp"' in msg and "fields: consumers" in msg


def _compare_on_ranks(ranks: dict[int, dict | None | str]) -> dict[int, str | None]:
    """Each rank's :func:`compare_settings` in a thread over one store (``"absent"``: a node
    without tllm, which publishes nothing); each rank's refusal, or None."""
    import threading

    from torch.distributed import HashStore

    from tllm_core.vllm_bridge.errors import UnsupportedEngineError
    from tllm_core.vllm_bridge.nodes import compare_settings

    store, out = HashStore(), {}

    def one(rank: int, settings: dict | None) -> None:
        try:
            compare_settings(store, rank, len(ranks), rank, settings, waits=(3.0, 2.0))
            out[rank] = None
        except UnsupportedEngineError as e:
            out[rank] = str(e)

    threads = [threading.Thread(target=one, args=(r, s)) for r, s in ranks.items() if s != "absent"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a rank's settings check did not end"
    return out


def test_nodes_compare_settings_through_the_store_and_a_node_without_tllm_hangs_none():
    """The check joins no collective: a node without tllm (plain vLLM) is never left waiting,
    and a plain node with tllm installed goes on untouched when its leader has no tllm."""
    a, b = {"consumers": [{"name": "stats"}]}, {"consumers": [{"name": "esamp"}]}
    assert _compare_on_ranks({0: a, 1: a, 2: a}) == {0: None, 1: None, 2: None}
    differ = _compare_on_ranks({0: a, 1: b})
    assert all("tllm settings differ" in differ[r] and '"esamp"' in differ[r] for r in (0, 1))
    assert _compare_on_ranks({0: None, 1: None}) == {0: None, 1: None}  # plain, tllm installed
    assert _compare_on_ranks({0: "absent", 1: None}) == {1: None}  # plain leader without tllm
    plain_follower = _compare_on_ranks({0: a, 1: None})
    assert all("fields: tllm" in plain_follower[r] for r in (0, 1)), plain_follower
    no_leader = _compare_on_ranks({0: "absent", 1: a})[1]
    assert "ranks [0] of this multi-node engine did not tell their tllm settings" in no_leader


def test_serve_headless_passes_the_flag_and_counts_local_ranks():
    from tllm_core.app.cli import build_parser
    from tllm_core.app.serve_command import headless, parallel_ranks, server_argv
    from tllm_core.runtime.settings import RuntimeSettings

    def parse(*argv):
        return build_parser().parse_args(["serve", *argv])

    follower = parse("--tensor-parallel-size", "2", "--headless", "--", "--nnodes", "2")
    assert headless(follower) and "--headless" in server_argv(follower, "/m", RuntimeSettings())
    assert parallel_ranks(follower) == 1  # TP 2 over 2 nodes: one rank here
    leader = parse("--tensor-parallel-size", "2", "--", "--nnodes", "2", "--node-rank", "0")
    assert not headless(leader) and "--headless" not in server_argv(leader, "/m", RuntimeSettings())
    assert headless(parse("--", "--headless"))
    argv = server_argv(parse("--headless", "--", "--headless"), "/m", RuntimeSettings())
    assert argv.count("--headless") == 1
    dp = parse("--data-parallel-size", "4", "--", "--data-parallel-size-local", "2")
    assert parallel_ranks(dp) == 2


def test_node_watch_reports_a_failed_check_once():
    import asyncio

    from tllm_core.vllm_bridge import nodes

    calls, lost = [], []
    watch = nodes.NodeWatch()

    async def ask(bound):
        calls.append(bound)
        if len(calls) == 3:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    asyncio.run(watch.watch_nodes(ask, 2, 0.01, lost.append))
    assert calls == [nodes.NODE_CHECK_TIMEOUT_S] * 3 and len(lost) == 1  # the barrier's bound
    assert "2-node engine is gone" in lost[0] and "Connection closed by peer" in lost[0]
    assert watch.lost() == lost[0]
    assert nodes.NodeWatch().lost() is None  # each watch its own


def test_a_node_check_held_by_a_long_step_is_no_lost_node(monkeypatch):
    """The check waits behind the engine's steps: an answer within the callback deadline
    (plus the check's own bound) is a live node; later, a lost one."""
    import asyncio

    from tllm_core.vllm_bridge import nodes

    monkeypatch.setattr(nodes, "NODE_CHECK_TIMEOUT_S", 0.05)
    monkeypatch.setattr(nodes, "NODE_ANSWER_MARGIN_S", 0.01)
    calls, lost = [], []

    async def slow(bound):  # a step holds the check 0.2 s: within a 0.3 s callback deadline
        calls.append(bound)
        await asyncio.sleep(0.2)
        if len(calls) == 2:
            raise RuntimeError("peer gone")

    asyncio.run(nodes.NodeWatch().watch_nodes(slow, 2, 0.01, lost.append, step_s=0.3))
    assert calls == [pytest.approx(0.35)] * 2 and "peer gone" in lost[0]
    lost.clear()
    asyncio.run(nodes.NodeWatch().watch_nodes(slow, 2, 0.01, lost.append))
    assert "no answer" in lost[0]  # without the deadline: taken for a lost node


BARRIER_RANK = """
import os, sys, time
from types import SimpleNamespace as NS
import torch.distributed as dist
import vllm.distributed.parallel_state as ps
from tllm_core.vllm_bridge import nodes

rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
if rank == 1:  # a node that hangs: it never joins the check
    time.sleep(60)
ps.get_world_group = lambda: NS(cpu_group=dist.group.WORLD, rank=0, world_size=2)
try:
    nodes.node_check(1.0)
except RuntimeError as e:
    print(f"refused: {e}", flush=True)
os._exit(0)  # not gloo's teardown, which waits for the abandoned barrier
"""


def test_the_node_check_barrier_gives_up_on_a_peer_that_hangs(tmp_path):
    """A worker must not stay in the barrier past its bound: held there, it could not close its
    consumers when the engine stops (an export lost on a dead machine's peer)."""
    import subprocess
    import sys

    store = tmp_path / "store"
    argv = [sys.executable, "-c", BARRIER_RANK]
    peer = subprocess.Popen([*argv, "1", str(store)], stdout=subprocess.DEVNULL)
    try:
        out = subprocess.run(
            [*argv, "0", str(store)], capture_output=True, text=True, timeout=120
        ).stdout
    finally:
        peer.kill()
        peer.wait(30)
    # Unbounded, it would wait until the peer exits (60 s: "Connection closed by peer").
    assert "refused: rank 0: no barrier with the other 1 ranks (bound 1 s): " in out, out
    assert "timed out" in out, out


def test_node_count_sees_tp_nodes_and_remote_dp_engines():
    from types import SimpleNamespace as NS

    from tllm_core.vllm_bridge.nodes import node_count

    assert node_count(NS(nnodes=1, data_parallel_size=1, data_parallel_size_local=1)) == 1
    assert node_count(NS(nnodes=2, data_parallel_size=1, data_parallel_size_local=1)) == 2
    assert node_count(NS(nnodes=1, data_parallel_size=2, data_parallel_size_local=1)) == 2
    assert node_count(NS(nnodes=1, data_parallel_size=2, data_parallel_size_local=2)) == 1
    # An API server with no engine of its own (--data-parallel-size-local 0) watches them too.
    assert node_count(NS(nnodes=1, data_parallel_size=2, data_parallel_size_local=0)) == 2
    assert node_count(NS(nnodes=1, data_parallel_size=1, data_parallel_size_local=0)) == 2


def test_leader_watch_waits_for_a_leader_and_reports_one_that_went_away():
    import socket
    import time

    from tllm_core.vllm_bridge import nodes

    port = free_port()
    lost: list[str] = []
    watch = nodes.NodeWatch()
    t = watch.watch_leader("127.0.0.1", port, 0.05, lost.append)
    time.sleep(0.5)  # no leader yet: a follower started first waits for it
    assert lost == [] and t.is_alive()
    server = socket.create_server(("127.0.0.1", port))
    time.sleep(0.3)
    assert lost == []
    server.close()  # the leader is gone
    t.join(5)
    assert len(lost) == 1 and f"(127.0.0.1:{port}) is gone" in lost[0]
    assert watch.lost() == lost[0]


def test_a_leaders_requested_stop_reaches_its_follower_at_once():
    """The leader's stop signal sets the stop key in its engine's store (here a bare TCP
    store): the follower stops on request (no lost node) within a second or two, not after
    LEADER_MISSES refused probes; a store that goes away without it is a lost leader."""
    import time

    import torch.distributed as dist

    from tllm_core.vllm_bridge import nodes

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    follower, lost, stopped = nodes.NodeWatch(), [], []
    t = follower.watch_leader("127.0.0.1", store.port, 0.2, lost.append, lambda: stopped.append(1))
    time.sleep(1)  # the follower has seen its leader and holds a store client
    leader = nodes.NodeWatch()
    leader.followers_store = ("127.0.0.1", store.port)
    leader.stop()  # what the leader's first SIGTERM does
    time.sleep(1.5)  # the leader drains its requests: its ranks still need the follower's
    assert stopped == lost == [] and t.is_alive()
    t0 = time.monotonic()
    del store  # the leader's engine has stopped
    t.join(10)
    assert stopped == [1] and lost == [] and follower.lost() is None
    assert follower.stopping and time.monotonic() - t0 < 10  # not LEADER_MISSES probes

    store2 = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    follower, lost, stopped = nodes.NodeWatch(), [], []
    t = follower.watch_leader("127.0.0.1", store2.port, 0.2, lost.append, lambda: stopped.append(1))
    time.sleep(1)
    del store2  # the leader is gone without a word
    t.join(20)
    assert stopped == [] and len(lost) == 1 and "is gone" in lost[0]


def test_a_tllmllm_leader_tells_its_followers_of_a_requested_stop_not_of_a_death():
    """``TllmLLM`` leading a multi-node engine: ``close``/``shutdown`` (a requested stop) sets
    the stop key in the engine's store before the engine stops, so the follower stops on
    request; an engine that died says nothing, so the follower finds its leader gone."""
    import functools
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from tllm_core.app.engine import TllmLLM, validate_consumers
    from tllm_core.vllm_bridge import nodes
    from tllm_core.vllm_bridge.engine_watch import Death, EngineWatch

    assert nodes.leader_store(2, 0) == ("127.0.0.1", 29501)
    assert nodes.leader_store(2, 1, "10.0.0.1", 7) is None  # a follower
    assert nodes.leader_store(None, None) is None  # one node
    assert nodes.leader_store(2, 0, "10.0.0.1", "7") == ("10.0.0.1", 7)

    def leader(port: int, died: bool) -> TllmLLM:
        llm = TllmLLM.__new__(TllmLLM)  # the state of a started leader; no vLLM here
        llm.llm = SimpleNamespace()  # no engine processes to stop
        llm._watch = EngineWatch(SimpleNamespace())
        llm._fault_note = SimpleNamespace(close=lambda: None, path="")
        llm._followers_store = ("127.0.0.1", port)
        llm._checked, llm._started_at, llm._failure_told = validate_consumers([]), 0.0, False
        llm._died = None
        if died:
            llm._watch.death = Death("vLLM's engine core", 1, "killed by SIGKILL")
        return llm

    for died in (False, True):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        follower, lost, stopped = nodes.NodeWatch(), [], []
        on_stop = functools.partial(stopped.append, 1)
        t = follower.watch_leader("127.0.0.1", store.port, 0.2, lost.append, on_stop)
        time.sleep(1)  # the follower has seen its leader and holds a store client
        leader(store.port, died).shutdown()
        time.sleep(1)
        del store  # the leader's engine has stopped
        t.join(20)
        if died:
            assert stopped == [] and len(lost) == 1 and "is gone" in lost[0], lost
        else:
            assert len(stopped) == 1 and lost == [], lost


def test_followers_store_is_the_leaders_master_address():
    from tllm_core.app.serve_command import followers_store

    assert followers_store([]) is None
    assert followers_store(["--nnodes", "2", "--node-rank", "1"]) is None
    assert followers_store(["--nnodes", "2"]) == ("127.0.0.1", 29501)
    argv = ["--nnodes=2", "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port=7"]
    assert followers_store(argv) == ("10.0.0.1", 7)
    with pytest.raises(ValueError, match="--master-port: must be <= 65535, got 70000"):
        followers_store(["--nnodes", "2", "--master-port", "70000"])


# -- two node processes on loopback ------------------------------------------------------------
@pytest.fixture(scope="module")
def even_model() -> str:
    from conftest import MODEL_CACHE
    from tiny_models import build_tiny_model

    return str(build_tiny_model(MODEL_CACHE, arch="llama", heads=2, kv_heads=2))


ENGINE = ["--max-model-len", "256", "--kv-cache-gib", "1"]


def _nodes(model, consumers, tmp_path, follower_consumers=None):
    """Leader (node rank 0, core 0) and headless follower (node rank 1, core 1)."""
    port, master = free_port(), free_port()
    common = ["--model", model, "--tensor-parallel-size", "2", *ENGINE]

    def node(rank, cons, log, *extra):
        vllm = ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
        vllm += ["--master-port", str(master), "--enforce-eager", "--no-enable-prefix-caching"]
        argv = ["serve", "--port", str(port), *common, *cons, *extra, "--", *vllm]
        return start(argv, log, VLLM_CPU_OMP_THREADS_BIND=str(rank))

    leader = node(0, consumers, tmp_path / "leader.log")
    follower = node(1, follower_consumers or consumers, tmp_path / "follower.log", "--headless")
    return leader, follower, f"http://127.0.0.1:{port}"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@torch.no_grad()
def _hf_greedy_agrees(model: str, token_ids: list[int], n_prompt: int) -> None:
    """Each generated token is transformers' argmax at its position (or within 1e-4 of it:
    a near-tie that a different summation order may flip)."""
    from reference import hf_model

    logits = hf_model(model)(torch.tensor([token_ids])).logits[0]
    for pos in range(n_prompt, len(token_ids)):
        row = logits[pos - 1]
        assert row.max() - row[token_ids[pos]] <= 1e-4 * max(1.0, row.abs().max()), pos


@pytest.mark.vllm
@pytest.mark.slow  # two node processes, TP = 2 across them: 2-4 min on 2 cores
@pytest.mark.parametrize("lost", ["dies", "hangs"])
def test_tp2_across_two_nodes_serves_exports_and_stops_when_the_follower_is_lost(
    even_model, tmp_path, lost
):
    """The follower dies (its connections close) or hangs (SIGSTOP: they stay open, as a dead
    machine's do); either way the leader stops naming the lost node, its export complete,
    also at the default callback deadline (the hang's bounds are the longest then)."""
    from reference import hf_states

    from consumers.export import open_export

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two node processes need 2 CPU cores (one rank each)")
    out = tmp_path / "exp"
    export = json.dumps({"out": str(out), "layers": [0, "final"]})
    consumers = ["--consumer", "stats", "--consumer", "esamp", "--consumer", f"export:{export}"]
    consumers += ["--per-request"]
    if lost == "dies":  # its connections close: the check fails at once, whatever its bound
        consumers += ["--callback-deadline", "10"]
    shm_before = shm_entries()
    leader, follower, url = _nodes(even_model, consumers, tmp_path)
    llog = tmp_path / "leader.log"
    try:
        wait_for(llog, "tllm: ready", leader, 600)
        status = get_json(f"{url}/tllm/status")
        ranks = [r["rank"] for r in status["ranks"]]
        assert [(r["tp_rank"], r["leader"]) for r in ranks] == [(0, True), (1, False)]
        assert all(r["installed"] and r["taps"] for r in status["ranks"])  # taps on both nodes

        prompt = "Hello there, how are"
        greedy = {"model": "default", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        greedy["ignore_eos"] = True
        greedy["vllm_xargs"] = {"tllm_consumers": "stats,export,esamp", "tllm_esamp_beta": 0.0}
        text = _post(f"{url}/v1/completions", greedy)["choices"][0]["text"]
        guided = {**greedy, "temperature": 1.0, "seed": 3}
        guided["vllm_xargs"] = {"tllm_consumers": "esamp", "tllm_esamp_beta": 0.5}
        _post(f"{url}/v1/completions", guided)
        rep = get_json(f"{url}/tllm/counters")
        assert rep["errors"] == []
        assert rep["runtime"]["requests_finished"] == 2  # counted once (the leader's)
        assert rep["consumers"]["stats"]["bundles"] > 0
        assert 0 < rep["consumers"]["esamp"]["rows_guided"] <= 7  # the guided request only
        leader_pids = {leader.pid, *descendants(leader.pid)}

        # The follower node dies or hangs (everything but its resource tracker, which unlinks
        # its shared memory once the node is killed, as a dead machine leaves nothing here).
        sig = signal.SIGKILL if lost == "dies" else signal.SIGSTOP
        assert kill_group(follower, but="resource_tracker", sig=sig)
        # A hang fails the check at its bound (30 s + the default callback deadline of 120 s),
        # the engine core's wait 5 s later, the server's 10 s later.
        code = exit_within(leader, 240 if lost == "dies" else 330)
        log = llog.read_text()
        assert code == 1, log[-4000:]
        assert "2-node engine is gone" in log or "engine failed" in log, log[-4000:]
        if lost == "hangs":  # a bound fired: the worker's barrier, or the engine core's wait
            bounded = ("rank 0: no barrier with the other 1 ranks", "a rank did not answer")
            assert any(b in log for b in bounded), log[-4000:]
            kill_group(follower, but="resource_tracker")
        assert descendants(leader.pid, settle=30) == []
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                kill_group(p)
            p.wait(30)
    assert text
    # The leader closed its consumers as its engine stopped: the export reads back equal
    # to transformers at every position.
    exp = open_export(out, verify=True)
    (rec,) = exp.records()
    tokens = rec.token_ids.tolist() if hasattr(rec.token_ids, "tolist") else list(rec.token_ids)
    _hf_greedy_agrees(even_model, tokens, rec.num_prompt_tokens)
    ref = hf_states(even_model, tokens)
    pos = rec.positions
    torch.testing.assert_close(
        rec.hidden["layer.0"].float(), ref["layer.0"][pos], atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(rec.hidden["final"].float(), ref["final"][pos], atol=1e-4, rtol=1e-4)
    # OpenMP files named after the killed follower's pids are that node's (as on a dead
    # machine); the leader's own processes leave none, nor shared memory of either node.
    assert leftover_shm(shm_before, pids=leader_pids) == []


@pytest.mark.vllm
@pytest.mark.slow  # two node processes, TP = 2 across them: ~2-3 min on 2 cores
def test_sigterm_to_the_tp_leader_stops_every_node_within_30_s(even_model, tmp_path):
    import time

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two node processes need 2 CPU cores (one rank each)")
    leader, follower, url = _nodes(even_model, ["--consumer", "stats"], tmp_path)
    llog, flog = tmp_path / "leader.log", tmp_path / "follower.log"
    try:
        wait_for(llog, "tllm: ready", leader, 600)
        pids = {leader.pid: descendants(leader.pid), follower.pid: descendants(follower.pid)}
        os.kill(leader.pid, signal.SIGTERM)
        t0 = time.monotonic()
        codes = exit_codes([leader, follower], 30)
        took = time.monotonic() - t0
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                kill_group(p)
            p.wait(30)
    text = llog.read_text()[-3000:] + "\n--- follower\n" + flog.read_text()[-3000:]
    assert codes == [0, 0] and took < 30, (codes, took, text)  # a requested stop everywhere
    assert "tllm: server stopped" in text and "Traceback" not in text, text
    assert "Exception raised from" not in text, text  # no C++ stack of torch's store client
    for cli, kids in pids.items():
        assert descendants(cli, settle=5) == [], (kids, text)


@pytest.mark.vllm
@pytest.mark.slow  # two node processes up to their distributed init: ~1 min
def test_follower_with_other_consumers_is_refused_naming_both_sides(even_model, tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two node processes need 2 CPU cores (one rank each)")
    leader, follower, _ = _nodes(
        even_model, ["--consumer", "stats"], tmp_path, follower_consumers=["--consumer", "esamp"]
    )
    codes = exit_codes([leader, follower], 300)
    for name in ("leader", "follower"):
        log = (tmp_path / f"{name}.log").read_text()
        assert "tllm settings differ between the nodes" in log, (name, log[-4000:])
        assert '"name": "stats"' in log and '"name": "esamp"' in log, (name, log[-4000:])
    assert all(c not in (0, None) for c in codes), codes
    assert descendants(leader.pid, settle=30) == descendants(follower.pid, settle=30) == []


def _dp_nodes(model, consumers, tmp_path, follower_consumers=None, api_only=False):
    """Data parallel across two nodes: the leader (DP rank 0, its API server, core 0) and a
    headless follower (DP rank 1, core 1), each with one engine (``api_only``: the leader runs
    the API server alone, ``--data-parallel-size-local 0``, the follower both engines); the
    follower checks its leader every 2 s."""
    port, rpc = free_port(), free_port()
    common = ["--model", model, "--data-parallel-size", "2", *ENGINE]

    def node(rank, local, cons, log, *extra, cores):
        vllm = ["--data-parallel-size-local", str(local), "--data-parallel-address", "127.0.0.1"]
        vllm += ["--data-parallel-rpc-port", str(rpc), "--enforce-eager"]
        if extra:
            vllm += ["--data-parallel-start-rank", str(rank)]
        argv = ["serve", "-v", "--port", str(port), *common, *cons, *extra, "--", *vllm]
        return start(argv, log, VLLM_CPU_OMP_THREADS_BIND=cores, TLLM_NODE_CHECK_S="2")

    leader = node(0, 1 - api_only, consumers, tmp_path / "leader.log", cores="0")
    follower = node(
        0 if api_only else 1,
        2 if api_only else 1,
        follower_consumers or consumers,
        tmp_path / "follower.log",
        "--headless",
        cores="0|1" if api_only else "1",
    )
    return leader, follower, f"http://127.0.0.1:{port}"


def _post_to(url: str, body: dict, dp_rank: int) -> dict:
    """A request that vLLM's load balancer sends to data-parallel engine ``dp_rank``."""
    req = urllib.request.Request(
        url,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "X-data-parallel-rank": str(dp_rank)},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _export_agrees(model: str, rec) -> None:
    """An exported record: its tokens transformers' greedy choice, its hidden states
    transformers' at 1e-4."""
    from reference import hf_states

    tokens = rec.token_ids.tolist() if hasattr(rec.token_ids, "tolist") else list(rec.token_ids)
    _hf_greedy_agrees(model, tokens, rec.num_prompt_tokens)
    ref = hf_states(model, tokens)
    pos = rec.positions
    for key, got in (("layer.0", rec.hidden["layer.0"]), ("final", rec.hidden["final"])):
        torch.testing.assert_close(got.float(), ref[key][pos], atol=1e-4, rtol=1e-4)


@pytest.mark.vllm
@pytest.mark.slow  # two DP engines on two node processes: 3-5 min on 2 cores
def test_dp2_across_two_nodes_serves_exports_and_the_follower_stops_with_its_leader(
    tiny_model, tmp_path
):
    from concurrent.futures import ThreadPoolExecutor

    from consumers.export import DataParallelExport, open_export

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two node processes need 2 CPU cores (one engine each)")
    out = tmp_path / "exp"
    export = json.dumps({"out": str(out), "layers": [0, "final"]})
    consumers = ["--consumer", "stats", "--consumer", "esamp", "--consumer", f"export:{export}"]
    consumers += ["--per-request"]
    llog, flog = tmp_path / "leader.log", tmp_path / "follower.log"
    shm_before = shm_entries()
    leader, follower, url = _dp_nodes(tiny_model, consumers, tmp_path)
    try:
        wait_for(llog, "tllm: ready", leader, 600)
        status = get_json(f"{url}/tllm/status")
        assert [r["rank"]["dp_rank"] for r in status["ranks"]] == [0, 1]
        assert all(r["installed"] and r["taps"] for r in status["ranks"])  # taps on both nodes

        # One greedy exported request on each engine (ESamp on, beta = 0).
        greedy = {"model": "default", "prompt": "Hello there, how are", "max_tokens": 8}
        greedy |= {"temperature": 0, "ignore_eos": True}
        greedy["vllm_xargs"] = {"tllm_consumers": "stats,export,esamp", "tllm_esamp_beta": 0.0}
        texts = [_post_to(f"{url}/v1/completions", greedy, r)["choices"][0]["text"] for r in (0, 1)]

        def complete(i: int) -> dict:
            xargs = {"tllm_consumers": "stats,esamp", "tllm_esamp_beta": 0.5}
            body = {"model": "default", "prompt": f"Story {i}: once upon a time"}
            body |= {"max_tokens": 8, "ignore_eos": True, "vllm_xargs": xargs}
            return _post(f"{url}/v1/completions", body)

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(complete, range(16)))
        assert all(r["usage"]["completion_tokens"] == 8 for r in results)
        rep = get_json(f"{url}/tllm/counters")
        assert rep["errors"] == []
        finished = [r["runtime"].get("requests_finished", 0) for r in rep["ranks"]]
        assert rep["runtime"]["requests_finished"] == sum(finished) == 18
        assert all(f > 1 for f in finished), f"an engine got only the routed request: {finished}"
        guided = [r["consumers"]["esamp"].get("rows_guided", 0) for r in rep["ranks"]]
        assert all(g > 0 for g in guided), guided  # ESamp trained and guided on both nodes
        assert rep["consumers"]["esamp"]["rows_guided"] == sum(guided) <= 16 * 7
        exported = [r["consumers"]["export"].get("requests", 0) for r in rep["ranks"]]
        follower_pids = {follower.pid, *descendants(follower.pid)}

        # A supervisor stops the leader: it stops cleanly (its engine closes its consumers)
        # and tells the follower (its stop store), which stops on request too.
        os.kill(leader.pid, signal.SIGTERM)
        assert exit_within(leader, 240) == 0, llog.read_text()[-4000:]
        assert "tllm: server stopped" in llog.read_text()  # a requested stop, not a lost node
        code = exit_within(follower, 240)
        log = flog.read_text()
        assert code == 0, log[-4000:]
        assert "the leader stopped; stopping this node" in log, log[-4000:]
        assert "tllm: error" not in log, log[-4000:]
        assert descendants(leader.pid, settle=30) == descendants(follower.pid, settle=30) == []
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                kill_group(p, but="resource_tracker")
            p.wait(30)
    assert texts[0] == texts[1] and texts[0], texts  # the same greedy text on both engines
    # One readable dataset: each engine wrote its part of ``out``, closed as its node stopped.
    exp = open_export(out, verify=True)
    assert isinstance(exp, DataParallelExport) and exp.complete, exported
    records = list(exp.records())
    assert sorted(r.data_parallel_rank for r in records) == [0, 1]
    for rec in records:
        _export_agrees(tiny_model, rec)
    assert leftover_shm(shm_before, pids={leader.pid} | follower_pids) == []


@pytest.mark.vllm
@pytest.mark.slow  # two DP engines on two node processes: 3-5 min on 2 cores
@pytest.mark.parametrize("api_only", [False, True], ids=["engine-on-each-node", "api-server-alone"])
def test_dp2_across_two_nodes_stops_the_leader_when_the_follower_dies(
    tiny_model, tmp_path, api_only
):
    """Also for an API server with no engine of its own (``--data-parallel-size-local 0``),
    whose engines all run on the follower."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two node processes need 2 CPU cores (one engine each)")
    llog = tmp_path / "leader.log"
    shm_before = shm_entries()
    consumers = ["--consumer", "stats"]
    leader, follower, url = _dp_nodes(tiny_model, consumers, tmp_path, api_only=api_only)
    try:
        wait_for(llog, "tllm: ready", leader, 600)
        body = {"model": "default", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
        assert _post_to(f"{url}/v1/completions", body, 1)["usage"]["completion_tokens"] == 4
        leader_pids = {leader.pid, *descendants(leader.pid)}

        assert kill_group(follower, but="resource_tracker")
        code = exit_within(leader, 300)
        log = llog.read_text()
        assert code == 1, log[-4000:]
        assert "2-node engine is gone or hangs" in log, log[-4000:]
        assert descendants(leader.pid, settle=30) == []
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                kill_group(p, but="resource_tracker")
            p.wait(30)
    # OpenMP files named after the killed follower's pids are that node's (as on a dead
    # machine); the leader's own processes leave none, nor shared memory of either node.
    assert leftover_shm(shm_before, pids=leader_pids) == []


@pytest.mark.vllm
@pytest.mark.slow  # two DP engines up to the leader's check: ~2 min on 2 cores
def test_dp_follower_with_other_consumers_is_refused_naming_both_sides(tiny_model, tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two node processes need 2 CPU cores (one engine each)")
    leader, follower, _ = _dp_nodes(
        tiny_model, ["--consumer", "stats"], tmp_path, follower_consumers=["--consumer", "esamp"]
    )
    codes = exit_codes([leader, follower], 400)
    for name in ("leader", "follower"):
        log = (tmp_path / f"{name}.log").read_text()
        assert "tllm settings differ between the nodes" in log, (name, log[-4000:])
        lead, _, other = log.partition("leader (API server, data-parallel rank 0) runs {")[
            2
        ].partition("; data-parallel rank 1 runs {")
        assert '"name": "stats"' in lead and '"name": "esamp"' in other, (name, log[-4000:])
    assert "tllm: error: tllm settings differ" in (tmp_path / "follower.log").read_text()
    assert codes[1] == 1 and codes[0] not in (0, None), codes
    assert descendants(leader.pid, settle=30) == descendants(follower.pid, settle=30) == []


LEADER_SCRIPT = """
import json, sys
from vllm import SamplingParams
from tllm_core import TllmLLM

if __name__ == "__main__":
    model, port = sys.argv[1], int(sys.argv[2])
    llm = TllmLLM(model, ["stats"], tensor_parallel_size=2, nnodes=2, node_rank=0,
                  master_addr="127.0.0.1", master_port=port, enforce_eager=True,
                  max_model_len=256, dtype="float32", enable_prefix_caching=False)
    out = llm.generate(["Hello there, how are"],
                       SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    report = llm.close()
    print(json.dumps({"rank": llm.status["rank"], "prompt": list(out[0].prompt_token_ids),
                      "tokens": list(out[0].outputs[0].token_ids), "report": report},
                     default=str))
"""


@pytest.mark.vllm
@pytest.mark.slow  # a TllmLLM leader and a tllm serve follower: ~2 min on 2 cores
def test_tllmllm_leads_a_headless_follower_that_stops_when_the_leader_closes(even_model, tmp_path):
    import subprocess
    import sys

    from serve_util import ROOT

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two node processes need 2 CPU cores (one rank each)")
    master = free_port()
    flog = tmp_path / "follower.log"
    argv = ["serve", "--port", str(free_port()), "--model", even_model]
    argv += ["--tensor-parallel-size", "2", "--consumer", "stats", *ENGINE, "--headless", "--"]
    argv += ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"]
    argv += ["--master-port", str(master), "--enforce-eager", "--no-enable-prefix-caching"]
    follower = start(argv, flog, VLLM_CPU_OMP_THREADS_BIND="1", TLLM_NODE_CHECK_S="2")
    script = tmp_path / "leader.py"
    script.write_text(LEADER_SCRIPT)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    try:
        leader = subprocess.run(
            [sys.executable, str(script), even_model, str(master)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert leader.returncode == 0, leader.stderr[-4000:]
        out = json.loads(leader.stdout.strip().splitlines()[-1])
        assert out["rank"]["leader"] and out["rank"]["tp_size"] == 2
        assert out["report"]["runtime"]["requests_finished"] == 1  # counted once
        assert out["report"]["consumers"]["stats"]["bundles"] > 0
        _hf_greedy_agrees(even_model, out["prompt"] + out["tokens"], len(out["prompt"]))
        # The leader closed (a requested stop, told through its store): so does the follower.
        code = exit_within(follower, 60)
        log = flog.read_text()
        assert code == 0, log[-4000:]
        assert "the leader stopped; stopping this node" in log, log[-4000:]
        assert "tllm: error" not in log, log[-4000:]
        assert descendants(follower.pid, settle=30) == []
    finally:
        if follower.poll() is None:
            kill_group(follower)
        follower.wait(30)


API_SERVER = "vllm.entrypoints.openai.api_server"
HEADLESS = (
    "import sys\n"
    "from vllm.entrypoints.cli.serve import run_headless\n"
    "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
    "args.api_server_count = 0\n"
    "run_headless(args)\n"
)


@pytest.mark.vllm
@pytest.mark.slow  # two plain vLLM node processes, TP = 2 across them: ~2-3 min on 2 cores
@pytest.mark.parametrize("without_tllm", ["follower", "leader"])
def test_plain_two_node_vllm_with_tllm_on_one_node_only_serves(even_model, tmp_path, without_tllm):
    """A plain multi-node ``vllm serve`` where only one node has tllm installed
    (``VLLM_PLUGINS=`` hides it on the other) starts and answers: tllm installed must not
    change a plain vLLM, and a settings check that only the node with tllm joined hung both."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two node processes need 2 CPU cores (one rank each)")
    port, master = free_port(), free_port()
    procs = {}
    for rank, name in enumerate(("leader", "follower")):
        # What `vllm serve` (its console script fails on vllm-cpu) and `--headless` run.
        python = ("-c", HEADLESS) if rank else ("-m", API_SERVER)
        argv = ["--model", even_model, "--port", str(port), "--tensor-parallel-size", "2"]
        argv += ["--max-model-len", "256"]
        argv += ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
        argv += ["--master-port", str(master), "--enforce-eager", "--served-model-name", "m"]
        argv += ["--headless"] if rank else []
        # Outside vLLM's CLI the platform must be named.
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(rank), "VLLM_CPU_KVCACHE_SPACE": "1"}
        env["VLLM_TARGET_DEVICE"] = "cpu"
        if name == without_tllm:
            env["VLLM_PLUGINS"] = ""  # vLLM loads no plugin there: as if tllm were not installed
        procs[name] = start(argv, tmp_path / f"{name}.log", python, **env)
    try:
        wait_for(tmp_path / "leader.log", "Application startup complete", procs["leader"], 600)
        body = {"model": "m", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        assert _post(f"http://127.0.0.1:{port}/v1/completions", body)["choices"][0]["text"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                kill_group(p)
            p.wait(30)
