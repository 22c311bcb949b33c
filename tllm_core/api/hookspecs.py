"""pluggy hook specifications of the ``tllm`` plugin system (docs/hooks.md)."""

from __future__ import annotations

import argparse

import pluggy

hookspec = pluggy.HookspecMarker("tllm")
hookimpl = pluggy.HookimplMarker("tllm")


@hookspec
def tllm_consumers() -> list[type]:
    """The ``Consumer`` subclasses this plugin provides (once per ``Registry``)."""


@hookspec
def tllm_producers() -> list[type]:
    """The ``Producer`` subclasses this plugin provides (once per ``Registry``)."""


@hookspec
def tllm_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tllm`` subcommands (``subparsers.add_parser`` with a ``func`` default)."""


@hookspec
def tllm_architectures() -> list[object]:
    """The ``SiteSpec`` s and ``ArchitectureSpec`` s this plugin provides."""


@hookspec
def tllm_run_failed(consumers: list, cause: str, started_at: float) -> None:
    """A fault stopped an offline run: mark files written since ``started_at`` incomplete."""
