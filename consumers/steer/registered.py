"""Vectors registered on a running server (``POST /tllm/consumers/steer/control``).

A registered vector is a :class:`~consumers.steer.consumer.SteerVector` with
``registered=True``: used only by requests that name it (``tllm_steer_vectors``), removable,
``add`` or ``ablate`` at a layer the server opened at start (``open_layers``, or a configured
vector's layer: the edit ports are fixed when the engine starts). The front end checks a
request (:func:`check_control`) and keeps the names for request validation; the engine
applies it (``SteerConsumer.control``). With ``keep_dir`` each is kept as one
``NAME.safetensors`` file (the vector, with its layer, mode and scale as metadata) and loaded
again at start; without it, registrations end with the server.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tllm_core import ControlError

if TYPE_CHECKING:
    from consumers.steer.consumer import SteerConfig

SUFFIX = ".safetensors"
ADD_FIELDS = frozenset({"name", "layer", "vector", "scale", "mode", "normalize"})


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


def describe(config: SteerConfig) -> list[dict[str, Any]]:
    return [
        {
            "name": v.name,
            "layer": v.layer,
            "mode": v.mode,
            "scale": v.scale,
            "registered": v.registered,
        }
        for v in config.vectors
    ]


def check_control(
    config: SteerConfig, action: str, payload: dict[str, Any]
) -> tuple[SteerConfig, Any]:
    """The front end's check of a control request: ``list``, ``add`` or ``remove``."""
    from pydantic import ValidationError

    from consumers.steer.consumer import SteerVector

    if action == "list":
        return config, describe(config)
    by_name = {v.name: v for v in config.vectors if v.name is not None}
    if action == "remove":
        name = payload.get("name")
        if set(payload) != {"name"} or not isinstance(name, str):
            raise ControlError('"remove" takes {"name": NAME}')
        if name not in by_name:
            raise ControlError(f"no steering vector named {name!r}", 404)
        if not by_name[name].registered:
            raise ControlError(
                f"vector {name!r} was configured at start: it cannot be removed", 409
            )
        vectors = [v for v in config.vectors if v.name != name]
        return config.model_copy(update={"vectors": vectors}), {"removed": name}
    if action != "add":
        raise ControlError(f"unknown action {action!r}; steer takes: list, add, remove")
    extra = set(payload) - ADD_FIELDS
    if extra:
        raise ControlError(
            f"unknown field(s) {', '.join(sorted(extra))}; an added vector takes: "
            f"{', '.join(sorted(ADD_FIELDS))}"
        )
    if not isinstance(payload.get("name"), str):
        raise ControlError('"add" needs a "name"')
    if payload.get("mode", "add") not in ("add", "ablate"):
        raise ControlError("a registered vector is 'add' or 'ablate' (clamps and gates are fixed)")
    if not isinstance(payload.get("vector"), list):
        raise ControlError('"add" needs the vector inline: "vector": [numbers]')
    try:
        entry = SteerVector.model_validate({**payload, "registered": True})
    except ValidationError as e:
        raise ControlError(f"invalid vector: {e}") from None
    if entry.name in by_name:
        raise ControlError(f"a vector named {entry.name!r} exists: remove it first", 409)
    layers = sorted(set(config.open_layers) | {v.layer for v in config.vectors if not v.registered})
    if entry.layer not in layers:
        raise ControlError(
            f"layer {entry.layer} is not open for registered vectors; this server's: "
            f"{', '.join(map(str, layers)) or '(none)'} (steer's open_layers)"
        )
    registered = [v for v in config.vectors if v.registered]
    if len(registered) >= config.max_registered:
        raise ControlError(
            f"{len(registered)} vectors registered: at most {config.max_registered}", 413
        )
    floats = sum(len(v.vector or ()) for v in registered) + len(entry.vector or ())
    if floats * 4 > config.max_registered_mib * (1 << 20):
        raise ControlError(
            f"registered vectors would hold {floats * 4 / (1 << 20):.1f} MiB: at most "
            f"{config.max_registered_mib:g} MiB (steer's max_registered_mib)",
            413,
        )
    return config.model_copy(update={"vectors": [*config.vectors, entry]}), {"added": entry.name}
