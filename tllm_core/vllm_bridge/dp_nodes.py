"""Data-parallel engines on several nodes (the others ``tllm serve --headless``): the leader's
API server sends every engine its settings and an address to watch (RPC ``tllm_join_leader``);
an engine whose settings differ refuses, and a headless node's engine stops its node when
the leader is gone (exit 1) or stopped on request (:func:`stop_beacon`'s store, exit 0).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from tllm_core.vllm_bridge import nodes
from tllm_core.vllm_bridge.errors import UnsupportedEngineError

log = logging.getLogger("vllm.tllm")

# A refusing engine tells its node's command this much later, so that its answer reaches the
# leader before the node stops its engines.
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
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def leader_endpoint(engine_client: Any) -> tuple[str, int] | None:
    """Where the leader's engine client receives from its engines (its input socket)."""
    import zmq

    sock = getattr(getattr(engine_client, "engine_core", None), "input_socket", None)
    if sock is None:
        return None
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    return parse_tcp(raw.decode() if isinstance(raw, bytes) else str(raw))


# Marks a leader address that is a stop store (a follower reads the stop key there; the
# engine input socket of an older leader is only probed).
STOP_STORE = "stop-store"


def stop_beacon(endpoint: tuple[str, int] | None, watch: nodes.NodeWatch) -> tuple | None:
    """On the leader's API server: a TCP store (kept in ``watch``) where it announces its stop;
    the address followers watch, ``(host, store port, STOP_STORE)``, else ``endpoint``."""
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
    watch: nodes.NodeWatch | None = None,
) -> None:
    """On a leader's API server with remote engines: every engine takes the leader's
    ``settings``, or the server refuses to start naming both (``rpc``: ``serving.rpc_all``)."""
    if not remote_engines(engine_client.vllm_config.parallel_config):
        return
    endpoint = leader_endpoint(engine_client)
    if watch is not None:
        endpoint = stop_beacon(endpoint, watch)
    try:
        answers = await rpc(engine_client, "tllm_join_leader", settings, endpoint)
    except Exception as e:  # noqa: BLE001 - an engine without tllm has no such method
        raise UnsupportedEngineError(
            "an engine of this data-parallel server did not take the leader's tllm settings "
            f"({type(e).__name__}: {str(e)[:300]}); is tllm off on its node? leader "
            f"{LEADER_NAME} runs {nodes.comparable(settings)}. Start every node with the "
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
    watcher: nodes.NodeWatch,
) -> dict[str, Any]:
    """On an engine's worker: ``{"refused": message}`` when the leader's settings differ from
    ``mine`` (a headless node is told to stop), else ``{"watching": bool}``: whether this
    worker (``watch``: the leading rank) watches the leader at ``endpoint`` (a wildcard host
    becomes ``fallback_host``) through ``watcher`` (at most one leader watch)."""
    if nodes.comparable(mine) != nodes.comparable(leader):
        msg = nodes.differ_message(LEADER_NAME, leader, f"data-parallel rank {dp_rank}", mine)
        if nodes.on_headless_node():
            log.error("tllm: %s; stopping this node", msg)
            timer = threading.Timer(delay, nodes.tell, args=(msg, kill))
            timer.daemon = True
            timer.start()
        return {"refused": msg}
    interval = nodes.check_interval()
    if not watch or endpoint is None or interval == 0 or not nodes.on_headless_node():
        return {"watching": False}
    if watcher.leader_watch is None:
        host, port, *kind = endpoint
        if str(host) in WILDCARDS:  # bound to every interface: probe where this engine connected
            host = fallback_host or "127.0.0.1"

        def on_lost(reason: str) -> None:
            log.error("tllm: %s; stopping this node", reason)
            nodes.tell(reason, kill)

        def on_stop() -> None:  # the leader was asked to stop and has: so is this node
            log.warning("tllm: the leader stopped; stopping this node")
            nodes.tell(nodes.STOP_REQUESTED, kill)

        stops = on_stop if kind == [STOP_STORE] else None  # a store tells of a stop
        watcher.watch_leader(str(host), int(port), interval, on_lost, stops)
    return {"watching": True}
