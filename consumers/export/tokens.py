"""What exports keep per request and which rows they write: shared by ``export`` and the
``sae`` feature records (both carry the export layout's request table)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tllm_core import Counters, RowInfo, row_mask


class RequestTokens:
    """One request's entry in the request table plus its token sequence so far, and which
    positions' rows were delivered (``fed``: a prompt position whose row never came, e.g. a
    prefix-cache hit, has its token id from the request but no row)."""

    __slots__ = ("index", "info", "tokens", "fed", "length")

    def __init__(self, index: int, info: Any):
        self.index = index
        self.info = info
        size = max(16, int(info.num_prompt_tokens) + 16)
        self.tokens = np.full(size, -1, np.int64)
        self.fed = np.zeros(size, np.bool_)
        self.length = 0
        prompt = getattr(info, "prompt_token_ids", None)
        if prompt is not None:
            self._store(np.arange(len(prompt), dtype=np.int64), np.asarray(prompt, np.int64))

    def _grow(self, end: int) -> None:
        if end > self.tokens.shape[0]:
            size = max(end, 2 * self.tokens.shape[0])
            tokens, fed = np.full(size, -1, np.int64), np.zeros(size, np.bool_)
            tokens[: self.length] = self.tokens[: self.length]
            fed[: self.length] = self.fed[: self.length]
            self.tokens, self.fed = tokens, fed

    def _store(self, positions: np.ndarray, tokens: np.ndarray) -> None:
        if positions.size == 0:
            return
        end = int(positions.max()) + 1
        self._grow(end)
        self.tokens[positions] = tokens
        self.length = max(self.length, end)

    def put(self, positions: np.ndarray, tokens: np.ndarray) -> None:
        """Rows delivered at ``positions`` (feeding ``tokens``)."""
        if positions.size == 1:  # a decode row: the common case, kept cheap
            self.put_one(int(positions[0]), int(tokens[0]))
            return
        self._store(positions, tokens)
        self.fed[positions] = True

    def put_one(self, position: int, token: int) -> None:
        self._grow(position + 1)
        self.tokens[position] = token
        self.fed[position] = True
        if position >= self.length:
            self.length = position + 1

    def missing(self, phase: Any, window: Any = None) -> int:
        """Positions with no token id, plus prompt positions ``phase`` (and the request's own
        ``window``, when it sets one) selects whose rows never came."""
        n_prompt = int(self.info.num_prompt_tokens)
        n = min(n_prompt, self.length)
        pos = np.arange(n, dtype=np.int64)
        prompt = np.zeros(n, np.bool_)
        wanted = row_mask(phase, prompt, pos, lambda: np.full(n, n_prompt, np.int64))
        if window is not None:
            wanted &= row_mask(window, prompt, pos, lambda: np.full(n, n_prompt, np.int64))
        return int((self.tokens[: self.length] < 0).sum()) + int((wanted & ~self.fed[:n]).sum())


def rows_to_write(rows: RowInfo, phase: Any, counters: Counters) -> np.ndarray:
    """Mask of the rows ``phase`` (a Phase or a capture window) selects that are not
    recomputation after a preemption (those are counted in ``rows_skipped_recomputed``:
    their position was written already)."""
    wanted = row_mask(
        phase,
        np.asarray(rows.is_decode, np.bool_),
        rows.position,
        rows.prompt_lengths,
    )
    recomputed = np.asarray(rows.recomputed, np.bool_)
    skipped = int((wanted & recomputed).sum())
    if skipped:
        counters.add("rows_skipped_recomputed", skipped)
    return wanted & ~recomputed
