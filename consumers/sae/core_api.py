"""The parts of the core the ``sae`` consumer uses beyond a plain consumer: the block ports
(``AttentionOutput`` / ``MlpOutput``), the ``Edit`` write port (with an in-graph transform
for clamps), and per-request settings (``tllm_sae_{field}``)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from consumers.sae.site import Site
from producers import AttentionOutput, MlpOutput
from tllm_core.edits import EditPlan
from tllm_core.ports import Edit, HiddenStates, Phase, ResidualEdit

try:  # PLANNED: tllm_core.RequestSettings
    from tllm_core import RequestSettings  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the core version

    class RequestSettings(BaseModel):  # type: ignore[no-redef]
        """Stand-in for ``tllm_core.RequestSettings`` (a pydantic model, unknown keys refused)."""

        model_config = ConfigDict(extra="forbid")


def read_port(site: Site, phase: Phase) -> Any:
    """The read port of ``site`` (absolute layer). Raises ``ValueError`` when this tllm
    has no such port."""
    if site.kind == "residual":
        return HiddenStates(site.layer, phase)
    cls = AttentionOutput if site.kind == "attn" else MlpOutput
    return cls(site.layer, phase)


def edit_port(site: Site, transform: Any = None) -> Any:
    """The write port that edits ``site`` (with an optional in-graph transform)."""
    if site.kind == "residual" and transform is None:
        return ResidualEdit(site.layer)
    return Edit(read_port(site, Phase.ALL), transform=transform)


def plan_add(plan: EditPlan, site: Site, rows: np.ndarray, vector: torch.Tensor) -> None:
    """Ask ``plan`` to add ``vector`` (``[H]`` or ``[len(rows), H]``) at ``site``."""
    plan.add(site.key, rows, vector)


def request_settings(consumer: Any, request: Any) -> BaseModel | None:
    """The validated per-request settings of ``consumer`` for ``request`` (``None``: the
    request set none). Raises ``ValueError`` for bad values (the core answers 400)."""
    getter = getattr(request, "settings", None)
    if callable(getter):  # PLANNED: RequestInfo.settings(consumer)
        return getter(consumer)
    prefix = f"tllm_{consumer.name}_"
    extra = getattr(request, "extra_args", None) or {}
    raw = {k[len(prefix) :]: v for k, v in extra.items() if k.startswith(prefix)}
    if not raw:
        return None
    for k, v in raw.items():  # vllm_xargs carry JSON text for lists/objects
        if isinstance(v, str) and v.strip()[:1] in "[{":
            try:
                raw[k] = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"{prefix}{k}: not valid JSON: {e}") from None
    try:
        return consumer.Request.model_validate(raw)
    except Exception as e:  # pydantic.ValidationError
        keys = ", ".join(prefix + k for k in sorted(raw))
        raise ValueError(f"bad request settings ({keys}): {e}") from None
