"""pluggy hook specifications of the ``tllm`` plugin system (entry-point group ``tllm``; the
built-ins register through the same hooks). docs/hooks.md has each hook's thread and timing."""

from __future__ import annotations

import argparse

import pluggy

hookspec = pluggy.HookspecMarker("tllm")
hookimpl = pluggy.HookimplMarker("tllm")


@hookspec
def tllm_consumers() -> list[type]:
    """Return the :class:`~tllm_core.api.consumer.Consumer` subclasses this plugin provides.

    Called once per ``Registry``, in every process that builds one; import heavy
    dependencies inside the hook."""


@hookspec
def tllm_producers() -> list[type]:
    """Return the :class:`~tllm_core.api.producer.Producer` subclasses this plugin provides
    (each serves port types by reading the engine taps it names). Called like
    ``tllm_consumers``."""


@hookspec
def tllm_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tllm`` subcommands: ``subparsers.add_parser(...)`` with a ``func`` default that
    takes the parsed arguments and returns an exit status (a ``ValueError`` it raises is
    printed as ``tllm: <message>``, exit status 2). Called while the parser is built, before
    any command runs (``--help`` included): keep it cheap."""


@hookspec
def tllm_architectures() -> list[object]:
    """Return :class:`~tllm_core.api.architectures.SiteSpec` s (a tap site in every decoder
    layer) and :class:`~tllm_core.api.architectures.ArchitectureSpec` s (a family of decoder
    layers with its own site variants). Called like ``tllm_consumers``; a site or layer class
    defined twice is an error naming both."""


@hookspec
def tllm_run_failed(consumers: list, cause: str, started_at: float) -> None:
    """An offline run's engine was stopped by a fault (a process died, a callback hung).

    Called once in the front-end process after the engine is gone: ``consumers`` are the
    run's :class:`~tllm_core.api.consumer_spec.ConsumerSpec` s, ``cause`` the run's error
    line, ``started_at`` the engine's start (``time.time()``; older files are not this
    run's). A consumer that writes files marks them incomplete here."""
