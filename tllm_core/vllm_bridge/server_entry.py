"""vLLM's OpenAI server in this process (``tllm serve``): the command's settings and Ctrl-C
handling apply, and the consumers it checked reach the endpoint gate (:data:`CHECKED`)."""

from __future__ import annotations

import runpy
import sys
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from tllm_core.vllm_bridge.nodes import NodeWatch, check_interval, shared_note, stop_self
from tllm_core.vllm_bridge.startup_interrupt import interrupts_reach_caller


@dataclass(frozen=True)
class CheckedServer:
    """Consumers the command checked for ``settings`` (used only when ``--additional-config``
    carries exactly these); ``nodes``: the server's node watches."""

    settings: dict[str, Any]
    engine: Any  # tllm_core.serving.keys.EngineConsumers
    nodes: NodeWatch = field(default_factory=NodeWatch)


CHECKED: ContextVar[CheckedServer | None] = ContextVar("tllm_checked_server", default=None)


def run_openai_server(argv: list[str], checked: CheckedServer | None = None) -> None:
    """Run vLLM's OpenAI server with command-line arguments ``argv`` until it stops (a Ctrl-C
    while the engine starts stops the start); ``--headless``: :func:`run_headless_node`."""
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
    """This node's part of a multi-node engine, no API server (what ``vllm serve --headless``
    runs); ``nodes`` records a lost leader or what this node's engines told."""
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
    # A data-parallel engine of this node tells it to stop through the note (nodes.py).
    with shared_note() as note:
        nodes.note = note
        try:
            run_headless(args)
        except SystemExit:
            if nodes.lost() is None:
                raise
        reason = nodes.lost()
    if reason:  # the leader is gone, or refused: an error, not a requested stop
        # Raised, not returned: the interpreter's exit stops what vLLM left running.
        print(f"tllm: error: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(1)


def _watch_leader(args: Any, watch: NodeWatch) -> None:
    """A TP follower (``--node-rank`` > 0) stops (SIGTERM to itself) when its leader is gone."""
    import logging
    import os
    import signal

    interval = check_interval()
    if int(args.nnodes or 1) <= 1 or int(args.node_rank or 0) == 0 or interval == 0:
        return

    def on_stop() -> None:  # the leader was asked to stop and has: so is this node (exit 0)
        import psutil

        logging.getLogger("vllm.tllm").warning("tllm: the leader stopped; stopping this node")
        # The workers wait for the leader without a timeout: vLLM's stop would wait out its
        # worker grace period, so they are stopped now.
        for child in psutil.Process().children():
            try:
                if "resource_tracker" not in " ".join(child.cmdline()):
                    child.terminate()
            except psutil.Error:
                continue
        os.kill(os.getpid(), signal.SIGTERM)

    watch.watch_leader(
        args.master_addr, int(args.master_port), interval, stop_self("this node"), on_stop
    )


# Seconds the HTTP server waits for open connections once vLLM has stopped its engine.
HTTP_CLOSE_S = 5


def close_http_soon(handler: Any) -> None:
    """Given uvicorn's bound ``Server.handle_exit``, bound its wait for open connections to
    :data:`HTTP_CLOSE_S` (a request whose engine is gone never completes)."""
    config = getattr(getattr(handler, "__self__", None), "config", None)
    if config is not None and getattr(config, "timeout_graceful_shutdown", 0) is None:
        config.timeout_graceful_shutdown = HTTP_CLOSE_S
