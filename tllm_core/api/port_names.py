"""Port names: the one grammar for naming a token port in text (docs/ports.md, "Port names")."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

FINAL = "final"
RESIDUAL = "layer"  # prefix of the residual stream's name: "layer.{i}"

_NAME = re.compile(r"(?:([A-Za-z_]\w*)\.)?(-?\d+)")


@dataclass(frozen=True)
class PortName:
    """A parsed port name: ``prefix`` and layer index (``None`` for ``final``)."""

    prefix: str
    layer: int | None = None

    @property
    def is_residual(self) -> bool:
        return self.prefix == RESIDUAL

    @property
    def is_final(self) -> bool:
        return self.prefix == FINAL

    def short(self) -> str:
        """The shortest spelling: a bare ``{i}`` for the residual stream."""
        return str(self.layer) if self.is_residual else str(self)

    def __str__(self) -> str:
        return format_port_name(self.prefix, self.layer)


def format_port_name(prefix: str, layer: int | None = None) -> str:
    """The canonical name (and bundle/counter key): ``"layer.3"``, ``"attn.-1"``, ``"final"``."""
    if prefix == FINAL:
        return FINAL
    if layer is None:
        raise ValueError(f"port prefix {prefix!r} needs a layer index")
    return f"{prefix}.{int(layer)}"


def parse_port_name(
    value: int | str,
    prefixes: Collection[str] | None = None,
    *,
    final: bool = True,
    what: str = "port",
) -> PortName:
    """Parse a port name. ``prefixes``: the layer-port prefixes allowed besides the residual
    stream (``None``: any identifier); ``ValueError`` names ``what`` and the allowed forms."""
    if isinstance(value, int) and not isinstance(value, bool):
        return PortName(RESIDUAL, value)
    text = value.strip() if isinstance(value, str) else None
    if text == FINAL and final:
        return PortName(FINAL)
    m = _NAME.fullmatch(text) if text is not None else None
    if m is not None:
        prefix = m.group(1) or RESIDUAL
        if prefix == RESIDUAL or prefixes is None or prefix in prefixes:
            return PortName(prefix, int(m.group(2)))
    forms = ["'{i}'", f"'{RESIDUAL}.{{i}}'"] + ([f"'{FINAL}'"] if final else [])
    if prefixes is None:
        forms.append("'<port>.{i}' (e.g. 'attn.3', 'mlp.-1')")
    else:
        forms += [f"'{p}.{{i}}'" for p in sorted(prefixes) if p != RESIDUAL]
    allowed = ", ".join(forms) + " (i a layer index, negative counts from the end)"
    raise ValueError(f"bad {what} {value!r}: expected {allowed}")


def tap_port_name(tap_key: str) -> str:
    """The name users see for an engine tap key: ``"residual.12"`` -> ``"layer.12"``."""
    site, dot, layer = tap_key.partition(".")
    return f"{RESIDUAL if site == 'residual' else site}{dot}{layer}"
