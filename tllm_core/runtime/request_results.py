"""Per-request results kept in the engine until taken, each bounded by ``max_result_bytes``,
the store by ``max_requests`` and ``STORE_RESULTS`` of them (the oldest dropped)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from tllm_core.api.counters import Counters
from tllm_core.api.results import encode, json_bytes
from tllm_core.api.rows import RequestInfo

STORE_RESULTS = 8  # the store holds this many max_result_bytes of uncollected results
UNWANTED_S = 300.0  # a discarded caller id's late results (background consumers) are dropped


class ResultStore:
    """Caller request id -> sample index -> consumer -> its encoded result."""

    def __init__(self, counters: Counters, max_result_bytes: int, max_requests: int = 4096):
        self.counters = counters
        self.max_result_bytes = int(max_result_bytes)
        self.max_requests = int(max_requests)
        self.max_bytes = STORE_RESULTS * self.max_result_bytes
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, dict[int, dict[str, Any]]] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._total = 0
        # Errors for results dropped before they were taken (told at once, not waited for).
        self._dropped: OrderedDict[str, dict[int, dict[str, Any]]] = OrderedDict()
        why = f"dropped uncollected: the engine keeps {self.max_bytes} bytes ({STORE_RESULTS} x max_result_bytes)"
        self._gone = {"error": f"{why}; ask for fewer choices or rows at once"}
        self._cut = {"error": "cut short: the request was aborted before its end"}
        self._unwanted: OrderedDict[str, float] = OrderedDict()  # caller id -> until when
        # Caller id -> engine ids of the requests that reused it after its discard: theirs
        # are wanted, a late result of the discarded ones is not.
        self._reused: dict[str, set[str]] = {}
        # Engine ids of discarded requests: the engine may first see one after its discard.
        self._discarded: OrderedDict[str, None] = OrderedDict()

    def put(self, request: RequestInfo, consumer: str, value: Any) -> None:
        """Keep ``consumer``'s result for ``request`` (encoded on the caller's thread); a request
        cut short (aborted) leaves a small error instead, its siblings keep theirs."""
        rid = request.request_id
        with self._lock:
            unwanted = self._unwanted.get(rid, 0.0) > time.monotonic() and (
                request.engine_id not in self._reused.get(rid, ())
            )
            if request.cut_short and not unwanted:
                dropped = self._dropped.setdefault(rid, {})
                dropped.setdefault(request.sample_index, {})[consumer] = self._cut
                self._bound_dropped()
        if request.cut_short or unwanted:
            if not request.cut_short:  # made (the request ran to its end), then discarded
                self.counters.add("results_made", of=consumer)
            self.counters.add("results_discarded")
            return
        try:
            out = encode(value)
            size = json_bytes(out)
        except (TypeError, ValueError) as e:
            out = {"error": f"{consumer}: its result is not JSON-able: {e}"}
            size = json_bytes(out)
            self.counters.add("results_failed")
        if size > self.max_result_bytes:
            self.counters.add("results_refused")
            out = {
                "error": f"{consumer}: this request's result has {size} bytes, past this "
                f"engine's limit of {self.max_result_bytes} (setting max_result_bytes); ask "
                "for fewer rows (a narrower window, fewer layers or tokens)",
                "bytes": size,
                "limit": self.max_result_bytes,
            }
            size = json_bytes(out)
        elif not (isinstance(out, dict) and "error" in out):
            self.counters.add("results_made", of=consumer)
        with self._lock:
            self._kept.setdefault(rid, {}).setdefault(request.sample_index, {})[consumer] = out
            self._kept.move_to_end(rid)
            self._sizes[rid] = self._sizes.get(rid, 0) + size
            self._total += size
            while self._kept and (
                len(self._kept) > self.max_requests or self._total > self.max_bytes
            ):
                old, lost = self._kept.popitem(last=False)
                self._total -= self._sizes.pop(old, 0)
                self.counters.add("results_expired")
                gone = {s: dict.fromkeys(per, self._gone) for s, per in lost.items()}
                self._dropped.setdefault(old, {}).update(gone)
                self._bound_dropped()

    def _bound_dropped(self) -> None:  # under the lock
        while sum(map(len, self._dropped.values())) > self.max_requests:
            self._dropped.popitem(last=False)  # bounded too (then: the wait)

    def take(self, request_ids: list[str]) -> dict[str, dict[int, dict[str, Any]]]:
        """The results kept for these caller ids, removed from the store."""
        out: dict[str, dict[int, dict[str, Any]]] = {}
        taken = 0
        with self._lock:
            for rid in request_ids:
                got = self._dropped.pop(rid, {})  # dropped: errors, not counted as taken
                for sample, per in self._kept.pop(rid, {}).items():
                    got.setdefault(sample, {}).update(per)
                    taken += len(per)
                if got:
                    out[rid] = got
                    self._total -= self._sizes.pop(rid, 0)
        self.counters.add("results_taken", taken)
        return out

    def discard(self, request_ids: list[str], engine_ids: Iterable[str] = ()) -> None:
        """Drop all kept for these caller ids (their response failed), errors too, and what
        they make in the next ``UNWANTED_S`` unless a new request takes the id (:meth:`reuse`;
        ``engine_ids``: the discarded requests' own, never such a new one)."""
        until = time.monotonic() + UNWANTED_S
        with self._lock:
            self._discarded.update(dict.fromkeys(engine_ids))
            while len(self._discarded) > 16 * self.max_requests:
                self._discarded.popitem(last=False)
            for rid in request_ids:
                self._dropped.pop(rid, None)  # counted when dropped
                gone = self._kept.pop(rid, {})
                self._total -= self._sizes.pop(rid, 0)
                self.counters.add("results_discarded", sum(map(len, gone.values())))
                self._unwanted[rid] = until
                self._unwanted.move_to_end(rid)
                self._reused.pop(rid, None)
            while len(self._unwanted) > self.max_requests:
                self._reused.pop(self._unwanted.popitem(last=False)[0], None)

    def reuse(self, request_id: str, engine_id: str, parent_id: str | None = None) -> None:
        """A new request (``engine_id``; a sample of ``parent_id``) reuses this caller id: its
        results are kept, while late ones of the discarded requests of that id are still
        dropped."""
        if (parent_id or engine_id) in self._discarded:
            return  # a discarded request (or a sample of one) first seen by the engine
        if request_id in self._unwanted:
            with self._lock:
                until = self._unwanted.get(request_id)
                if until is not None and until <= time.monotonic():  # over: nothing unwanted
                    del self._unwanted[request_id]
                    self._reused.pop(request_id, None)
                elif until is not None:
                    self._reused.setdefault(request_id, set()).add(engine_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)
