"""``export``'s per-request results: the bound of a request's rows, checked before it runs."""

from __future__ import annotations

from typing import Any

from tllm_core.api.results import array_json_bytes
from tllm_core.api.rows import window_rows


def bound(
    selector: Any,
    extra_args: dict[str, Any],
    keys: int,
    hidden_size: int,
    itemsize: int,
    prompt: int,
    generated: int,
) -> int:
    """JSON bytes of a request's result at most: its rows (``selector``: the config's phase
    or window, narrowed by the request's own) times ``keys`` arrays of ``hidden_size``
    values, plus positions and token ids."""
    rows = window_rows("export", selector, extra_args, prompt, generated)
    return keys * array_json_bytes(rows * hidden_size, itemsize) + 2 * array_json_bytes(rows, 8)
