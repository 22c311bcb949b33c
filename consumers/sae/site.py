"""The ``site`` an SAE reads and edits, a port name: ``{i}``/``layer.{i}`` (residual stream
after layer ``i``), ``attn.{i}`` or ``mlp.{i}``; not ``final`` (an SAE there could not edit it)."""

from __future__ import annotations

from typing import Any

from producers import AttentionOutput, MlpOutput
from tllm_core import (
    Edit,
    HiddenStates,
    Phase,
    PortName,
    ReadPort,
    ResidualEdit,
    WritePort,
    parse_port_name,
)

SITE_PREFIXES = ("attn", "mlp")


def parse_site(value: int | str) -> PortName:
    """Parse a site spec; raises ``ValueError`` naming the bad value and the allowed forms."""
    return parse_port_name(value, SITE_PREFIXES, final=False, what="site")


def read_port(site: PortName, phase: Any) -> ReadPort:
    """The read port of ``site`` (absolute layer); ``phase`` a Phase or a capture window."""
    layer = int(site.layer)  # type: ignore[arg-type]  # a site is never 'final'
    if site.is_residual:
        return HiddenStates(layer, phase)
    return (AttentionOutput if site.prefix == "attn" else MlpOutput)(layer, phase)


def edit_port(site: PortName, transform: Any = None) -> WritePort:
    """The write port that edits ``site``: a plain residual edit, or an ``Edit`` of the
    site's tensor with an in-graph per-row ``transform`` (clamps)."""
    if site.is_residual and transform is None:
        return ResidualEdit(int(site.layer))  # type: ignore[arg-type]
    return Edit(read_port(site, Phase.ALL), transform=transform)
