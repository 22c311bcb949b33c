"""The request table of an export-layout record, bounded: only running requests are held in
memory; a finished one's entry goes to ``requests.jsonl`` at the next manifest write (after the
shard holding its last rows) and is forgotten. Not thread-safe: the owner locks."""

from __future__ import annotations

import contextlib
import json
import os
from typing import IO, Any

import numpy as np
import torch

from consumers.export import format as fmt
from tllm_core import Counters, Phase, RequestInfo, RowInfo, row_mask, window_text


class RequestTokens:
    """One request's token sequence so far, and which positions' rows were delivered (``fed``:
    a prompt position whose row never came, e.g. a prefix-cache hit, has its id but no row)."""

    __slots__ = ("index", "info", "tokens", "fed", "length")

    def __init__(self, index: int, info: Any):
        self.index = index
        self.info = info
        size = max(16, int(info.num_prompt_tokens) + 16)
        self.tokens = np.full(size, -1, np.int64)
        self.fed = np.zeros(size, np.bool_)
        self.length = 0
        prompt = getattr(info, "prompt_token_ids", None)
        if prompt is not None:  # the prompt's ids: no row delivered yet
            self.put(np.arange(len(prompt), dtype=np.int64), np.asarray(prompt, np.int64), False)

    def put(self, positions: np.ndarray, tokens: np.ndarray, fed: bool = True) -> None:
        if positions.size == 0:
            return
        end = int(positions.max()) + 1
        self._grow(end)
        self.tokens[positions] = tokens
        if fed:
            self.fed[positions] = True
        self.length = max(self.length, end)

    def put_one(self, position: int, token: int) -> None:
        """One delivered row (a decode step's): no numpy fancy indexing."""
        self._grow(position + 1)
        self.tokens[position] = token
        self.fed[position] = True
        self.length = max(self.length, position + 1)

    def _grow(self, end: int) -> None:
        if end > self.tokens.shape[0]:
            n, size = self.length, max(end, 2 * self.tokens.shape[0])
            self.tokens = np.concatenate([self.tokens[:n], np.full(size - n, -1, np.int64)])
            self.fed = np.concatenate([self.fed[:n], np.zeros(size - n, np.bool_)])

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
    """Mask of the rows ``phase`` selects that are not recomputed after a preemption (counted
    in ``rows_skipped_recomputed``: their position was written already)."""
    wanted = row_mask(
        phase, np.asarray(rows.is_decode, np.bool_), rows.position, rows.prompt_lengths
    )
    recomputed = np.asarray(rows.recomputed, np.bool_)
    skipped = int((wanted & recomputed).sum())
    if skipped:
        counters.add("rows_skipped_recomputed", skipped)
    return wanted & ~recomputed


def sampled_tokens(bundle: Any) -> tuple[list[RequestInfo], np.ndarray, np.ndarray] | None:
    """A bundle's sampled tokens as ``(requests, positions, token ids)`` (each position one
    past its row's), or None."""
    srows, ids = bundle.sampled_rows, bundle.sampled_token_ids
    if srows is None or ids is None or not len(srows):
        return None
    pos = np.asarray(srows.position, np.int64) + 1
    return srows.requests, pos, ids.detach().to("cpu", torch.int64).numpy()


class RequestTable:
    """Open requests in memory, closed ones in ``requests.jsonl`` of the ``writer``'s folder;
    ``owner``: the consumer whose per-request windows narrow its rows."""

    def __init__(self, writer: Any, phase: Any = Phase.ALL, owner: Any = None):
        self._writer = writer
        self.phase = phase
        self._owner = owner
        self._open: dict[str, RequestTokens] = {}
        # Finished entries not in the file yet: their rows may still be in an unwritten shard.
        self._pending: list[dict[str, Any]] = []
        self._dropped: dict[str, int] = {}  # bundles dropped per open request
        self.seen = 0  # requests given an index
        self.closed = 0  # lines in requests.jsonl
        self.bundles_dropped = 0
        self._closed_losses = {"requests_unfinished": 0, "positions_missing": 0}
        self._file: IO[str] | None = None

    @property
    def open_count(self) -> int:
        return len(self._open)

    def get(self, info: Any) -> RequestTokens:
        req = self._open.get(info.engine_id)
        if req is None:
            req = self._open[info.engine_id] = RequestTokens(self.seen, info)
            self.seen += 1
        return req

    def drop(self, requests: list[Any]) -> None:
        self.bundles_dropped += 1
        for r in requests:
            self._dropped[r.engine_id] = self._dropped.get(r.engine_id, 0) + 1

    def finish(self, request: Any) -> None:
        """``request`` finished (``cut_short``: before its end); its entry goes to the file."""
        dropped = self._dropped.pop(request.engine_id, 0)
        req = self._open.pop(request.engine_id, None)
        if req is None:  # no data reached the record: it has no entry
            return
        e = self._entry(req, not getattr(request, "cut_short", False), dropped)
        self._closed_losses["requests_unfinished"] += not e["finished"]
        self._closed_losses["positions_missing"] += e["positions_missing"]
        self._pending.append(e)

    def _write_pending(self) -> None:
        """Append the finished entries durably; only then does ``closed`` count them."""
        if not self._pending:
            return
        if self._file is None:
            self._writer.prepare()
            mode = "a" if self.closed else "w"  # "a": used again after release()
            path = os.path.join(self._writer.path, fmt.REQUESTS_FILE)
            self._file = open(path, mode, encoding="utf-8")  # noqa: SIM115 - kept open
        self._file.write(
            "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in self._pending)
        )
        self._file.flush()
        os.fsync(self._file.fileno())
        self.closed += len(self._pending)
        self._pending = []

    def _entry(self, req: RequestTokens, finished: bool, dropped: int) -> dict[str, Any]:
        info = req.info
        # The request's own capture window within the phase; None: none set, or one the
        # engine could not parse (it took no row, and the phase's rows count as missing).
        window = None
        if self._owner is not None:
            with contextlib.suppress(ValueError):
                window = info.window(self._owner)
        return {
            "index": req.index,
            "request_id": info.request_id,
            "engine_id": info.engine_id,
            "prompt_index": info.prompt_index,
            "sample_index": info.sample_index,
            "num_prompt_tokens": info.num_prompt_tokens,
            "finished": finished,
            "positions_missing": req.missing(self.phase, window),
            "bundles_dropped": dropped,
            **({} if window is None else {"window": window_text(window)}),
            "token_ids": req.tokens[: req.length].tolist(),
        }

    def manifest_fields(self) -> dict[str, Any]:
        """A manifest's ``losses`` and table: open (and, after a failed write, unfiled) requests
        inline, closed ones as the first ``requests_closed`` lines of the file (made durable here)."""
        if self._writer.error is None:
            self._write_pending()
        opened = [self._entry(r, False, self._dropped.get(e, 0)) for e, r in self._open.items()]
        closed = self._closed_losses
        losses = {
            "requests_unfinished": closed["requests_unfinished"] + len(opened),
            "positions_missing": closed["positions_missing"]
            + sum(r["positions_missing"] for r in opened),
            "bundles_dropped": self.bundles_dropped,
        }
        out: dict[str, Any] = {"losses": losses}
        if self.closed:
            out.update(requests_file=fmt.REQUESTS_FILE, requests_closed=self.closed)
        return {**out, "requests": sorted(self._pending + opened, key=lambda e: e["index"])}

    def release(self) -> None:
        """Close the file after the final manifest; a later request reopens it."""
        if self._file is not None:
            self._file.close()
            self._file = None
