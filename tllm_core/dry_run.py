"""Build consumers against the model's config only, so bad settings fail before vLLM starts."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tllm_core.consumer import ModelInfo
from tllm_core.counters import Counters
from tllm_core.registry import ConsumerSpec, Registry
from tllm_core.settings import ConsumerEntry, RuntimeSettings


def model_info_from_config(model_path: str) -> ModelInfo:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)

    def no_head(_h: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the LM head is not available before the engine starts")

    return ModelInfo(
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        vocab_size=int(cfg["vocab_size"]),
        dtype=torch.float32,
        device=torch.device("meta"),
        lm_head=no_head,
        lm_head_weight=None,
    )


def dry_build(specs: list[ConsumerSpec], model_path: str, registry: Registry) -> None:
    from tllm_core.runtime import build_consumers

    settings = RuntimeSettings(
        consumers=[
            ConsumerEntry(name=s.name, config=s.config, per_request=s.per_request) for s in specs
        ]
    )
    slots = build_consumers(settings, model_info_from_config(model_path), registry, Counters())
    for s in slots:
        s.consumer.close()
