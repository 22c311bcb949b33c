"""ESamp's per-request results (``tllm_results: "esamp"``): each decode row's prediction
error, read back with the train step that measured it and kept per request
(:class:`~tllm_core.api.results.RequestRows`, bounded by ``max_result_bytes``) until the
request's result is taken."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from algorithms.esamp.slots import TrainResult
from tllm_core import Counters, RequestInfo, RequestRows, array_json_bytes


class ReturnedErrors:
    """The errors of the rows of requests that ask, from submission to the request's result.

    :meth:`submitted` notes which rows of a train step (asked with ``row_errors``) belong to
    asking requests; :meth:`read` moves the errors of final steps, oldest first, into the
    per-request rows (counted ``rows_returned``); :meth:`take` hands a request's rows out."""

    EMPTY = {"positions": np.zeros(0, np.int64), "prediction_error": np.zeros(0, np.float32)}

    def __init__(self, name: str, limit: int, counters: Counters):
        self.name, self.counters = name, counters
        self.rows = RequestRows(limit, name)
        # (result, its rows' indices in the step's submission, their requests, positions)
        self._pending: list[tuple[TrainResult, np.ndarray, list[str], np.ndarray]] = []
        self._waiting: Counter[str] = Counter()  # engine id -> pending steps with its rows

    def asking(self, requests: Sequence[RequestInfo], sel: list[int]) -> np.ndarray:
        """Indices into ``sel`` of the rows whose request asks for this consumer's result."""
        return np.fromiter(
            (k for k, i in enumerate(sel) if requests[i].wants_result(self.name)), np.int64
        )

    def submitted(
        self, res: TrainResult, at: np.ndarray, engine_ids: list[str], positions: np.ndarray
    ) -> None:
        """Rows ``at`` of the step ``res`` (of requests ``engine_ids``, at ``positions``)
        return their errors once ``res`` is final."""
        self._pending.append((res, at, engine_ids, positions))
        self._waiting.update(set(engine_ids))

    def waits_for(self, engine_id: str) -> bool:
        """Whether rows of this request are in steps not read back yet."""
        return self._waiting[engine_id] > 0

    def read(self, block: bool) -> None:
        """Keep the errors of the final steps, oldest first (``block``: every step; the
        caller has waited for them)."""
        n = 0
        while n < len(self._pending) and (block or self._pending[n][0].ready()):
            n += 1
        done, self._pending = self._pending[:n], self._pending[n:]
        for res, at, engine_ids, positions in done:
            errors = res.row_errors.numpy()[at].astype(np.float32)
            start = 0
            for k in range(1, len(at) + 1):  # one add per run of rows of one request
                if k == len(at) or engine_ids[k] != engine_ids[start]:
                    self.rows.add(
                        engine_ids[start],
                        positions=positions[start:k],
                        prediction_error=errors[start:k],
                    )
                    start = k
            for eid in set(engine_ids):
                self._waiting[eid] -= 1
                if self._waiting[eid] <= 0:
                    del self._waiting[eid]
            self.counters.add("rows_returned", len(at))

    def take(self, request: RequestInfo) -> dict[str, Any]:
        return self.rows.take(request.engine_id, self.EMPTY)

    @staticmethod
    def result_bytes(max_tokens: int) -> int:
        """An upper bound of a request's result: at most one decode row per generated
        token (positions int64, errors fp32)."""
        return array_json_bytes(max_tokens, 8) + array_json_bytes(max_tokens, 4) + 64
