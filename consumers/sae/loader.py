"""Read and write SAEs in SAELens's folder layout (SAELens < 6.0 configs too); every problem is
:class:`SAEFileError` naming the file, the field or tensor, and what is allowed."""

from __future__ import annotations

import json
import os
from types import MappingProxyType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from consumers.sae.model import ARCHITECTURES, NORMALIZATIONS, SparseAutoencoder

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"

# SAELens options that need statistics or reshaping this reader does not have.
_REFUSED_NORMALIZATION = MappingProxyType(
    {
        "expected_average_only_in": "its scaling factor is not stored in the SAE folder; fold it "
        "into the weights first (SAELens: sae.fold_activation_norm_scaling_factor(f), which sets "
        "normalize_activations to 'none') and save again",
        "covariance_whitening": "its whitening statistics are not stored in the SAE folder; fold "
        "them into the weights first (SAELens: sae.fold_activation_whitening(...)) and save again",
    }
)


class SAEFileError(ValueError):
    """The SAE folder is missing, malformed or does not fit the model."""


def _int_field(cfg: dict[str, Any], name: str, where: str) -> int:
    v = cfg.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SAEFileError(f"{where}: field {name!r} must be a positive integer, got {v!r}")
    return v


def _bool_field(cfg: dict[str, Any], name: str, default: bool, where: str) -> bool:
    v = cfg.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise SAEFileError(f"{where}: field {name!r} must be true or false, got {v!r}")
    return v


def read_config(path: str) -> dict[str, Any]:
    """The normalized settings of ``cfg.json`` in folder ``path``."""
    where = os.path.join(path, CFG_FILE)
    if not os.path.isfile(where):
        raise SAEFileError(f"{where} is missing: an SAE folder holds {CFG_FILE} and {WEIGHTS_FILE}")
    try:
        with open(where, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise SAEFileError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise SAEFileError(f"{where} must hold a JSON object, got {type(cfg).__name__}")
    # SAELens < 6.0 names
    if "activation_fn" not in cfg and "activation_fn_str" in cfg:
        cfg["activation_fn"] = cfg["activation_fn_str"]
    arch = cfg.get("architecture")
    if arch is None:
        kwargs = cfg.get("activation_fn_kwargs") or {}
        if cfg.get("activation_fn") == "topk" and kwargs.get("k") is not None:
            arch, cfg["k"] = "topk", kwargs["k"]
        else:
            arch = "standard"
    if arch not in ARCHITECTURES:
        raise SAEFileError(
            f"{where}: field 'architecture' is {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    act = cfg.get("activation_fn")
    if arch == "standard" and act not in (None, "relu"):
        raise SAEFileError(
            f"{where}: field 'activation_fn' is {act!r}; a 'standard' SAE is supported with "
            f"'relu' only"
        )
    norm = cfg.get("normalize_activations", "none")
    if norm is None or norm is False:
        norm = "none"
    elif norm is True:
        norm = "expected_average_only_in"  # what SAELens < 6.0 meant by true
    if norm in _REFUSED_NORMALIZATION:
        raise SAEFileError(
            f"{where}: field 'normalize_activations' is {norm!r}, which is not supported: "
            f"{_REFUSED_NORMALIZATION[norm]}"
        )
    if norm not in NORMALIZATIONS:
        raise SAEFileError(
            f"{where}: field 'normalize_activations' is {norm!r}; supported: "
            f"{', '.join(NORMALIZATIONS)}"
        )
    reshape = cfg.get("reshape_activations", "none") or "none"
    if reshape != "none":
        raise SAEFileError(
            f"{where}: field 'reshape_activations' is {reshape!r}; only 'none' is supported "
            f"(per-head 'hook_z' SAEs read attention heads, which tllm does not expose)"
        )
    if cfg.get("finetuning_scaling_factor"):
        raise SAEFileError(f"{where}: field 'finetuning_scaling_factor' is set; not supported")
    out: dict[str, Any] = {
        "architecture": arch,
        "d_in": _int_field(cfg, "d_in", where),
        "d_sae": _int_field(cfg, "d_sae", where),
        "apply_b_dec_to_input": _bool_field(cfg, "apply_b_dec_to_input", True, where),
        "normalize_activations": norm,
        "rescale_acts_by_decoder_norm": False,
        "k": None,
        "metadata": cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {},
    }
    if arch == "topk":
        out["k"] = _int_field(cfg, "k", where)
        out["rescale_acts_by_decoder_norm"] = _bool_field(
            cfg, "rescale_acts_by_decoder_norm", False, where
        )
    return out


def _shapes(arch: str, d_in: int, d_sae: int) -> dict[str, tuple[int, ...]]:
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    if arch == "jumprelu":
        shapes["threshold"] = (d_sae,)
    return shapes


def load_sae(path: str | os.PathLike, d_model: int | None = None) -> SparseAutoencoder:
    """Load and check the SAE in folder ``path`` (fp32, CPU); ``d_model``: the width it will
    read (another ``d_in`` is an error)."""
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.isdir(path):
        raise SAEFileError(f"SAE path {path!r} is not a directory (expected a SAELens folder)")
    cfg = read_config(path)
    d_in, d_sae, arch = cfg["d_in"], cfg["d_sae"], cfg["architecture"]
    if d_model is not None and d_in != d_model:
        raise SAEFileError(
            f"{os.path.join(path, CFG_FILE)}: d_in={d_in} does not match the model's hidden size "
            f"{d_model} at the site"
        )
    where = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(where):
        raise SAEFileError(f"{where} is missing: an SAE folder holds {CFG_FILE} and {WEIGHTS_FILE}")
    try:
        with safe_open(where, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as e:
        raise SAEFileError(f"{where} is not a readable safetensors file: {e}") from None
    if arch == "jumprelu" and "threshold" not in tensors and "log_threshold" in tensors:
        tensors["threshold"] = torch.exp(tensors["log_threshold"].float())
    shapes = _shapes(arch, d_in, d_sae)
    missing = [name for name in shapes if name not in tensors]
    if missing:
        raise SAEFileError(
            f"{where}: missing tensor(s) {', '.join(missing)} (a {arch!r} SAE needs "
            f"{', '.join(shapes)}; the file has {', '.join(sorted(tensors)) or 'none'})"
        )
    checked: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise SAEFileError(
                f"{where}: tensor {name} has shape {list(t.shape)}, expected {list(shape)} "
                f"(d_in={d_in}, d_sae={d_sae} from {CFG_FILE})"
            )
        if not t.is_floating_point():
            raise SAEFileError(f"{where}: tensor {name} has dtype {t.dtype}, expected a float type")
        t = t.float()
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise SAEFileError(f"{where}: tensor {name} has {bad} non-finite value(s) (NaN/inf)")
        checked[name] = t.contiguous()
    if cfg["k"] is not None and cfg["k"] > d_sae:
        raise SAEFileError(f"{os.path.join(path, CFG_FILE)}: k={cfg['k']} exceeds d_sae={d_sae}")
    settings = {k: v for k, v in cfg.items() if k not in ("d_in", "d_sae")}
    return SparseAutoencoder(**checked, **settings)


def save_sae(sae: SparseAutoencoder, path: str | os.PathLike) -> str:
    """Write ``sae`` as a SAELens folder (``cfg.json`` + ``sae_weights.safetensors``)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    names = _shapes(sae.architecture, sae.d_in, sae.d_sae)
    tensors = {k: getattr(sae, k).detach().float().cpu().contiguous() for k in names}
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    cfg: dict[str, Any] = {
        "architecture": sae.architecture,
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": sae.apply_b_dec_to_input,
        "normalize_activations": sae.normalize_activations,
        "reshape_activations": "none",
        "metadata": dict(sae.metadata),
    }
    if sae.architecture == "topk":
        cfg["k"] = sae.k
        cfg["rescale_acts_by_decoder_norm"] = sae.rescale_acts_by_decoder_norm
    with open(os.path.join(path, CFG_FILE), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    return path
