"""The ``site`` an SAE reads and edits, named as the export names it.

``{i}`` (or ``"{i}"``): the residual stream after decoder layer ``i``; ``"attn.{i}"`` /
``"mlp.{i}"``: the output of layer ``i``'s attention / MLP block. ``i`` may be negative
(counts from the end).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

SiteKind = Literal["residual", "attn", "mlp"]
_PATTERN = re.compile(r"^(?:(attn|mlp)\.)?(-?\d+)$")
ALLOWED = "'{i}' (residual stream after layer i), 'attn.{i}' or 'mlp.{i}' (negative i counts from the end)"


@dataclass(frozen=True)
class Site:
    kind: SiteKind
    layer: int  # absolute once resolved

    @property
    def key(self) -> str:
        """The bundle / export key of the site."""
        return f"layer.{self.layer}" if self.kind == "residual" else f"{self.kind}.{self.layer}"

    def __str__(self) -> str:
        return str(self.layer) if self.kind == "residual" else f"{self.kind}.{self.layer}"


def parse_site(value: int | str) -> Site:
    """Parse a site spec; raises ``ValueError`` naming the bad value and the allowed forms."""
    if isinstance(value, bool):
        raise ValueError(f"bad site {value!r}: expected {ALLOWED}")
    if isinstance(value, int):
        return Site("residual", value)
    m = _PATTERN.match(str(value).strip())
    if m is None:
        raise ValueError(f"bad site {value!r}: expected {ALLOWED}")
    kind = m.group(1) or "residual"
    return Site(kind, int(m.group(2)))  # type: ignore[arg-type]
