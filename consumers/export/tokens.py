"""What exports keep per request and which rows they write: shared by ``export`` and the
``sae`` feature records (both carry the export layout's request table)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tllm_core import Counters, RowInfo, row_mask


class RequestTokens:
    """One request's entry in the request table plus its token sequence so far."""

    __slots__ = ("index", "info", "tokens", "length")

    def __init__(self, index: int, info: Any):
        self.index = index
        self.info = info
        self.tokens = np.full(max(16, int(info.num_prompt_tokens) + 16), -1, np.int64)
        self.length = 0
        prompt = getattr(info, "prompt_token_ids", None)
        if prompt is not None:
            self.put(np.arange(len(prompt), dtype=np.int64), np.asarray(prompt, np.int64))

    def put(self, positions: np.ndarray, tokens: np.ndarray) -> None:
        if positions.size == 1:  # a decode row: the common case, kept cheap
            self.put_one(int(positions[0]), int(tokens[0]))
            return
        if positions.size == 0:
            return
        end = int(positions.max()) + 1
        if end > self.tokens.shape[0]:
            grown = np.full(max(end, 2 * self.tokens.shape[0]), -1, np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[positions] = tokens
        self.length = max(self.length, end)

    def put_one(self, position: int, token: int) -> None:
        if position >= self.tokens.shape[0]:
            grown = np.full(max(position + 1, 2 * self.tokens.shape[0]), -1, np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[position] = token
        if position >= self.length:
            self.length = position + 1


def rows_to_write(rows: RowInfo, phase: Any, counters: Counters) -> np.ndarray:
    """Mask of the rows ``phase`` (a Phase or a capture window) selects that are not
    recomputation after a preemption (those are counted in ``rows_skipped_recomputed``:
    their position was written already)."""
    wanted = row_mask(
        phase,
        np.asarray(rows.is_decode, np.bool_),
        rows.position,
        lambda: np.array([r.num_prompt_tokens for r in rows.requests], np.int64),
    )
    recomputed = np.asarray(rows.recomputed, np.bool_)
    skipped = int((wanted & recomputed).sum())
    if skipped:
        counters.add("rows_skipped_recomputed", skipped)
    return wanted & ~recomputed


def completeness(closed: bool, losses: dict[str, int]) -> bool:
    """``complete``: closed after its last data, with every request finished on its own,
    no position missing and no bundle dropped."""
    return closed and not any(losses.values())
