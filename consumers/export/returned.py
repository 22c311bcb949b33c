"""``export``'s per-request results: the rows of a request that asked (``tllm_results``),
returned with its completion instead of (or besides) being written to files."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tllm_core import max_rows
from tllm_core.api.results import array_json_bytes

# positions and token ids: two int64 per row
META_BYTES_PER_ROW = 16


class ReturnedRows:
    """Rows kept per request (engine id) until its result is taken; at most ``limit`` bytes
    per request (past it the request's result is an error saying so, its rows let go)."""

    def __init__(self, keys: list[str], dtype: torch.dtype, limit: int):
        self.keys = keys
        self.dtype = dtype
        self.limit = int(limit)
        self._rows: dict[str, dict[str, list[Any]]] = {}
        self._bytes: dict[str, int] = {}
        self._over: dict[str, int] = {}
        self._lost: set[str] = set()

    def add(
        self,
        engine_id: str,
        positions: np.ndarray,
        tokens: np.ndarray,
        hidden: dict[str, torch.Tensor],
    ) -> None:
        if engine_id in self._lost:
            return
        if engine_id in self._over:
            self._over[engine_id] += sum(t.numel() * t.element_size() for t in hidden.values())
            return
        kept = self._rows.setdefault(engine_id, {"positions": [], "token_ids": []})
        kept["positions"].append(positions)
        kept["token_ids"].append(tokens)
        size = META_BYTES_PER_ROW * positions.size
        for k in self.keys:
            t = hidden[k]
            t = t.to(self.dtype) if t.is_floating_point() else t.to(torch.int64)
            kept.setdefault(k, []).append(t.detach().to("cpu", copy=True))
            size += t.numel() * t.element_size()
        total = self._bytes[engine_id] = self._bytes.get(engine_id, 0) + size
        if total * 4 // 3 > self.limit:  # base64: what the client would get
            self._rows.pop(engine_id, None)
            self._over[engine_id] = self._bytes.pop(engine_id)

    def take(self, engine_id: str) -> dict[str, Any]:
        """The request's rows (``positions``, ``token_ids`` and one ``[rows, width]`` array
        per key), or an error when they passed the limit; forgotten here."""
        if engine_id in self._lost:
            self._lost.discard(engine_id)
            self._over.pop(engine_id, None)
            return {
                "error": "export: rows of this request were dropped (a full queue: overflow "
                '"drop"); its result would have holes'
            }
        over = self._over.pop(engine_id, None)
        if over is not None:
            return {
                "error": f"export: this request's rows hold more than {over} bytes, past this "
                f"engine's limit of {self.limit} (setting max_result_bytes); ask for a "
                "narrower window or fewer layers",
                "limit": self.limit,
            }
        kept = self._rows.pop(engine_id, None)
        self._bytes.pop(engine_id, None)
        if kept is None:
            return {"positions": np.zeros(0, np.int64), "token_ids": np.zeros(0, np.int64)}
        out: dict[str, Any] = {
            "positions": np.concatenate(kept.pop("positions")),
            "token_ids": np.concatenate(kept.pop("token_ids")),
        }
        for k, parts in kept.items():
            out[k] = torch.cat(parts)
        return out

    def lose(self, engine_id: str) -> None:
        """Rows of the request were dropped (a full queue): its result says so."""
        self._rows.pop(engine_id, None)
        self._bytes.pop(engine_id, None)
        self._lost.add(engine_id)


def bound(
    selector: Any, keys: int, hidden_size: int, itemsize: int, prompt: int, generated: int
) -> int:
    """JSON bytes of a request's result at most: its rows (``selector``: a phase or window)
    times ``keys`` arrays of ``hidden_size`` values, plus positions and token ids."""
    rows = max_rows(selector, prompt, generated)
    return keys * array_json_bytes(rows * hidden_size, itemsize) + 2 * array_json_bytes(rows, 8)
