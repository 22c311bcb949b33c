"""pluggy hook specifications of the ``tllm`` plugin system.

A plugin is any module or object with functions marked ``@hookimpl``; third-party
plugins are found through the entry-point group ``tllm``::

    # pyproject.toml of your package
    [project.entry-points.tllm]
    my_plugin = "my_package.plugin"

Built-in consumers, producers and commands register through these same hooks, as
pytest's own plugins do: nothing in ``tllm_core`` names a built-in. Loading
(``tllm_core/plugins/loader.py``): a ``@hookimpl`` named like no hook below is an error naming it
(pluggy's ``check_pending``); a plugin that fails to load is skipped and named once;
``TLLM_PLUGINS`` limits which third-party entry points load. docs/hooks.md has each hook's
and callback's thread, timing and tensor lifetime.
"""

from __future__ import annotations

import argparse

import pluggy

hookspec = pluggy.HookspecMarker("tllm")
hookimpl = pluggy.HookimplMarker("tllm")


@hookspec
def tllm_consumers() -> list[type]:
    """Return the :class:`~tllm_core.api.consumer.Consumer` subclasses this plugin provides.

    Called once per ``Registry``, on the thread building it, in every process that builds one
    (the caller's and the engine's); no tensors. Import heavy dependencies inside the hook.

    Example::

        from tllm_core import Consumer, hookimpl

        class Echo(Consumer):
            name = "echo"
            description = "Counts decode rows."

        @hookimpl
        def tllm_consumers():
            return [Echo]
    """


@hookspec
def tllm_producers() -> list[type]:
    """Return the :class:`~tllm_core.api.producer.Producer` subclasses this plugin provides.

    Called like ``tllm_consumers``: once per ``Registry``, on the thread building it.

    A producer serves one or more port types: it names the taps it needs from the
    engine bridge and reads a step's tapped tensors into the bundle part of a port.

    Example::

        from tllm_core import LayerPort, LayerProducer, hookimpl

        class AttentionOutput(LayerPort):  # key "attn.{layer}", tap site "attn"
            prefix = "attn"

        class AttentionProducer(LayerProducer):  # taps: [TapRequest("attn", port.layer)]
            name = "attention"
            ports = (AttentionOutput,)

        @hookimpl
        def tllm_producers():
            return [AttentionProducer]
    """


@hookspec
def tllm_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tllm`` subcommands (as datasette's ``register_commands`` does).

    Called once, on the ``tllm`` command's main thread, while its parser is built (before any
    command runs, ``--help`` included): keep it cheap.

    Call ``subparsers.add_parser(...)`` and give the new parser a ``func`` default that
    takes the parsed arguments and returns an exit status. A ``ValueError`` raised by
    ``func`` is printed as ``tllm: <message>`` with exit status 2.

    Example::

        from tllm_core import hookimpl

        @hookimpl
        def tllm_commands(subparsers):
            p = subparsers.add_parser("hello", help="say hello")
            p.add_argument("--name", default="world")
            p.set_defaults(func=lambda args: print(f"hello {args.name}") or 0)
    """


@hookspec
def tllm_architectures() -> list[object]:
    """Return :class:`~tllm_core.api.architectures.SiteSpec` s (a tap site in every decoder
    layer) and :class:`~tllm_core.api.architectures.ArchitectureSpec` s (a family of decoder
    layers, by class name, with its own variants of sites) for the engine bridge.

    Called like ``tllm_consumers``: once per ``Registry``, on the thread building it; no
    tensors. The engine checks every port's tap against the merged specs before the first
    step, and wraps each site's module once, after the weights load. The bridge describes
    vLLM's built-in families through this hook too; a site or layer class defined twice is
    an error naming both.

    Example (a read and edit site on each layer's post-attention norm; a producer's
    ``taps`` then asks for ``TapRequest("post_norm", layer)``)::

        from tllm_core import SiteSpec, hookimpl

        @hookimpl
        def tllm_architectures():
            return [SiteSpec("post_norm", ("post_attention_layernorm",), output="first")]
    """


@hookspec
def tllm_run_failed(consumers: list, cause: str, started_at: float) -> None:
    """The engine of an offline run (``TllmLLM``, ``tllm run``, ``tllm export``) was stopped
    by a fault: a process of the engine died, or a consumer callback hung past its deadline.

    Called once, in the front-end process, after every process of the engine is gone (so no
    consumer writes any more): ``consumers`` are the run's
    :class:`~tllm_core.api.consumer_spec.ConsumerSpec` s, ``cause`` is the one line the run
    ended with ("vLLM's engine core (pid 1234) died (killed by SIGKILL); ...") and
    ``started_at`` the wall-clock time (``time.time()``) the engine was started: files older
    than that are not this run's. A consumer that writes files runs in the engine and could
    not say why they stop; mark them here (the built-in ``export`` and ``sae`` consumers set
    ``complete: false`` and ``run_error`` in their manifests). A hook that raises is named
    in a warning; the run's own error is what the caller sees.

    Example::

        from tllm_core import hookimpl

        @hookimpl
        def tllm_run_failed(consumers, cause, started_at):
            for spec in consumers:
                if spec.name == "my_writer":
                    mark_incomplete(spec.config["out"], cause)
    """
