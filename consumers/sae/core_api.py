"""PLANNED CORE APIS: the only module of the ``sae`` consumer that touches parts of the
core that "Open the core" adds. Everything else codes against the functions here.

Status in this tllm (each function says what it does once the core lands):

* ports ``AttentionOutput(layer, phase)`` / ``MlpOutput(layer, phase)`` from ``producers``
  (bundle keys ``attn.{i}`` / ``mlp.{i}``): :func:`read_port` imports them when present,
  otherwise an ``attn``/``mlp`` site is refused before generation;
* a write port ``Edit(port)`` with ``plan.add(port.key, rows, vec)`` for attn/mlp sites:
  :func:`edit_port` / :func:`plan_add` (residual sites use ``ResidualEdit`` /
  ``plan.add(layer, ...)``, which exist);
* per-request settings (``Request: ClassVar[type[RequestSettings]]``, read with
  ``request.settings(consumer)``): :data:`RequestSettings` and :func:`request_settings`
  (until then: the same keys ``tllm_sae_{field}`` are read from ``extra_args`` and
  validated here);
* clamp steering needs an in-graph edit that depends on the row's pre-edit activation:
  :func:`clamp_supported` is ``False`` until the tap supports one (see
  ``consumers.sae.steer.clamp_delta`` for the math it must run).
"""

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


def edit_port(site: Site) -> Any:
    """The write port that edits ``site``."""
    if site.kind == "residual":
        return ResidualEdit(site.layer)
    return Edit(read_port(site, Phase.ALL))


def plan_add(plan: EditPlan, site: Site, rows: np.ndarray, vector: torch.Tensor) -> None:
    """Ask ``plan`` to add ``vector`` (``[H]`` or ``[len(rows), H]``) at ``site``."""
    plan.add(site.key, rows, vector)


def clamp_supported() -> bool:
    """PLANNED: ``True`` once the tap can run a per-row function of the pre-edit activation
    inside the forward (an "encode-clamp-decode" op registered with the edit)."""
    return False


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
