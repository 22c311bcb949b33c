"""Capture windows: which token rows of each request a read port selects (docs/ports.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

REGIONS = ("prompt", "generated", "all")
GRAMMAR = (
    "'prompt', 'generated', 'all', 'last_prompt', 'last', or REGION[START:STOP:STEP] with REGION one "
    "of prompt, generated, all (e.g. 'prompt[-1:]', 'generated[0:16]', 'all[::4]'; negative "
    "START/STOP only for prompt)"
)
_SLICE = re.compile(r"^(prompt|generated|all)\[(-?\d*):(-?\d*)(?::(\d*))?\]$")
MAX_INDEX = 1 << 40


class Selector:
    """What selects rows: a Phase, window or :class:`AnyOf`."""

    def union(self, other: Any) -> Any:
        """Rows this or ``other`` (or None) selects; a Phase compared by its value."""
        if other is None or other == self or other == "guide" or self == "all":
            return self
        if self == "guide" or other == "all":
            return other
        if isinstance(self, str) and isinstance(other, str):  # prefill and decode
            return type(self)("all")
        both = (x.parts if isinstance(x, AnyOf) else {x} for x in (self, other))
        return AnyOf(frozenset().union(*both))


@dataclass(frozen=True)
class Window(Selector):
    """Rows of ``region`` whose index in it lies in ``[start:stop:step]`` (a Python slice)."""

    region: str
    start: int | None = None
    stop: int | None = None
    step: int = 1

    def __post_init__(self) -> None:
        if self.region not in REGIONS:
            raise ValueError(f"window region {self.region!r}: expected one of {REGIONS}")
        if self.step < 1:
            raise ValueError(f"window {self}: the step must be >= 1")
        negative = any(v is not None and v < 0 for v in (self.start, self.stop))
        if negative and self.region != "prompt":
            raise ValueError(f"window {self}: negative positions count from the prompt's end")

    @classmethod
    def parse(cls, text: str) -> Window | LastRow:
        """A window from its text (:data:`GRAMMAR`); ``ValueError`` naming it otherwise."""
        s = str(text).strip().replace(" ", "")
        if s == "last_prompt":
            return cls("prompt", -1, None)
        if s == "last":
            return LAST
        m = _SLICE.match(s)
        if m is None:
            raise ValueError(f"window {text!r}: expected {GRAMMAR}")
        region, a, b, k = m.groups()
        values = [int(v) if v not in ("", None) else None for v in (a, b, k)]
        if any(v is not None and abs(v) > MAX_INDEX for v in values):
            # Past int64 the row masks' arithmetic overflows.
            raise ValueError(f"window {text!r}: positions and step must be within +-{MAX_INDEX}")
        return cls(region, values[0], values[1], 1 if values[2] is None else values[2])

    def __str__(self) -> str:
        a = "" if self.start is None else str(self.start)
        b = "" if self.stop is None else str(self.stop)
        k = "" if self.step == 1 else f":{self.step}"
        return f"{self.region}[{a}:{b}{k}]"

    def mask(self, position: np.ndarray, num_prompt: np.ndarray) -> np.ndarray:
        """Which rows (by position and their request's prompt length) the window keeps."""
        position = np.asarray(position, np.int64)
        num_prompt = np.asarray(num_prompt, np.int64)
        if self.region == "prompt":
            inside, index, length = position < num_prompt, position, num_prompt
        elif self.region == "generated":
            inside, index, length = position >= num_prompt, position - num_prompt, None
        else:
            inside, index, length = np.ones(len(position), np.bool_), position, None
        start = _bound(self.start, length)
        keep = inside & (index >= start) & ((index - start) % self.step == 0)
        if self.stop is not None:
            keep &= index < _bound(self.stop, length)
        return keep

    def max_rows(self, prompt: int, generated: int) -> int:
        """At most how many rows of a request (``prompt``, ``generated`` rows) it keeps."""
        length = {"prompt": prompt, "generated": generated, "all": prompt + generated}
        return len(range(*slice(self.start, self.stop, self.step).indices(length[self.region])))


@dataclass(frozen=True)
class LastRow(Selector):
    """Each request's last token row (``"last"``), known only at its finish: delivered then, so
    a step's cut keeps none of its rows (docs/ports.md, "last")."""

    def __str__(self) -> str:
        return "last"

    def mask(self, position: np.ndarray, num_prompt: np.ndarray) -> np.ndarray:
        return np.zeros(len(position), np.bool_)

    def max_rows(self, prompt: int, generated: int) -> int:
        return 1


LAST = LastRow()


def takes_last(selector: Any) -> bool:
    """Whether ``selector`` (a Phase, window or :class:`AnyOf`) takes each request's last row."""
    if isinstance(selector, AnyOf):
        return LAST in selector.parts
    return selector == LAST


def _bound(value: int | None, length: np.ndarray | None) -> Any:
    if value is None:
        return 0
    if value < 0:
        assert length is not None  # only prompt windows take negative bounds
        return np.maximum(length + value, 0)
    return value


@dataclass(frozen=True)
class AnyOf(Selector):
    """Rows any of ``parts`` (phases and windows) selects."""

    parts: frozenset


def window_text(selector: Any) -> str:
    """A selector as text: ``"decode"``, ``"prompt[-1:]"``."""
    if isinstance(selector, AnyOf):
        return " | ".join(sorted(window_text(p) for p in selector.parts))
    value = getattr(selector, "value", None)  # a Phase (no import of ports)
    return str(value) if isinstance(value, str) else str(selector)
