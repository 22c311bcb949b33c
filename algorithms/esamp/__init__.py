"""ESamp (Exploratory Sampling): an online-trained Latent Distiller steers sampling away
from what it already predicts. Names import on first use (PEP 562): the entry point does not
import torch, and the torch-level modules import without pydantic or vLLM."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_exports

if TYPE_CHECKING:
    from algorithms.esamp.config import ESampConfig
    from algorithms.esamp.consumer import ESampConsumer
    from algorithms.esamp.cpu import GroupedDistiller

__all__, __getattr__ = lazy_exports(__name__, __file__)
