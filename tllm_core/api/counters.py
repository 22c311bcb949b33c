"""Functional counters: proof that producers and consumers did their work."""

from __future__ import annotations

import threading
from collections import defaultdict


class Counters:
    """A thread-safe bag of named numbers (counts add up; gauges are set)."""

    def __init__(self) -> None:
        self._values: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def add(self, name: str, value: float = 1, of: str | None = None) -> None:
        """Add ``value`` to ``name`` (``of``: to ``name.{of}`` too, a total and its part)."""
        with self._lock:
            self._values[name] += value
            if of is not None:
                self._values[f"{name}.{of}"] += value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._values[name] = value

    def max(self, name: str, value: float) -> None:
        with self._lock:
            self._values[name] = max(self._values.get(name, value), value)

    def get(self, name: str, default: float = 0) -> float:
        with self._lock:
            return self._values.get(name, default)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {k: (int(v) if float(v).is_integer() else v) for k, v in self._values.items()}
