"""Registers the built-in consumers through the ``tllm_consumers`` hook."""

from tllm_core.hookspecs import hookimpl


@hookimpl
def tllm_consumers():

    from consumers.stats import StatsConsumer


    return [StatsConsumer]
