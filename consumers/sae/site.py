"""The ``site`` an SAE reads and edits: a port name (grammar: :mod:`tllm_core.api.port_names`).

``{i}`` / ``layer.{i}``: the residual stream after decoder layer ``i``; ``attn.{i}`` /
``mlp.{i}``: the output of layer ``i``'s attention / MLP block. ``final`` is not a site
(an SAE there could not edit it).
"""

from __future__ import annotations

from tllm_core import PortName, parse_port_name

SITE_PREFIXES = ("attn", "mlp")


def parse_site(value: int | str) -> PortName:
    """Parse a site spec; raises ``ValueError`` naming the bad value and the allowed forms."""
    return parse_port_name(value, SITE_PREFIXES, final=False, what="site")
