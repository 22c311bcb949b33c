"""Registers the built-in consumers (``tllm_consumers``) and their commands (``tllm_commands``)."""

from tllm_core import hookimpl


@hookimpl
def tllm_consumers():
    from consumers.export.consumer import ExportConsumer
    from consumers.sae.consumer import SaeConsumer
    from consumers.stats import StatsConsumer
    from consumers.steer.consumer import SteerConsumer

    return [StatsConsumer, ExportConsumer, SteerConsumer, SaeConsumer]


@hookimpl
def tllm_commands(subparsers):
    from consumers.export.command import add_command as add_export
    from consumers.steer.command import add_command as add_steer

    add_export(subparsers)
    add_steer(subparsers)
