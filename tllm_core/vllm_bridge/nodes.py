"""Engines across several nodes (``--nnodes``, or remote data-parallel engines): the same tllm
settings on every node (else a collective diverges or hangs), and watches for a lost node."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from tllm_core.runtime.environ import env_seconds
from tllm_core.runtime.notes import NoteFile, named, write_once
from tllm_core.vllm_bridge.errors import EngineNoAnswer, UnsupportedEngineError

log = logging.getLogger("vllm.tllm")

# Per-process fields: notes, the API server's limits, the hung-stop delay and the front end.
LOCAL_FIELDS = ("start_error_file", "fault_file", "server", "hung_stop_s", "front_end")


def comparable(settings: dict[str, Any] | None) -> str:
    """The settings every node must share, as canonical JSON (``"null"``: tllm is off)."""
    if settings is None:
        return "null"
    shared = {k: v for k, v in settings.items() if k not in LOCAL_FIELDS}
    return json.dumps(shared, sort_keys=True, default=str)


def differences(leader: dict[str, Any] | None, mine: dict[str, Any] | None) -> list[str]:
    """Top-level fields whose values differ (``tllm``: one side has no tllm settings)."""
    if leader is None or mine is None:
        return ["tllm"]
    a, b = json.loads(comparable(leader)), json.loads(comparable(mine))
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def differ_message(leader: str, lset: dict | None, other: str, oset: dict | None) -> str:
    """The refusal naming both sides' places and settings."""
    fields = ", ".join(differences(lset, oset))
    return (
        f"tllm settings differ between the nodes of this engine (fields: {fields}): leader "
        f"{leader} runs {comparable(lset)}; {other} runs {comparable(oset)}. Start every "
        "node with the same --consumer options (and --per-request), or tllm on none of them"
    )


SETTINGS_KEY = "tllm/settings/{rank}"
# How long a rank with tllm settings waits for every rank's, and a plain rank for the
# leader's (a leader without tllm writes none; the plain rank then goes on, untouched).
SETTINGS_WAIT_S, PLAIN_WAIT_S = 120.0, 10.0


def check_same_settings(vllm_config: Any, settings: dict[str, Any] | None) -> None:
    """On a worker of a multi-node engine: refuse settings that differ from global rank 0's.
    Through the engine's store, not a collective: a node without tllm joins none, and a
    collective it does not join would hang every node."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    node = int(vllm_config.parallel_config.node_rank)
    compare_settings(store, dist.get_rank(), dist.get_world_size(), node, settings)


def compare_settings(
    store: Any,
    rank: int,
    size: int,
    node: int,
    settings: dict[str, Any] | None,
    waits: tuple[float, float] = (SETTINGS_WAIT_S, PLAIN_WAIT_S),
) -> None:
    """Publish this rank's settings in ``store`` and compare: a rank with settings against
    every rank's, a plain rank (None) against the leader's only, if it has tllm."""
    keys = [SETTINGS_KEY.format(rank=r) for r in range(size)]
    store.set(keys[rank], json.dumps([node, settings], default=str))
    if settings is None and rank == 0:
        return
    wanted = keys if settings is not None else keys[:1]
    if not _keys_within(store, wanted, waits[settings is None]):
        if settings is None:
            return  # a leader without tllm: nothing to compare, this rank stays plain
        who = "some ranks"
        with contextlib.suppress(Exception):  # the store's server (rank 0) may be gone
            who = f"ranks {[r for r, k in enumerate(keys) if not store.check([k])]}"
        raise UnsupportedEngineError(
            f"{who} of this multi-node engine did not tell their tllm settings within "
            f"{waits[0]:g} s: install tllm on every node and start each with the same tllm "
            "options, or tllm on none of them"
        )
    seen = [json.loads(store.get(k)) for k in wanted]
    lnode, lset = seen[0]
    for r, (onode, oset) in enumerate(seen) if settings is not None else [(rank, (node, None))]:
        if comparable(oset) != comparable(lset):
            other = f"node_rank {onode} (rank {r})"
            raise UnsupportedEngineError(differ_message(f"node_rank {lnode}", lset, other, oset))


def _keys_within(store: Any, keys: list[str], timeout: float) -> bool:
    """Whether ``keys`` are all in ``store`` within ``timeout`` s (polled: torch's own wait logs
    a warning when it times out, and a plain vLLM with tllm installed must not)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if store.check(keys):
                return True
        except Exception:  # noqa: BLE001 - the store's server is gone: they never will be
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


# -- a lost node: an engine notices one only at its next collective (a dead remote DP engine
# hangs every request), so the leader's API server runs :func:`node_check` every few seconds.
NODE_CHECK_ENV = "TLLM_NODE_CHECK_S"
NODE_CHECK = "tllm_node_check"  # the workers' method (worker_ext)
NODE_CHECK_INTERVAL_S = 5.0
# An answer slower than this (a peer that hangs rather than dies) counts as a lost node.
NODE_CHECK_TIMEOUT_S = 30.0
# Past the workers' barrier bound, the engine core gives up its wait for their answers (a
# hung node's ranks never answer), then the server: so that when the engine stops, neither
# its core nor a worker is held in the check, and the workers close their consumers.
NODE_RPC_MARGIN_S, NODE_ANSWER_MARGIN_S = 5.0, 10.0


def node_check(timeout_s: float) -> int:
    """On a worker: a barrier over every rank, bounded by ``timeout_s`` (it fails when a peer
    is gone, and a dead machine's peer may never answer); its rank."""
    from datetime import timedelta

    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    try:
        dist.barrier(group=group.cpu_group, async_op=True).wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RuntimeError(
            f"rank {group.rank}: no barrier with the other {group.world_size - 1} ranks "
            f"(bound {timeout_s:g} s): {e}"
        ) from None
    return int(group.rank)


def check_bound(step_s: float) -> float:
    """Seconds the workers' barrier waits (``step_s``: how long a step may hold the check)."""
    return NODE_CHECK_TIMEOUT_S + step_s


async def ask_node_check(rpc_all: Callable[..., Any], engine_client: Any, bound: float) -> Any:
    """The node check on every rank of every engine (``serving.rpc_all``), the barrier bounded
    by ``bound`` s and the engine core's wait for the answers a little longer. Each answer is
    its rank; any other is a late answer to an earlier call, a rank out of step."""
    wait = bound + NODE_RPC_MARGIN_S
    answers = await rpc_all(engine_client, NODE_CHECK, bound, timeout=wait)  # bounded: wait
    late = [a for a in answers if type(a) is not int]
    if late:
        raise RuntimeError(f"{len(late)} rank(s) answered an earlier call late: {late!r:.200}")
    return answers


def node_lost(nnodes: int, why: str) -> str:
    """The reason a lost node stops the server, with what showed it."""
    return f"a node of this {nnodes}-node engine is gone or hangs ({why})"


def check_interval() -> float:
    """Seconds between two node checks (``TLLM_NODE_CHECK_S``; 0 switches them off)."""
    return env_seconds(NODE_CHECK_ENV, NODE_CHECK_INTERVAL_S, zero="off")


def stop_self(what: str) -> Any:
    """An ``on_lost(reason)`` that logs and SIGTERMs this process (vLLM's graceful stop)."""

    def on_lost(reason: str) -> None:
        log.error("tllm: %s; stopping %s", reason, what)
        os.kill(os.getpid(), signal.SIGTERM)

    return on_lost


def node_count(parallel: Any) -> int:
    """Nodes an engine spans as its API server sees it (TP ``nnodes``, or remote DP engines;
    with none local, ``--data-parallel-size-local 0``, at least this node and one other)."""
    nnodes = int(getattr(parallel, "nnodes", 1) or 1)
    if remote_engines(parallel):
        dp_local = int(parallel.data_parallel_size_local)
        dp = int(getattr(parallel, "data_parallel_size", 1) or 1)
        nnodes = max(nnodes, -(-dp // dp_local) if dp_local else 2)
    return nnodes


# -- a lost leader: a headless follower waits for it without limit, so it probes the leader's
# TCP store; a requested stop: the leader sets STOP_KEY there (exit 0 on followers).
LEADER_MISSES = 3
STOP_KEY = "tllm/leader-stopping"
STOP_POLL_S = 0.5
STORE_TIMEOUT_S = 5.0


def _store(host: str, port: int) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=STORE_TIMEOUT_S)
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)


def leader_store(
    nnodes: Any, node_rank: Any, master_addr: Any = None, master_port: Any = None
) -> tuple[str, int] | None:
    """Where node rank 0's engine store listens (None: not a multi-node leader)."""
    if int(nnodes or 1) <= 1 or int(node_rank or 0) != 0:
        return None
    return str(master_addr or "127.0.0.1"), int(master_port or 29501)


def announce_stop(host: str, port: int) -> bool:
    """On the leader: set :data:`STOP_KEY` in the engine's store; False when unreachable."""
    try:
        _store(host, port).set(STOP_KEY, "requested")
    except Exception:  # noqa: BLE001 - no store (engine not up yet, or gone): nothing to tell
        return False
    return True


def leader_reachable(host: str, port: int, timeout: float = 5.0) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class NodeWatch:
    """This process's node watches: the first lost node, or a stop on request (after which a
    peer that stops answering is no lost node)."""

    def __init__(self) -> None:
        self._lost: list[str] = []
        self._stopping = threading.Event()
        self.note: Any = None  # a headless node's (shared_note): what its engines told
        self.leader_watch: threading.Thread | None = None  # the one watch_leader thread
        # Where the leader tells its followers of its stop; a DP leader's store for it (kept).
        self.followers_store: tuple[str, int] | None = None
        self.beacon: Any = None

    def stop(self) -> None:
        """Stop on request; tell a leader's followers (from a thread: signal handlers call it)."""
        first = not self._stopping.is_set()
        self._stopping.set()
        if first and self.followers_store is not None:
            threading.Thread(
                target=announce_stop,
                args=self.followers_store,
                daemon=True,
                name="tllm-announce-stop",
            ).start()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def lost(self) -> str | None:
        """Why this node stops on its own (a lost node, or what its engines told), else None."""
        if self._lost:
            return self._lost[0]
        told = None if self.note is None else self.note.read() or None
        return None if told == STOP_REQUESTED else told

    def report(self, reason: str, on_lost: Any) -> None:
        """A lost node: ``on_lost(reason)`` once (not during a requested stop)."""
        if not self.stopping and not self._lost:
            self._lost.append(reason)
            on_lost(reason)

    async def watch_nodes(
        self, ask: Any, nnodes: int, interval: float, on_lost: Any, step_s: float = 0.0
    ) -> None:
        """Every ``interval`` s ``await ask(bound)``, ``bound`` the workers' barrier bound in s;
        the first failure or timeout calls ``on_lost``. ``step_s``: how long a step may hold
        the check (it waits behind the engine's steps: a consumer callback within its deadline
        is no lost node)."""
        bound = check_bound(step_s)
        while True:
            await asyncio.sleep(interval)
            try:
                await asyncio.wait_for(ask(bound), timeout=bound + NODE_ANSWER_MARGIN_S)
            except Exception as e:  # noqa: BLE001 - any failure of the check means a lost node
                why = "no answer" if isinstance(e, asyncio.TimeoutError) else type(e).__name__
                self.report(node_lost(nnodes, f"the node check got {why}: {str(e)[:300]}"), on_lost)
                return

    def watch_leader(
        self, host: str, port: int, interval: float, on_lost: Any, on_stop: Any = None
    ) -> threading.Thread:
        """A daemon thread probing the leader every ``interval`` s: once it answered,
        :data:`LEADER_MISSES` failed probes in a row call ``on_lost(reason)``. With ``on_stop``,
        its store going away after it announced a stop calls :meth:`stop` and ``on_stop()``."""

        def run() -> None:
            misses, seen, store, announced = 0, False, None, False
            while True:
                if store is not None:
                    # Probed first: a read on a closed store has torch log a C++ stack trace.
                    state = None  # whether the leader announced a stop (None: no answer)
                    if leader_reachable(host, port, 1.0):
                        with contextlib.suppress(Exception):  # a closed store: the leader is gone
                            state = bool(store.check([STOP_KEY]))
                    if state is None and announced:
                        if not self.stopping:
                            self.stop()
                            on_stop()
                        return
                    if self.stopping:
                        return
                    if state is not None:
                        announced = announced or state
                        time.sleep(STOP_POLL_S)
                        continue
                    store = None  # gone without a word: the probes count the misses
                else:
                    time.sleep(interval)
                if leader_reachable(host, port):
                    misses, seen = 0, True
                    if on_stop is not None:
                        with contextlib.suppress(Exception):  # not a store: probes only
                            store = _store(host, port)
                elif seen:  # a leader not up yet is waited for (vLLM's own start timeout)
                    misses += 1
                if self.stopping:
                    return
                if misses >= LEADER_MISSES:
                    reason = (
                        f"the leader of this multi-node engine ({host}:{port}) is gone: "
                        f"{misses} connection attempts {interval:g} s apart were refused"
                    )
                    self.report(reason, on_lost)
                    return

        self.leader_watch = threading.Thread(target=run, daemon=True, name="tllm-leader-watch")
        self.leader_watch.start()
        return self.leader_watch


# -- why a headless node stops: its ``tllm serve`` names a note in NOTE_ENV ("{pid}:{path}");
# the first engine process to :func:`tell` writes the reason there and SIGTERMs that pid.
NOTE_ENV = "TLLM_NODE_NOTE"
# What an engine tells when its leader stopped on request: this node stops too (exit 0).
STOP_REQUESTED = "the leader stopped on request"


@contextlib.contextmanager
def shared_note() -> Iterator[NoteFile]:
    """In the node's command: an empty note named in :data:`NOTE_ENV` while inside."""
    note = NoteFile("tllm-node-")
    try:
        with note.shared(NOTE_ENV):
            yield note
    finally:
        note.close()


def tell(reason: str, kill: Callable[[int, int], None] = os.kill) -> bool:
    """In an engine process: write ``reason`` to the note and SIGTERM the node's command
    (unless another told first, or no note); whether it told."""
    note = named(NOTE_ENV)
    if note is None or not write_once(note[1], reason):
        return False
    kill(note[0], signal.SIGTERM)
    return True


# -- remote data-parallel engines (``tllm serve --headless``): the leader's API server sends
# each its settings and an address to watch (``tllm_join_leader``); one whose settings differ
# refuses, a headless node's stops its node when the leader is gone or stopped on request.

# A refusing engine tells its node this much later: its answer reaches the leader first.
TELL_DELAY_S = 2.0
LEADER_NAME = "(API server, data-parallel rank 0)"
WILDCARDS = ("0.0.0.0", "::", "*", "")


def remote_engines(parallel: Any) -> bool:
    """Whether some data-parallel engines of this server run on other nodes."""
    dp = int(getattr(parallel, "data_parallel_size", 1) or 1)
    local = getattr(parallel, "data_parallel_size_local", None)
    return local is not None and 0 <= int(local) < dp


def parse_tcp(endpoint: str) -> tuple[str, int] | None:
    """``("host", port)`` of a ZMQ ``tcp://host:port`` endpoint; None for another transport."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def leader_endpoint(engine_client: Any) -> tuple[str, int] | None:
    """Where the leader's engine client receives from its engines."""
    import zmq

    sock = getattr(getattr(engine_client, "engine_core", None), "input_socket", None)
    if sock is None:
        return None
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    return parse_tcp(raw.decode() if isinstance(raw, bytes) else str(raw))


# Marks a leader address that is a stop store (else it is only probed).
STOP_STORE = "stop-store"


def stop_beacon(endpoint: tuple[str, int] | None, watch: NodeWatch) -> tuple | None:
    """On the leader's API server: a TCP store (kept in ``watch``) to announce its stop; the
    address followers watch, ``(host, store port, STOP_STORE)``, else ``endpoint``."""
    if endpoint is None:
        return None
    try:
        import torch.distributed as dist

        # The store listens on every interface; the host named here is this process's own.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - no store: followers probe the engine socket only
        log.warning("tllm: no stop store for the followers (%s: %s)", type(e).__name__, e)
        return endpoint
    watch.beacon = store
    watch.followers_store = ("127.0.0.1", int(store.port))
    return endpoint[0], int(store.port), STOP_STORE


async def check_followers(
    engine_client: Any,
    rpc: Callable[..., Awaitable[list[Any]]],
    settings: dict | None,
    watch: NodeWatch | None = None,
) -> None:
    """On a leader's API server with remote engines: every engine takes the leader's
    ``settings``, or the server refuses to start naming both (``rpc``: ``serving.answered``)."""
    if not remote_engines(engine_client.vllm_config.parallel_config):
        return
    endpoint = leader_endpoint(engine_client)
    if watch is not None:
        endpoint = stop_beacon(endpoint, watch)
    try:
        # bounded: rpc is serving.answered (engine_answer_s)
        answers = await rpc(engine_client, "tllm_join_leader", settings, endpoint)
    except EngineNoAnswer:
        raise  # a slow engine, not one without tllm: the error names the call
    except Exception as e:  # noqa: BLE001 - an engine without tllm has no such method
        raise UnsupportedEngineError(
            "an engine of this data-parallel server did not take the leader's tllm settings "
            f"({type(e).__name__}: {str(e)[:300]}); is tllm off on its node? leader "
            f"{LEADER_NAME} runs {comparable(settings)}. Start every node with the "
            "same --consumer options (and --per-request), or tllm on none of them"
        ) from None
    for answer in answers:
        if isinstance(answer, dict) and answer.get("refused"):
            raise UnsupportedEngineError(answer["refused"])


def join_leader(
    mine: dict | None,
    leader: dict | None,
    dp_rank: int,
    endpoint: Any,
    watch: bool,
    kill: Callable[[int, int], None] = os.kill,
    delay: float = TELL_DELAY_S,
    fallback_host: str | None = None,
    *,
    watcher: NodeWatch,
) -> dict[str, Any]:
    """On an engine's worker: ``{"refused": message}`` when the leader's settings differ from
    ``mine`` (a headless node is told to stop), else ``{"watching": bool}``: whether this
    leading rank (``watch``) watches the leader at ``endpoint`` (once per ``watcher``)."""
    if comparable(mine) != comparable(leader):
        msg = differ_message(LEADER_NAME, leader, f"data-parallel rank {dp_rank}", mine)
        if named(NOTE_ENV) is not None:  # under a headless node's command
            log.error("tllm: %s; stopping this node", msg)
            timer = threading.Timer(delay, tell, args=(msg, kill))
            timer.daemon = True
            timer.start()
        return {"refused": msg}
    interval = check_interval()
    if not watch or endpoint is None or interval == 0 or named(NOTE_ENV) is None:
        return {"watching": False}
    if watcher.leader_watch is None:
        host, port, *kind = endpoint
        if str(host) in WILDCARDS:  # bound to every interface: probe where this engine connected
            host = fallback_host or "127.0.0.1"

        def on_lost(reason: str) -> None:
            log.error("tllm: %s; stopping this node", reason)
            tell(reason, kill)

        def on_stop() -> None:  # the leader was asked to stop and has: so is this node
            log.warning("tllm: the leader stopped; stopping this node")
            tell(STOP_REQUESTED, kill)

        stops = on_stop if kind == [STOP_STORE] else None  # a store tells of a stop
        watcher.watch_leader(str(host), int(port), interval, on_lost, stops)
    return {"watching": True}
