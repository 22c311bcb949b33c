"""Registers the built-in consumers through the ``tllm_consumers`` hook."""

from tllm_core.hookspecs import hookimpl


@hookimpl
def tllm_consumers():
    from consumers.export.consumer import ExportConsumer
    from consumers.sae.consumer import SaeConsumer
    from consumers.stats import StatsConsumer
    from consumers.steer.consumer import SteerConsumer

    return [StatsConsumer, ExportConsumer, SteerConsumer, SaeConsumer]
