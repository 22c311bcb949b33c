"""ESamp (Exploratory Sampling): an online-trained Latent Distiller steers sampling away
from what it already predicts. See ``docs`` and the spec for the exact semantics.

The names below are imported lazily: the torch-level modules (``mlp``, ``adam``,
``graph_update``, ``cuda``, ``memory_plan``) must import on a machine without pydantic or
vLLM (the GPU smoke run, ``benchmarks/gpu_smoke.py``)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ESampConfig", "ESampConsumer", "GroupedDistiller"]

_WHERE = {
    "ESampConfig": "algorithms.esamp.config",
    "ESampConsumer": "algorithms.esamp.consumer",
    "GroupedDistiller": "algorithms.esamp.cpu",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'algorithms.esamp' has no attribute {name!r}")
