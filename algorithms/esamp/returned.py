"""ESamp's per-request results (``tllm_results: "esamp"``): each decode row's prediction
error, kept per request until its result is taken."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from algorithms.esamp.losses import final_prefix
from algorithms.esamp.slots import TrainResult
from tllm_core import Counters, RequestInfo, RequestRows, array_json_bytes, request_runs


class ReturnedErrors:
    """The errors of the rows of requests that ask, from submission to the request's result."""

    EMPTY = {"positions": np.zeros(0, np.int64), "prediction_error": np.zeros(0, np.float32)}

    def __init__(self, name: str, limit: int, counters: Counters):
        self.name, self.counters = name, counters
        self.rows = RequestRows(limit, name)
        # (result, its rows' indices in the step's submission, their requests, positions)
        self._pending: list[tuple[TrainResult, np.ndarray, list[RequestInfo], np.ndarray]] = []
        self._waiting: Counter[str] = Counter()  # engine id -> pending steps with its rows

    def asking(self, requests: Sequence[RequestInfo], sel: list[int]) -> np.ndarray:
        """Indices into ``sel`` of the rows whose request asks for this consumer's result."""
        return np.fromiter(
            (k for k, i in enumerate(sel) if requests[i].wants_result(self.name)), np.int64
        )

    def submitted(
        self, res: TrainResult, at: np.ndarray, requests: list[RequestInfo], positions: np.ndarray
    ) -> None:
        """Rows ``at`` of the step ``res`` return their errors once it is final."""
        self._pending.append((res, at, requests, positions))
        self._waiting.update({r.engine_id for r in requests})

    def waits_for(self, engine_id: str) -> bool:
        """Whether rows of this request are in steps not read back yet."""
        return self._waiting[engine_id] > 0

    def read(self, block: bool) -> None:
        """Keep the errors of the final steps, oldest first (``block``: every step)."""
        n = final_prefix([p[0] for p in self._pending], block)
        done, self._pending = self._pending[:n], self._pending[n:]
        for res, at, requests, positions in done:
            errors = res.row_errors.numpy()[at].astype(np.float32)
            for req, a, b in request_runs(requests):
                self.rows.add(req.engine_id, positions=positions[a:b], prediction_error=errors[a:b])
            for eid in {r.engine_id for r in requests}:
                self._waiting[eid] -= 1
                if self._waiting[eid] <= 0:
                    del self._waiting[eid]
            self.counters.add("rows_returned", len(at))

    def take(self, request: RequestInfo) -> dict[str, Any]:
        return self.rows.take(request.engine_id, self.EMPTY)

    @staticmethod
    def result_bytes(max_tokens: int) -> int:
        """An upper bound of a request's result (one decode row per generated token)."""
        return array_json_bytes(max_tokens, 8) + array_json_bytes(max_tokens, 4) + 64
