"""pluggy entry point (``[project.entry-points.tllm] esamp``)."""

from __future__ import annotations

from algorithms.esamp.consumer import ESampConsumer
from tllm_core.hookspecs import hookimpl


@hookimpl
def tllm_consumers() -> list[type]:
    return [ESampConsumer]
