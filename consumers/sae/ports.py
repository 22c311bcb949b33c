"""The ports of an SAE site: what the ``sae`` consumer reads and where it edits."""

from __future__ import annotations

from typing import Any

from consumers.sae.site import Site
from producers import AttentionOutput, MlpOutput
from tllm_core.ports import Edit, HiddenStates, Phase, ReadPort, ResidualEdit, WritePort


def read_port(site: Site, phase: Phase) -> ReadPort:
    """The read port of ``site`` (absolute layer)."""
    if site.kind == "residual":
        return HiddenStates(site.layer, phase)
    cls = AttentionOutput if site.kind == "attn" else MlpOutput
    return cls(site.layer, phase)


def edit_port(site: Site, transform: Any = None) -> WritePort:
    """The write port that edits ``site``: a plain residual edit, or an ``Edit`` of the
    site's tensor with an in-graph per-row ``transform`` (clamps)."""
    if site.kind == "residual" and transform is None:
        return ResidualEdit(site.layer)
    return Edit(read_port(site, Phase.ALL), transform=transform)
