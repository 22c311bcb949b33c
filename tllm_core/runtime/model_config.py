"""A model folder's ``config.json``, checked once before vLLM starts: readable, a JSON object,
with the sizes tllm needs (else ``BadModelConfig``, a ``ValueError`` naming file and key)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

# The sizes tllm reads, each with the other names Hugging Face configs give it.
SIZES: MappingProxyType[str, tuple[str, ...]] = MappingProxyType(
    {
        "hidden_size": ("hidden_size", "n_embd", "d_model"),
        "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
        "vocab_size": ("vocab_size", "padded_vocab_size"),
    }
)


class BadModelConfig(ValueError):
    """A model folder's ``config.json`` that is missing, unreadable, or without a size."""


@dataclass(frozen=True)
class ModelConfig:
    """A checked ``config.json``, its text model's part and the sizes tllm needs."""

    raw: dict[str, Any]
    text: dict[str, Any]
    hidden_size: int
    num_layers: int
    vocab_size: int


def read_model_config(model_path: str, what: str = "model") -> ModelConfig:
    """``model_path``/config.json, checked; ``what``: the folder's name in messages."""
    path = Path(model_path) / "config.json"
    if not path.exists():
        raise BadModelConfig(
            f"{what} {str(model_path)!r} has no config.json: a model folder holds a Hugging "
            "Face config.json, tokenizer and weights"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadModelConfig(f"cannot read the model's config {path}: {e}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadModelConfig(f"the model's config {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise BadModelConfig(
            f"the model's config {path} is not a JSON object (got {type(raw).__name__})"
        )
    cfg = raw.get("text_config", raw)
    if not isinstance(cfg, dict):
        raise BadModelConfig(f"the model's config {path}: 'text_config' is not a JSON object")
    where = f"{path}" + (" (text_config)" if cfg is not raw else "")
    sizes = [_size(cfg, key, names, where) for key, names in SIZES.items()]
    return ModelConfig(raw, cfg, *sizes)


def _size(cfg: dict[str, Any], key: str, names: tuple[str, ...], where: str) -> int:
    name = next((n for n in names if n in cfg), None)
    if name is None:
        needed = ", ".join(SIZES)
        raise BadModelConfig(
            f"the model's config {where} has no {key!r}: tllm needs {needed} "
            "(a Hugging Face config.json has them)"
        )
    value = cfg[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadModelConfig(
            f"the model's config {where}: {name!r} must be a whole number >= 1, got {value!r}"
        )
    return value
