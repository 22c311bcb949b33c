"""MoE routing ports of a decoder layer: :class:`RouterLogits` (editable) and the experts chosen
from them (:class:`RouterTopK`, :class:`RouterWeights`), computed as vLLM's router does with the
settings the bridge read at install (``StepCapture.tap_info``)."""

from __future__ import annotations

from typing import Any

import torch

from tllm_core import LayerPort, Producer, ReadPort, StepCapture, TapRequest


class RouterLogits(LayerPort):
    """Router logits of decoder layer ``layer``'s MoE block (``"router.{i}"``; negative counts
    from the end), fp32 before softmax and top-k; editable through ``Edit(RouterLogits(i))``."""

    prefix = "router"


class RouterTopK(LayerPort):
    """Ids of the experts layer ``layer``'s router chose, heaviest first (int64)."""

    prefix = "router_topk"


class RouterWeights(LayerPort):
    """Weights of the experts of :class:`RouterTopK`, in its order (fp32)."""

    prefix = "router_weights"


def chosen_experts(logits: torch.Tensor, info: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, weights)`` ``[rows, top_k]`` as a softmax-then-top-k router with ``info``'s
    ``top_k`` and ``renormalize`` picks them from ``logits`` (``ValueError`` for another kind)."""
    if info.get("routing") != "softmax_topk" or not info.get("top_k"):
        raise ValueError(
            f"chosen experts are computed for softmax-then-top-k routers only; this model's "
            f"router is {info.get('routing')!r} (top_k {info.get('top_k')}): read 'router.{{i}}'"
        )
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(int(info["top_k"]), dim=-1)
    if info.get("renormalize"):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


class RouterProducer(Producer):
    name = "router"
    ports = (RouterLogits, RouterTopK, RouterWeights)

    def taps(self, port: ReadPort) -> list[TapRequest]:
        return [TapRequest("router", port.layer)]  # type: ignore[attr-defined]

    def read(self, port: ReadPort, step: StepCapture) -> torch.Tensor:
        key = self.taps(port)[0].key
        logits = step.tensor(key)
        if isinstance(port, RouterLogits):
            return logits
        ids, weights = chosen_experts(logits, step.tap_info.get(key, {}))
        return ids if isinstance(port, RouterTopK) else weights

    def edit_tap(self, port: ReadPort) -> TapRequest:
        if not isinstance(port, RouterLogits):
            raise ValueError(
                f"{type(port).__name__} ({port.key}) cannot be edited: edit the router logits "
                f"(RouterLogits, 'router.{{i}}'), from which the experts are chosen"
            )
        return super().edit_tap(port)
