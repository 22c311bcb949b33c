"""Environment variables: one set for a block, and seconds read from one with a clear error."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def env_set(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` within the block; as it was afterwards."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def env_seconds(name: str, default: float, zero: str | None = None) -> float:
    """Seconds from the environment variable ``name`` (``default`` when unset or empty), or an
    error naming it and what is allowed; ``zero``: what 0 means where 0 is allowed."""
    text = os.environ.get(name, "")
    try:
        value = float(text) if text else default
    except ValueError:
        value = math.nan  # refused below, as every comparison with nan is false
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):  # inf: unbounded
        allowed = f">= 0 (0: {zero})" if zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {allowed}, got {text!r}")
    return value
