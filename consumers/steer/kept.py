"""Registered steering vectors kept on disk: one ``NAME.safetensors`` per vector (the vector,
with its layer, mode, scale and normalize as metadata), written atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

SUFFIX = ".safetensors"


def kept_entries(folder: str) -> list[dict[str, Any]]:
    """The vector entries kept in ``folder`` (none when it does not exist yet)."""
    from safetensors import safe_open

    path = Path(folder)
    if not path.is_dir():
        return []
    out = []
    for f in sorted(path.glob(f"*{SUFFIX}")):
        with safe_open(str(f), "pt") as st:
            meta = st.metadata() or {}
        out.append(
            {
                "name": f.name[: -len(SUFFIX)],
                "layer": int(meta.get("layer", "0")),
                "mode": meta.get("mode", "add"),
                "scale": float(meta.get("scale", "1.0")),
                "normalize": meta.get("normalize", "false") == "true",
                "path": str(f),
                "registered": True,
            }
        )
    return out


def keep(folder: str, name: str, vector: torch.Tensor, entry: dict[str, Any]) -> None:
    """Write ``NAME.safetensors`` atomically (a reader never sees half a file)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    meta = {
        "layer": str(entry["layer"]),
        "mode": str(entry.get("mode", "add")),
        "scale": repr(float(entry.get("scale", 1.0))),
        "normalize": "true" if entry.get("normalize") else "false",
    }
    final = Path(folder) / f"{name}{SUFFIX}"
    tmp = final.with_name(f".{name}.{os.getpid()}.tmp")
    save_file({"vector": vector.detach().float().cpu().contiguous()}, str(tmp), metadata=meta)
    os.replace(tmp, final)


def forget(folder: str, name: str) -> None:
    (Path(folder) / f"{name}{SUFFIX}").unlink(missing_ok=True)
