"""Vectors registered on a running server (``POST /tllm/consumers/steer/control``): ``add`` or
``ablate`` at a layer opened at start, used only by requests that name them, removable; kept in
``keep_dir`` when set. The front end checks a request (:func:`check_control`), the engine
applies it (``SteerConsumer.control``)."""

from __future__ import annotations

from typing import Any

from consumers.steer.config import SteerConfig, SteerVector
from tllm_core import ControlError

ADD_FIELDS = frozenset({"name", "layer", "vector", "scale", "mode", "normalize"})


def check_control(
    action: str, payload: dict[str, Any], config: SteerConfig
) -> tuple[SteerConfig, Any]:
    """The front end's check of a control request: ``list``, ``add`` or ``remove``."""
    from pydantic import ValidationError

    if action == "list":
        shown = ("name", "layer", "mode", "scale", "registered")
        return config, [{k: getattr(v, k) for k in shown} for v in config.vectors]
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
