"""What exports keep per request and which rows they write: shared by ``export`` and the
``sae`` feature records (both carry the export layout's request table)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from tllm_core import Counters, Phase, RowInfo, phase_mask


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


def rows_to_write(rows: RowInfo, phase: Phase, counters: Counters) -> np.ndarray:
    """Mask of the rows of ``phase`` that are not recomputation after a preemption (those
    are counted in ``rows_skipped_recomputed``: their position was written already)."""
    wanted = phase_mask(np.asarray(rows.is_decode, np.bool_), phase)
    recomputed = np.asarray(rows.recomputed, np.bool_)
    skipped = int((wanted & recomputed).sum())
    if skipped:
        counters.add("rows_skipped_recomputed", skipped)
    return wanted & ~recomputed


class RequestFates:
    """How the requests of a record ended and what data they lost (thread-safe: finish and
    drop notices may come from the engine thread while rows arrive on another).

    A request is ``finished`` only when vLLM reported it finished on its own; one aborted
    or closed before its end (``RequestInfo.cut_short``) or never reported is not. Bundles
    dropped under ``overflow: "drop"`` are counted per request.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._dropped: dict[str, int] = {}
        self.bundles_dropped = 0

    def finish(self, request: Any) -> None:
        if getattr(request, "cut_short", False):
            return
        with self._lock:
            self._finished.add(request.engine_id)

    def drop(self, requests: list[Any]) -> None:
        with self._lock:
            self.bundles_dropped += 1
            for r in requests:
                self._dropped[r.engine_id] = self._dropped.get(r.engine_id, 0) + 1

    def request_table(self, table: list[RequestTokens]) -> list[dict[str, Any]]:
        """The manifest's ``requests`` entries."""
        with self._lock:
            finished = set(self._finished)
            dropped = dict(self._dropped)
        out = []
        for req in table:
            info = req.info
            tokens = req.tokens[: req.length]
            out.append(
                {
                    "request_id": info.request_id,
                    "engine_id": info.engine_id,
                    "prompt_index": info.prompt_index,
                    "sample_index": info.sample_index,
                    "num_prompt_tokens": info.num_prompt_tokens,
                    "finished": info.engine_id in finished,
                    "positions_missing": int((tokens < 0).sum()),
                    "bundles_dropped": dropped.get(info.engine_id, 0),
                    "token_ids": tokens.tolist(),
                }
            )
        return out

    def losses(self, requests: list[dict[str, Any]]) -> dict[str, int]:
        """The manifest's ``losses``: what makes a closed record incomplete (all 0: none)."""
        return {
            "requests_unfinished": sum(not r["finished"] for r in requests),
            "positions_missing": sum(r["positions_missing"] for r in requests),
            "bundles_dropped": self.bundles_dropped,
        }


class RequestTable:
    """The requests of a record, numbered in order of first sight (the manifest's
    ``requests`` table), with their token sequences and fates: one table shape for the
    export and the ``sae`` feature records."""

    def __init__(self, on_new: Callable[[], None] | None = None) -> None:
        """``on_new``: called once per request when it enters the table (a counter)."""
        self.fates = RequestFates()
        self.entries: list[RequestTokens] = []
        self._by_id: dict[str, RequestTokens] = {}
        self._on_new = on_new

    def __len__(self) -> int:
        return len(self.entries)

    def entry(self, info: Any) -> RequestTokens:
        """The request's entry, added at the end of the table when it is new."""
        req = self._by_id.get(info.engine_id)
        if req is None:
            req = RequestTokens(len(self.entries), info)
            self._by_id[info.engine_id] = req
            self.entries.append(req)
            if self._on_new is not None:
                self._on_new()
        return req

    def summary(self, closed: bool) -> tuple[list[dict[str, Any]], dict[str, int], bool]:
        """The manifest's ``requests``, ``losses`` and ``complete`` (see :func:`completeness`)."""
        requests = self.fates.request_table(self.entries)
        losses = self.fates.losses(requests)
        return requests, losses, completeness(closed, losses)


def completeness(closed: bool, losses: dict[str, int]) -> bool:
    """``complete``: closed after its last data, with every request finished on its own,
    no position missing and no bundle dropped."""
    return closed and not any(losses.values())
