"""Ports: what a consumer reads from, and writes into, a running engine.

A port is data: a frozen dataclass that knows its bundle key. A consumer declares its
ports once, at construction; the runtime asks the producer serving each read port which
engine taps it needs, and the bridge installs them before the model is compiled, so
nothing about them can change mid-run.

Built-in read ports here: :class:`HiddenStates`, :class:`Logits`, :class:`SampledTokens`
(served by the producers in ``producers/``). Any package can declare more: subclass
:class:`TokenPort` (one row per token row, e.g. a layer's attention output) or
:class:`SamplePort` (one row per sampling row) and register a producer for it.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Literal

from tllm_core.api.port_names import FINAL, RESIDUAL, format_port_name, parse_port_name
from tllm_core.api.windows import GRAMMAR, LastRow, Window

ResolveLayer = Callable[[int], int]


class Phase(str, Enum):
    """Which token rows a read port selects.

    ``PREFILL`` rows feed a prompt token; ``DECODE`` rows feed a generated token. ``GUIDE``
    selects no row for bundles: the port is read only at guide time (``GuideView.hidden``, at
    the step's sampling rows), so nothing is copied or delivered for ``on_bundle``.
    """

    PREFILL = "prefill"
    DECODE = "decode"
    ALL = "all"
    GUIDE = "guide"

    def selects(self, is_decode: bool) -> bool:
        if self is Phase.GUIDE:
            return False
        return self is Phase.ALL or (self is Phase.DECODE) == is_decode

    def union(self, other: Any) -> Any:
        if other is not None and not isinstance(other, Phase):
            return other.union(self)  # a window (tllm_core/api/windows.py)
        if other is None or other is self or other is Phase.GUIDE:
            return self
        if self is Phase.ALL or other is Phase.ALL:
            return Phase.ALL
        return other if self is Phase.GUIDE else Phase.ALL


class Delivery(str, Enum):
    """When a consumer receives its bundles.

    ``END_OF_STEP``: on the engine thread after sampling, tensors still on the
    device (valid only during the call). ``BACKGROUND``: host copies handed to
    a worker thread through a bounded queue (see ``overflow``).
    """

    END_OF_STEP = "end_of_step"
    BACKGROUND = "background"


class ReadPort:
    """Base of read ports. Subclasses are frozen dataclasses with a ``phase`` field.

    ``key`` is the port's bundle key; ``resolve`` returns the port with absolute layer
    indices (negative indices count from the end), raising ``ValueError`` on bad ones.
    """

    rows: ClassVar[Literal["token", "sample"]]
    phase: Phase

    @property
    def key(self) -> str:
        raise NotImplementedError

    def resolve(self, resolve_layer: ResolveLayer) -> ReadPort:
        return self


class TokenPort(ReadPort):
    """A read port with one row per token row of the step (prompt and generated tokens);
    its data arrive in ``Bundle.hidden[port.key]``."""

    rows = "token"


class SamplePort(ReadPort):
    """A read port with one row per sampling row (rows whose sampled token is kept); its
    data arrive in ``Bundle.per_sample[port.key]``."""

    rows = "sample"


@dataclass(frozen=True)
class LayerPort(TokenPort):
    """A token port at one decoder layer: key ``"{prefix}.{layer}"``; a frozen dataclass
    with fields ``layer`` (negative counts from the end) and ``phase``. A subclass sets the
    class attribute ``prefix`` and nothing else::

        class AttentionOutput(LayerPort):
            prefix = "attn"
    """

    prefix: ClassVar[str]
    layer: int
    phase: Phase = Phase.ALL

    def __post_init__(self) -> None:
        _normalise(self, self.prefix, final=False)

    @property
    def key(self) -> str:
        return format_port_name(self.prefix, int(self.layer))

    def resolve(self, resolve_layer: ResolveLayer) -> LayerPort:
        return dataclasses.replace(self, layer=resolve_layer(int(self.layer)))


LayerSpec = int | Literal["final"]


@dataclass(frozen=True)
class HiddenStates(TokenPort):
    """Residual stream after decoder layer ``layer`` (negative counts from the end),
    or the final hidden state (``layer="final"``: after the final norm, the LM head's input).

    Bundle key: ``"layer.{absolute index}"`` or ``"final"``.
    """

    layer: LayerSpec
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
class Logits(SamplePort):
    """Raw model logits of the rows that sample a token (before processors/temperature).

    Bundle: ``Bundle.logits`` (key ``"logits"``)."""

    phase: Phase = Phase.ALL

    def __post_init__(self) -> None:
        _normalise_phase(self)

    @property
    def key(self) -> str:
        return "logits"


@dataclass(frozen=True)
class SampledTokens(SamplePort):
    """The token id sampled for each sampling row.

    Bundle: ``Bundle.sampled_token_ids`` (key ``"sampled"``)."""

    phase: Phase = Phase.ALL

    def __post_init__(self) -> None:
        _normalise_phase(self)

    @property
    def key(self) -> str:
        return "sampled"


class WritePort:
    """Base of write ports."""


@dataclass(frozen=True)
class Edit(WritePort):
    """Write port: edit the tensor of token port ``target`` (any port whose producer names
    an editable tap, e.g. ``HiddenStates(layer)`` or a layer's attention/MLP output) for
    rows the consumer selects in :meth:`Consumer.edit`. Unselected rows are untouched bit
    for bit.

    ``transform`` (optional, keyword): a ``torch.nn.Module`` run *inside* the forward on the
    tapped tensor, ``transform(s, rows) -> s'`` with ``rows`` a ``[n, 1]`` bool mask of the
    rows the consumer selected this step with ``plan.transform(target, row_idx)``; for edits
    that depend on the row's own value (e.g. clamping an SAE feature). It must use tensor
    operations only (it is traced into the compiled graph) and live on the model's device;
    rows outside the mask are kept bit for bit whatever it returns."""

    target: TokenPort
    transform: Any = dataclasses.field(default=None, kw_only=True, compare=False)


@dataclass(frozen=True)
class ResidualEdit(Edit):
    """Write port: edit the residual stream after decoder layer ``layer`` (shorthand for
    ``Edit(HiddenStates(layer))``)."""

    target: TokenPort = dataclasses.field(init=False, repr=False)
    layer: int = 0

    def __post_init__(self) -> None:
        layer = layer_arg(self.layer, RESIDUAL, final=False, port="ResidualEdit")
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "target", HiddenStates(layer))


@dataclass(frozen=True)
class SamplerGuide(WritePort):
    """Write port: change the logits of the candidates that survive top-k/top-p/min-p,
    for rows the consumer selects in :meth:`Consumer.guide`, in the same step."""


def layer_arg(value: Any, prefix: str, *, final: bool, port: str) -> int | str:
    """The ``layer`` a port constructor was given, as stored: an ``int`` (numpy ints too), the
    port's own name ``"{prefix}.{i}"`` (-> ``i``), or ``"final"`` where ``final``. Anything else
    (a numeral in a string, a float, a bool) raises ``ValueError`` naming the port, the value
    and the accepted forms: ``HiddenStates("8")`` would otherwise be a port keyed by text."""
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


def _normalise(port: ReadPort, prefix: str, *, final: bool) -> None:
    """Check and normalise a frozen port's ``layer`` and ``phase`` in ``__post_init__``."""
    name = type(port).__name__
    layer = layer_arg(getattr(port, "layer"), prefix, final=final, port=name)  # noqa: B009
    object.__setattr__(port, "layer", layer)
    _normalise_phase(port)


def _normalise_phase(port: ReadPort) -> None:
    """``phase``: a Phase, its value, or a capture window (``tllm_core/api/windows.py``)."""
    phase = getattr(port, "phase", Phase.ALL)
    where = f"{type(port).__name__}(phase={phase!r})"
    object.__setattr__(port, "phase", as_selector(phase, where))


def layer_key(layer: int | str) -> str:
    """Bundle key of the residual stream after an absolute layer index, or ``"final"``."""
    return FINAL if layer == FINAL else format_port_name(RESIDUAL, int(layer))


def residual_port(text: str, phase: Phase = Phase.ALL) -> HiddenStates:
    """A residual-stream port (``{i}``, ``layer.{i}``, ``final``) from its name, without a
    registry: what a :class:`ConsumerContext` parses when it has no registry (unit tests)."""
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
    try:
        return Phase(value)
    except ValueError:
        pass
    if value == "prompt":
        return Phase.PREFILL
    if value == "generated":
        return Phase.DECODE
    try:
        return Window.parse(value)
    except (ValueError, TypeError):
        allowed = ", ".join(repr(p.value) for p in Phase)
        raise ValueError(f"{where}: expected a Phase ({allowed}) or a window: {GRAMMAR}") from None
