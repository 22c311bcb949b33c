"""``export``'s per-request results: the bound of a request's rows, checked before it runs."""

from __future__ import annotations

from typing import Any

from tllm_core import PlannedRequest, array_json_bytes, window_rows


def bound(selector: Any, keys: int, itemsize: int, request: PlannedRequest) -> int:
    """JSON bytes of a request's result at most: its rows (``selector``: the config's phase
    or window, narrowed by the request's own) times ``keys`` arrays of the hidden size, plus
    positions and token ids."""
    rows = window_rows("export", selector, request)
    width = request.hidden_size
    return keys * array_json_bytes(rows * width, itemsize) + 2 * array_json_bytes(rows, 8)
