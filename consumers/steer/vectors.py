"""Loading steering vectors from ``.safetensors`` (``path::key``), ``.pt`` and ``.npy`` files."""

from __future__ import annotations

import os

import numpy as np
import torch

SUFFIXES = (".safetensors", ".pt", ".pth", ".npy")
KEY_SEP = "::"


def _pick(tensors: dict, key: str | None, what: str) -> object:
    if key is not None:
        if key not in tensors:
            raise ValueError(
                f"steering vector {what}: no tensor named {key!r}; it holds: "
                f"{', '.join(sorted(map(str, tensors))) or '(nothing)'}"
            )
        return tensors[key]
    if len(tensors) != 1:
        raise ValueError(
            f"steering vector {what}: holds {len(tensors)} tensors "
            f"({', '.join(sorted(map(str, tensors))) or 'none'}); name one as 'PATH::KEY'"
        )
    return next(iter(tensors.values()))


def load_vector(path: str | os.PathLike, hidden_size: int) -> torch.Tensor:
    """A float32 CPU vector ``[hidden_size]`` from a ``.safetensors``/``.pt``/``.pth`` (one tensor,
    or ``PATH::KEY``) or ``.npy`` file; ``ValueError`` naming the file for anything wrong."""
    what = repr(os.fspath(path))
    file, sep, key = os.fspath(path).rpartition(KEY_SEP)
    if not sep:
        file, key = key, None
    elif not key:
        raise ValueError(f"steering vector {what}: empty key after '::'")
    if not os.path.exists(file):
        raise ValueError(f"steering vector {what}: file {file!r} does not exist")
    if not os.path.isfile(file):
        raise ValueError(f"steering vector {what}: {file!r} is not a file")
    suffix = os.path.splitext(file)[1].lower()
    if suffix not in SUFFIXES:
        raise ValueError(
            f"steering vector {what}: unsupported file type {suffix or '(none)'!r}; "
            f"use one of {', '.join(SUFFIXES)}"
        )
    if key is not None and suffix == ".npy":
        raise ValueError(f"steering vector {what}: '::key' needs a .safetensors or .pt file")
    try:
        if suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(file, framework="pt") as f:
                value = f.get_tensor(_pick({n: n for n in f.keys()}, key, what))  # noqa: SIM118
        elif suffix in (".pt", ".pth"):
            obj = torch.load(file, map_location="cpu", weights_only=True)
            if isinstance(obj, dict):
                value = _pick(obj, key, what)
            elif key is not None:
                raise ValueError(
                    f"steering vector {what}: '::{key}' given but the file holds a "
                    f"{type(obj).__name__}, not a dict of tensors"
                )
            else:
                value = obj
        else:
            value = np.load(file, allow_pickle=False)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - any reader failure becomes a clear config error
        raise ValueError(
            f"steering vector {what}: cannot read {file!r}: {type(e).__name__}: {e}"
        ) from None
    if isinstance(value, np.ndarray):
        if not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)):
            raise ValueError(
                f"steering vector {what}: numeric array expected, got dtype {value.dtype}"
            )
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"steering vector {what}: expected a tensor, got {type(value).__name__}")
    return check_vector(value, hidden_size, what)


def check_vector(value: torch.Tensor, hidden_size: int, what: str = "vector") -> torch.Tensor:
    """``value`` as float32 CPU ``[hidden_size]``; ``ValueError`` on a wrong shape or non-finite."""
    if value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"steering vector {what}: real numbers expected, got dtype {value.dtype}")
    if value.dim() != 1 or value.shape[0] != hidden_size:
        raise ValueError(
            f"steering vector {what}: expected a 1-D vector of size {hidden_size} (the model's "
            f"hidden size), got shape {tuple(value.shape)}"
        )
    value = value.detach().to("cpu", torch.float32).contiguous()
    if not torch.isfinite(value).all():
        raise ValueError(f"steering vector {what}: contains NaN or infinite values")
    return value
