"""Built-in producers: they name the engine taps each port needs and read them per step.

One file per port family; each registers through the ``tllm_producers`` hook
(:mod:`producers.plugin`), exactly as a third-party producer would. The ports declared
here (beside the core's ``HiddenStates``, ``Logits``, ``SampledTokens``):

- :class:`~producers.attention.AttentionOutput` (``attn.{i}``)
- :class:`~producers.mlp.MlpOutput` (``mlp.{i}``)
- :class:`~producers.router.RouterLogits` (``router.{i}``), :class:`~producers.router.RouterTopK`
  (``router_topk.{i}``), :class:`~producers.router.RouterWeights` (``router_weights.{i}``): MoE
  routing

The names are imported on first use (PEP 562): loading the entry point ``producers.plugin``
(which imports this package first) imports no torch, so ``tllm --help`` and a bad consumer
config stay fast.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_getattr

if TYPE_CHECKING:
    from producers.attention import AttentionOutput
    from producers.mlp import MlpOutput
    from producers.router import RouterLogits, RouterTopK, RouterWeights

__all__ = ["AttentionOutput", "MlpOutput", "RouterLogits", "RouterTopK", "RouterWeights"]

_HOME = MappingProxyType(
    {
        "AttentionOutput": "producers.attention",
        "MlpOutput": "producers.mlp",
        "RouterLogits": "producers.router",
        "RouterTopK": "producers.router",
        "RouterWeights": "producers.router",
    }
)

__getattr__ = lazy_getattr(__name__, _HOME)
