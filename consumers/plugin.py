"""Registers the built-in consumers (``tllm_consumers``) and their commands (``tllm_commands``);
marks their files when a fault stops the run (``tllm_run_failed``)."""

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


WRITERS = ("export", "sae")


@hookimpl
def tllm_run_failed(consumers, cause, started_at):
    from consumers.export.format import mark_run_failed

    for spec in consumers:
        out = spec.config.get("out") if spec.name in WRITERS else None
        if isinstance(out, str) and out.strip():
            mark_run_failed(out, cause, started_at)
