"""Plots a consumer describes for the run report (:meth:`Consumer.report_plots`): data only."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


@dataclass(frozen=True)
class Series:
    """One line (or one set of bars) of a plot: ``y[i]`` at ``x[i]``."""

    label: str
    x: Sequence[float | str]  # str: categories (bar plots)
    y: Sequence[float]

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(
                f"series {self.label!r}: x has {len(self.x)} values and y {len(self.y)}; "
                "they must have the same length"
            )


@dataclass(frozen=True)
class Plot:
    """A plot of the report. ``name`` is its PNG file's stem (lower case letters, digits,
    ``_.-``); the report prefixes it with the consumer's name."""

    name: str
    title: str
    xlabel: str
    ylabel: str
    series: Sequence[Series] = field(default_factory=tuple)
    kind: Literal["line", "bar"] = "line"
    # Shown under the plot: what it means, in a sentence.
    caption: str = ""
    log_y: bool = False

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"plot name {self.name!r}: allowed are lower case letters, digits and _.- "
                "(it names a PNG file)"
            )
        if self.kind not in ("line", "bar"):
            raise ValueError(f"plot {self.name!r}: kind {self.kind!r}; allowed: 'line', 'bar'")
