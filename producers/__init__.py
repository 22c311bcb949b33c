"""Built-in producers, registered through ``tllm_producers`` as a third-party one would be.
Names import on first use (PEP 562): loading the entry point imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_exports

if TYPE_CHECKING:
    from producers.attention import AttentionOutput
    from producers.mlp import MlpOutput
    from producers.router import RouterLogits, RouterTopK, RouterWeights

__all__, __getattr__ = lazy_exports(__name__, __file__)
