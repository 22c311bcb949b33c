"""Build consumers against the model's config only, so bad settings fail before vLLM starts."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tllm_core.api.consumer import ConsumerConfig, ModelInfo
from tllm_core.api.consumer_spec import ConsumerSpec
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.build_error import DRY
from tllm_core.runtime.model_config import read_model_config
from tllm_core.runtime.runtime import build_consumers


def model_info_from_config(model_path: str) -> ModelInfo:
    cfg = read_model_config(model_path)  # BadModelConfig naming the file and key

    def no_head(_h: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the LM head is not available before the engine starts")

    return ModelInfo(
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size,
        dtype=torch.float32,
        device=torch.device("meta"),
        lm_head=no_head,
        lm_head_weight=None,
    )


def dry_build(
    specs: Sequence[ConsumerSpec],
    configs: Sequence[ConsumerConfig],
    model_path: str,
    registry: Registry,
) -> None:
    """Every consumer's construction from its checked config, on the meta device."""
    model = model_info_from_config(model_path)
    slots = build_consumers(specs, configs, model, registry, where=DRY, model_path=str(model_path))
    for s in slots:
        s.consumer.close()
