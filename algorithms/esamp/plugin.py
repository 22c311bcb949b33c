"""pluggy entry point (``[project.entry-points.tllm] esamp``)."""

from __future__ import annotations

from tllm_core import hookimpl


@hookimpl
def tllm_consumers() -> list[type]:
    from algorithms.esamp.consumer import ESampConsumer  # torch: only when asked for

    return [ESampConsumer]
