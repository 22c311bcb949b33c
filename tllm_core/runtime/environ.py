"""Setting an environment variable for a block (processes started in it inherit it)."""

from __future__ import annotations

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
