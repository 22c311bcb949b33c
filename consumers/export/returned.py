"""``export``'s per-request results: the bound of a request's rows, checked before it runs."""

from __future__ import annotations

from typing import Any

from tllm_core import max_rows
from tllm_core.api.results import array_json_bytes


def bound(
    selector: Any, keys: int, hidden_size: int, itemsize: int, prompt: int, generated: int
) -> int:
    """JSON bytes of a request's result at most: its rows (``selector``: a phase or window)
    times ``keys`` arrays of ``hidden_size`` values, plus positions and token ids."""
    rows = max_rows(selector, prompt, generated)
    return keys * array_json_bytes(rows * hidden_size, itemsize) + 2 * array_json_bytes(rows, 8)
