"""Data-parallel engines on several nodes, without an engine (``nodes.py``): the
leader's settings compared on every engine, the refusal naming both
sides, a headless node told to stop, and the follower's watch of its leader. The same on two
loopback nodes: tests/test_multinode.py (slow)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from types import SimpleNamespace as NS

import pytest
from serve_util import free_port

from tllm_core.vllm_bridge import nodes
from tllm_core.vllm_bridge.errors import EngineNoAnswer, UnsupportedEngineError

STATS = {"consumers": [{"name": "stats"}], "queue_size": 64, "start_error_file": "/tmp/a"}
ESAMP = {**STATS, "consumers": [{"name": "esamp"}]}


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(nodes.NOTE_ENV, raising=False)
    monkeypatch.setenv(nodes.NODE_CHECK_ENV, "0.05")


def wait_until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_endpoints_and_layouts():
    assert nodes.parse_tcp("tcp://127.0.0.1:5555") == ("127.0.0.1", 5555)
    assert nodes.parse_tcp("tcp://[::1]:7") == ("::1", 7)
    assert nodes.parse_tcp("ipc:///tmp/x") is None
    assert nodes.parse_tcp("tcp://host") is None
    assert nodes.remote_engines(NS(data_parallel_size=2, data_parallel_size_local=1))
    assert not nodes.remote_engines(NS(data_parallel_size=2, data_parallel_size_local=2))
    assert not nodes.remote_engines(NS(data_parallel_size=1, data_parallel_size_local=1))


def test_same_settings_are_taken_and_per_process_fields_ignored():
    mine = {**STATS, "start_error_file": "/tmp/b", "server": {"max_body_bytes": 1}}
    watcher = nodes.NodeWatch()
    answer = nodes.join_leader(mine, STATS, 1, ("127.0.0.1", 1), watch=True, watcher=watcher)
    assert answer == {"watching": False}  # not on a headless node: nothing to stop
    assert watcher.leader_watch is None


def test_other_settings_are_refused_naming_both_sides_and_stop_a_headless_node():
    kills = []
    command = nodes.NodeWatch()  # the node's command's, which reads the note
    with nodes.shared_note() as note:
        command.note = note
        answer = nodes.join_leader(
            ESAMP,
            STATS,
            1,
            None,
            watch=True,
            kill=lambda *a: kills.append(a),
            delay=0.05,
            watcher=nodes.NodeWatch(),
        )
        msg = answer["refused"]
        assert "fields: consumers" in msg
        assert (
            'leader (API server, data-parallel rank 0) runs {"consumers": [{"name": "stats"}]'
            in msg
        )
        assert 'data-parallel rank 1 runs {"consumers": [{"name": "esamp"}]' in msg
        wait_until(lambda: kills)
        assert kills == [(__import__("os").getpid(), signal.SIGTERM)]
        assert command.lost() == msg  # the node's command reports it
    assert command.lost() == msg  # ... also once its note is removed
    # tllm on only one side is a difference too
    refused = nodes.join_leader(None, STATS, 2, None, False, delay=9, watcher=nodes.NodeWatch())
    assert "fields: tllm" in refused["refused"]


def test_the_first_engine_to_tell_stops_the_node_once():
    kills = []
    assert not nodes.tell("no note", kills.append)  # not under a headless node
    with nodes.shared_note() as note:
        assert note.read() == ""
        assert nodes.tell("first", lambda *a: kills.append(a))
        assert not nodes.tell("second", lambda *a: kills.append(a))
        assert note.read() == "first" and len(kills) == 1
    assert note.read() == "first"  # kept once the note is removed
    with nodes.shared_note() as again:  # a new note starts empty
        assert again.read() == ""


def test_a_follower_watches_its_leader_and_stops_once_it_is_gone():
    kills = []
    port = free_port()
    server = socket.create_server(("127.0.0.1", port))
    watcher = nodes.NodeWatch()  # the worker's
    with nodes.shared_note():
        kill = lambda *a: kills.append(a)  # noqa: E731
        assert not nodes.join_leader(
            STATS, STATS, 1, ["127.0.0.1", port], False, kill, watcher=watcher
        )["watching"]  # not the engine's leading rank
        # (a leader bound to every interface is probed where this engine connected)
        answer = nodes.join_leader(
            STATS,
            STATS,
            1,
            ["0.0.0.0", port],
            True,
            kill,
            fallback_host="127.0.0.1",
            watcher=watcher,
        )
        assert answer == {"watching": True}
        first = watcher.leader_watch
        again = nodes.join_leader(STATS, STATS, 1, ["127.0.0.1", port], True, kill, watcher=watcher)
        assert again == {"watching": True} and watcher.leader_watch is first  # one watch
        time.sleep(0.3)
        assert kills == [] and watcher.lost() is None  # the leader answers
        server.close()  # the leader is gone
        wait_until(lambda: kills)
        assert f"the leader of this multi-node engine (127.0.0.1:{port}) is gone" in watcher.lost()
        assert len(kills) == 1


@pytest.mark.parametrize("requested", [True, False], ids=["requested", "gone"])
def test_a_leaders_requested_stop_stops_its_follower_node_without_an_error(requested):
    """The leader's API server holds a stop store (its address is what followers watch); its
    first stop signal sets the stop key there (``NodeWatch.stop``), so once the leader is
    gone the follower's node stops on request (exit 0: no lost leader); a leader gone without
    a word is a lost leader."""
    leader = nodes.NodeWatch()  # the leader's command's
    host, port, kind = nodes.stop_beacon(("127.0.0.1", 5555), leader)
    assert leader.followers_store == ("127.0.0.1", port) and leader.beacon is not None
    kills = []
    command = nodes.NodeWatch()  # the follower node's command's, which reads the note
    with nodes.shared_note() as note:
        command.note = note
        kill = lambda *a: kills.append(a)  # noqa: E731
        answer = nodes.join_leader(
            STATS, STATS, 1, [host, port, kind], True, kill, watcher=nodes.NodeWatch()
        )
        assert answer == {"watching": True}
        time.sleep(0.5)  # the follower has seen its leader
        if requested:
            leader.stop()  # what the leader's first SIGTERM does
            time.sleep(1.5)  # the leader stops its engines; its store is still there
        assert kills == []
        leader.beacon = None  # the leader's process is gone, and its store with it
        wait_until(lambda: kills, timeout=20)
        assert kills == [(__import__("os").getpid(), signal.SIGTERM)]
        if requested:
            assert note.read() == nodes.STOP_REQUESTED and command.lost() is None
        else:
            assert f"({host}:{port}) is gone" in command.lost()


def test_no_watch_when_switched_off(monkeypatch):
    monkeypatch.setenv(nodes.NODE_CHECK_ENV, "0")
    with nodes.shared_note():
        answer = nodes.join_leader(
            STATS, STATS, 1, ("127.0.0.1", 1), True, watcher=nodes.NodeWatch()
        )
        assert answer == {"watching": False}


def _client(dp_local: int):
    parallel = NS(data_parallel_size=2, data_parallel_size_local=dp_local)
    return NS(vllm_config=NS(parallel_config=parallel), engine_core=NS())


def test_the_leader_checks_every_engine_and_refuses_a_differing_one():
    calls = []

    def rpc_answering(*answers):
        async def rpc(client, method, *args):
            calls.append((method, args))
            return list(answers)

        return rpc

    asyncio.run(nodes.check_followers(_client(2), rpc_answering(), STATS))
    assert calls == []  # every engine on this node: nothing to check
    ok = rpc_answering({"watching": False}, {"watching": True})
    asyncio.run(nodes.check_followers(_client(1), ok, STATS))
    assert calls == [("tllm_join_leader", (STATS, None))]
    refusal = rpc_answering({"watching": False}, {"refused": "tllm settings differ ..."})
    with pytest.raises(UnsupportedEngineError, match="tllm settings differ"):
        asyncio.run(nodes.check_followers(_client(1), refusal, STATS))

    async def no_tllm(client, method, *args):
        raise RuntimeError("Call to collective_rpc method failed: no tllm_join_leader")

    with pytest.raises(UnsupportedEngineError, match=r"is tllm off on its node\? leader") as e:
        asyncio.run(nodes.check_followers(_client(1), no_tllm, STATS))
    assert '"name": "stats"' in str(e.value)

    async def slow(client, method, *args):  # serving.answered past its bound
        raise EngineNoAnswer(f"the engine did not answer {method!r} in 0.5 s")

    # A slow engine is not one without tllm: the start fails naming the call, not the setup.
    with pytest.raises(EngineNoAnswer, match="did not answer 'tllm_join_leader' in 0.5 s"):
        asyncio.run(nodes.check_followers(_client(1), slow, STATS))


def test_the_worker_compares_its_own_settings():
    from tllm_core.vllm_bridge.parallel import ParallelInfo
    from tllm_core.vllm_bridge.worker_ext import TllmWorkerExtension

    worker = TllmWorkerExtension()
    worker.vllm_config = NS(additional_config={"tllm": ESAMP})
    worker.model_runner = NS(_tllm_hooks=NS(rank=ParallelInfo(dp_rank=1, dp_size=2)))
    msg = worker.tllm_join_leader(STATS, None)["refused"]
    assert "data-parallel rank 1 runs" in msg and '"esamp"' in msg
    worker.vllm_config = NS(additional_config=json.dumps({"tllm": STATS}))
    assert worker.tllm_join_leader(STATS, None) == {"watching": False}


def test_a_requested_stop_silences_the_watches():
    async def fails(bound):
        raise TimeoutError

    lost = []
    watch = nodes.NodeWatch()
    watch.stop()  # the first stop signal (app.stop.StopSignals.note) calls it
    asyncio.run(watch.watch_nodes(fails, 2, 0.01, lost.append))
    t = watch.watch_leader("127.0.0.1", free_port(), 0.01, lost.append)
    t.join(5)
    assert not t.is_alive() and lost == [] and watch.lost() is None


def test_the_first_stop_signal_stops_the_watches(monkeypatch):
    from tllm_core.app import stop

    signals = stop.StopSignals()
    monkeypatch.setattr(signals, "_watchdog", lambda timeout: None)
    assert not signals.nodes.stopping
    assert signals.note(signal.SIGTERM)
    assert signals.nodes.stopping and signals.received() == signal.SIGTERM


def test_the_http_server_vllm_builds_gets_its_close_bound():
    from tllm_core.vllm_bridge.server_entry import HTTP_CLOSE_S
    from tllm_core.vllm_bridge.serving import bound_http_close

    class Server:  # vLLM's NoSignalServer: installs no signal handler
        def __init__(self, timeout):
            self.config = NS(timeout_graceful_shutdown=timeout)

        def handle_exit(self, sig, frame):
            pass

    async def appears_later(state, server):
        task = asyncio.create_task(bound_http_close(state))
        await asyncio.sleep(0.25)
        state.server = server  # vLLM sets app.state.server just after init_state
        await asyncio.wait_for(task, 5)

    state, server = NS(), Server(None)
    asyncio.run(appears_later(state, server))
    assert server.config.timeout_graceful_shutdown == HTTP_CLOSE_S
    given = Server(30)  # a bound someone chose is kept
    asyncio.run(appears_later(NS(), given))
    assert given.config.timeout_graceful_shutdown == 30
    asyncio.run(bound_http_close(NS(), wait_s=0.2))  # no server: gives up


@pytest.mark.parametrize("text", ["x", "-1", "nan"])
def test_a_bad_node_check_interval_is_refused_naming_it(monkeypatch, text):
    monkeypatch.setenv(nodes.NODE_CHECK_ENV, text)
    with pytest.raises(
        ValueError, match=r"TLLM_NODE_CHECK_S must be a finite number of seconds >= 0"
    ):
        nodes.check_interval()
