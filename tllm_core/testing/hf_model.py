"""A Hugging Face causal LM run by transformers, described as the engine describes the model to
consumers (:class:`~tllm_core.api.consumer.ModelInfo`), and its tap sites as modules."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from tllm_core.api.consumer import ModelInfo
from tllm_core.api.norms import norm_eps, rmsnorm_gain

# Tap sites the kit serves: per layer (module of the decoder layer; None: the layer itself)
# and per step. Router taps need vLLM's MoE runner: not served here.
LAYER_SITES: Mapping[str, str | None] = MappingProxyType(
    {"residual": None, "attn": "self_attn", "mlp": "mlp"}
)
STEP_SITES = ("final", "logits", "sampled")


def load_model(
    model: str | Path | None, dtype: torch.dtype | str = torch.float32, *, shared: bool = False
) -> tuple[Any, Any, str]:
    """``(transformers model, tokenizer, folder)``; ``None``: the embedded model. ``dtype``: a
    torch dtype or its name. ``shared``: the process's one copy of this folder in this dtype
    (weights must then not be changed in place)."""
    if model is None:
        from tllm_core.app.default_model import default_model_path

        model = default_model_path()
    path = str(Path(model).resolve())
    if not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"model {str(model)!r} is not a local Hugging Face folder (no config.json)"
        )
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    hf, tok = (_load_shared if shared else _load)(path, name)
    return hf, tok, path


def _load(path: str, dtype: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return hf, AutoTokenizer.from_pretrained(path)


# A test process's kits share what they load (the slow part of a kit test); at most two.
_load_shared = functools.lru_cache(maxsize=2)(_load)


def decoder_layers(hf: Any) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (``model.layers``)."""
    layers = getattr(getattr(hf, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(hf).__name__}: no decoder layers at model.layers")
    return layers


def final_norm_module(hf: Any) -> nn.Module:
    norm = getattr(getattr(hf, "model", None), "norm", None)
    if not isinstance(norm, nn.Module):
        raise ValueError(f"{type(hf).__name__}: no final norm at model.norm")
    return norm


def site_module(hf: Any, site: str, layer: int) -> nn.Module:
    """The module whose output is tap ``site`` at decoder layer ``layer``."""
    if site not in LAYER_SITES:
        raise ValueError(
            f"the test kit serves tap sites {', '.join([*LAYER_SITES, *STEP_SITES])}; "
            f"{site!r} needs vLLM (run that consumer in an engine)"
        )
    block = decoder_layers(hf)[layer]
    child = LAYER_SITES[site]
    return block if child is None else getattr(block, child)


def lm_head(hf: Any) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor | None]:
    """``(head, weight)``: the final hidden state -> logits as the model computes them (scaling
    and soft-capping included), and the ``[vocab, hidden]`` weight when it is a plain linear."""
    cfg = hf.config.get_text_config()
    linear = hf.get_output_embeddings()
    scaling = float(getattr(cfg, "logits_scaling", 1.0) or 1.0)
    cap = getattr(cfg, "final_logit_softcapping", None)

    def head(h: torch.Tensor) -> torch.Tensor:
        logits = linear(h.to(linear.weight.dtype))
        if scaling != 1.0:
            logits = logits / scaling
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    plain = getattr(linear, "bias", None) is None and scaling == 1.0 and cap is None
    return head, (linear.weight if plain else None)


def final_norm(hf: Any) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor | None]:
    """``(norm, gain)``: the model's final norm, and its gain when it is a plain RMSNorm."""
    norm = final_norm_module(hf)
    w = getattr(norm, "weight", None)
    gain = None
    if isinstance(w, torch.Tensor) and w.dim() == 1:
        with torch.no_grad():
            gain = rmsnorm_gain(norm, w.shape[0], norm_eps(norm), w.dtype, w.device)
    return (lambda h: norm(h)), gain


def model_info(hf: Any) -> ModelInfo:
    """What a consumer is told about the model in an engine, for this transformers model."""
    cfg = hf.config.get_text_config()
    head, weight = lm_head(hf)
    norm, gain = final_norm(hf)
    param = next(hf.parameters())
    return ModelInfo(
        hidden_size=int(cfg.hidden_size),
        num_layers=int(cfg.num_hidden_layers),
        vocab_size=int(cfg.vocab_size),
        dtype=param.dtype,
        device=param.device,
        lm_head=head,
        lm_head_weight=weight,
        final_norm=norm,
        final_norm_weight=gain,
        final_norm_eps=norm_eps(final_norm_module(hf)) if gain is not None else None,
    )
