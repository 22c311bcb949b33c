"""Ports: what a consumer reads from, and writes into, a running engine (docs/ports.md)."""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Literal

from tllm_core.api.port_names import FINAL, RESIDUAL, format_port_name, parse_port_name
from tllm_core.api.windows import GRAMMAR, LastRow, Selector, Window

ResolveLayer = Callable[[int], int]


class Phase(Selector, str, Enum):
    """Which token rows a read port selects (docs/ports.md, "Rows and phases")."""

    PREFILL = "prefill"
    DECODE = "decode"
    ALL = "all"
    GUIDE = "guide"


class Delivery(str, Enum):
    """When and on which thread a consumer receives its bundles (docs/delivery.md)."""

    END_OF_STEP = "end_of_step"
    BACKGROUND = "background"


class ReadPort:
    """Base of read ports (frozen dataclasses with a ``phase``): ``key`` is the bundle key,
    ``resolve`` the port with absolute layer indices (``ValueError`` on bad ones)."""

    rows: ClassVar[Literal["token", "sample"]]
    phase: Phase

    @property
    def key(self) -> str:
        raise NotImplementedError

    def resolve(self, resolve_layer: ResolveLayer) -> ReadPort:
        return self


class TokenPort(ReadPort):
    """A read port with one row per token row; data in ``Bundle.hidden[port.key]``."""

    rows = "token"


class SamplePort(ReadPort):
    """A read port with one row per kept sampling row; data in ``Bundle.per_sample``."""

    rows = "sample"


@dataclass(frozen=True)
class LayerPort(TokenPort):
    """A token port at one decoder layer, key ``"{prefix}.{layer}"``: subclasses set ``prefix``."""

    prefix: ClassVar[str]
    layer: int
    phase: Phase = Phase.ALL

    def __post_init__(self) -> None:
        _normalise(self, self.prefix)

    @property
    def key(self) -> str:
        return format_port_name(self.prefix, int(self.layer))

    def resolve(self, resolve_layer: ResolveLayer) -> LayerPort:
        return dataclasses.replace(self, layer=resolve_layer(int(self.layer)))


@dataclass(frozen=True)
class HiddenStates(TokenPort):
    """Residual stream after decoder layer ``layer`` (negative: from the end), or ``"final"``."""

    layer: int | Literal["final"]
    phase: Phase = Phase.ALL

    def __post_init__(self) -> None:
        _normalise(self, RESIDUAL, final=True)

    @property
    def key(self) -> str:
        return layer_key(self.layer)

    def resolve(self, resolve_layer: ResolveLayer) -> HiddenStates:
        if self.layer == FINAL:
            return self
        return dataclasses.replace(self, layer=resolve_layer(int(self.layer)))


@dataclass(frozen=True)
class _StepSamplePort(SamplePort):
    """A built-in sample port with a fixed key."""

    phase: Phase = Phase.ALL
    _key: ClassVar[str]

    def __post_init__(self) -> None:
        _normalise(self)

    @property
    def key(self) -> str:
        return self._key


@dataclass(frozen=True)
class Logits(_StepSamplePort):
    """Raw model logits of the sampling rows (before processors and temperature)."""

    _key = "logits"


@dataclass(frozen=True)
class SampledTokens(_StepSamplePort):
    """The token id sampled for each sampling row: ``Bundle.sampled_token_ids``."""

    _key = "sampled"


class WritePort:
    """Base of write ports."""


class PortDeclarationError(TypeError):
    """``reads()`` or ``writes()`` returned something that is no port of that kind."""

    @classmethod
    def of(cls, method: str, port: Any) -> PortDeclarationError:
        """The error for ``port`` returned by ``method`` ("reads" or "writes")."""
        kind, wanted, other = (
            ("read", ReadPort, "write") if method == "reads" else ("write", WritePort, "read")
        )
        hint = ""
        if isinstance(port, WritePort if kind == "read" else ReadPort):
            hint = f"; it is a {other} port: declare it in {other}s()"
        return cls(
            f"{method}() returned {port!r}, which is not a {kind} port ({wanted.__name__}){hint}"
        )


@dataclass(frozen=True)
class Edit(WritePort):
    """Write port: edit token port ``target`` in :meth:`Consumer.edit` (docs/ports.md, "Edit")."""

    target: TokenPort
    transform: Any = dataclasses.field(default=None, kw_only=True, compare=False)


@dataclass(frozen=True)
class ResidualEdit(Edit):
    """Write port: ``Edit(HiddenStates(layer))``, the residual stream after ``layer``."""

    target: TokenPort = dataclasses.field(init=False, repr=False)
    layer: int = 0

    def __post_init__(self) -> None:
        layer = layer_arg(self.layer, RESIDUAL, final=False, port="ResidualEdit")
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "target", HiddenStates(layer))


@dataclass(frozen=True)
class SamplerGuide(WritePort):
    """Write port: change surviving candidates' logits in :meth:`Consumer.guide`."""


def layer_arg(value: Any, prefix: str, *, final: bool, port: str) -> int | str:
    """A port's ``layer`` as stored: an ``int`` (numpy ints too), from ``"{prefix}.{i}"``, or
    ``"final"`` where ``final``; anything else (``"8"``, a float, a bool) is a ``ValueError``."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    if isinstance(value, str):
        text = value.strip()
        if final and text == FINAL:
            return FINAL
        m = re.fullmatch(rf"{re.escape(prefix)}\.(-?\d+)", text)
        if m:
            return int(m.group(1))
    forms = f"an int layer index (negative counts from the end), '{prefix}.{{i}}'"
    forms += " or 'final'" if final else ""
    raise ValueError(f"{port}(layer={value!r}): expected {forms}")


def _normalise(port: ReadPort, prefix: str | None = None, *, final: bool = False) -> None:
    """Check and normalise a frozen port's ``layer`` (with ``prefix``) and ``phase``."""
    name = type(port).__name__
    if prefix is not None:
        layer = layer_arg(getattr(port, "layer"), prefix, final=final, port=name)  # noqa: B009
        object.__setattr__(port, "layer", layer)
    phase = getattr(port, "phase", Phase.ALL)
    object.__setattr__(port, "phase", as_selector(phase, f"{name}(phase={phase!r})"))


def layer_key(layer: int | str) -> str:
    """Bundle key of the residual stream after an absolute layer index, or ``"final"``."""
    return FINAL if layer == FINAL else format_port_name(RESIDUAL, int(layer))


def residual_port(text: str, phase: Phase = Phase.ALL) -> HiddenStates:
    """A residual-stream port from its name (``{i}``, ``layer.{i}``, ``final``)."""
    name = parse_port_name(text, prefixes=())
    return HiddenStates(FINAL if name.is_final else int(name.layer), phase)  # type: ignore[arg-type]


def resolve_layer(layer: int, num_layers: int) -> int:
    """Absolute index for ``layer``; raises ``ValueError`` naming the model's layer count."""
    idx = layer + num_layers if layer < 0 else layer
    if not 0 <= idx < num_layers:
        raise ValueError(
            f"layer index {layer} is out of range: the model has {num_layers} decoder layers "
            f"(valid: {-num_layers}..{num_layers - 1}, negative counts from the end)"
        )
    return idx


def as_selector(value: Any, where: str) -> Any:
    """A port's ``phase`` argument: a ``Phase`` (or its value) or a window (a ``Window`` or
    its text); ``ValueError`` naming ``where`` and the grammar otherwise."""
    if isinstance(value, (Phase, Window, LastRow)):
        return value
    try:  # "prompt" and "generated" name the phases too
        return Phase({"prompt": "prefill", "generated": "decode"}.get(value, value))
    except (ValueError, TypeError):
        pass
    try:
        return Window.parse(value)
    except (ValueError, TypeError):
        allowed = ", ".join(repr(p.value) for p in Phase)
        raise ValueError(f"{where}: expected a Phase ({allowed}) or a window: {GRAMMAR}") from None
