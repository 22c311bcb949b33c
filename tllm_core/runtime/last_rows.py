"""Each request's last token row (capture window ``last``), held on the device until it
finishes: which row is the last is known only after the finish, when the taps hold another
step, so each step's newest kept row of an asking request is copied over its previous one."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tllm_core.api.bundles import Bundle
from tllm_core.api.ports import Phase
from tllm_core.api.rows import RequestInfo, RowInfo
from tllm_core.api.transfers import index_to
from tllm_core.api.windows import takes_last
from tllm_core.runtime.reads import PortRead, ReadPlan
from tllm_core.runtime.step_indices import StepIndices


def last_rows(reads: ReadPlan, narrows: frozenset[str], windowed: bool) -> LastRows | None:
    """The holder of a consumer's last rows (None: it takes none). They carry (every row: the
    runtime's mask cuts) the ports whose window is ``last``, and with per-request windows the
    kinds they ``narrows``."""

    def carried(table: dict[str, PortRead], kind: str) -> dict[str, PortRead]:
        return {
            k: PortRead(r.port, r.producer, Phase.ALL)
            for k, r in table.items()
            if r.phase is not Phase.GUIDE
            and (takes_last(r.phase) or (windowed and kind in narrows))
        }

    plan = ReadPlan(carried(reads.token, "token"), carried(reads.sample, "sample"))
    if plan.empty:
        return None
    token, sample = ReadPlan.phase(reads.token), ReadPlan.phase(reads.sample)
    return LastRows(plan, token.union(sample) if token is not None else sample)


class LastRows:
    """One consumer's held last rows, one per request: a device tensor per port key and the
    token ids (``[capacity, ...]``, grown by doubling). ``plan``: the ports the rows carry;
    ``ports``: the phases and windows of the consumer's ports; ``every``: whether their own
    window is ``last`` (else only requests that set it ask)."""

    def __init__(self, plan: ReadPlan, ports: Any) -> None:
        self.plan = plan
        self.ports = ports
        self.every = takes_last(ports)
        self._token: dict[str, torch.Tensor] = {}
        self._sample: dict[str, torch.Tensor] = {}
        self._token_ids: torch.Tensor | None = None
        self._slots: dict[str, int] = {}  # engine id -> its slot
        # engine id -> (slot, request, row, position, is_decode, recomputed) of its held row
        self._held: dict[str, tuple[int, RequestInfo, int, int, bool, bool]] = {}
        self._free: list[int] = []
        self._capacity = 0

    def __len__(self) -> int:
        return len(self._slots)

    def place(self, requests: list[RequestInfo]) -> np.ndarray:
        """The slots of ``requests``' rows (a new request takes a free one): found when the
        step is planned, so that they go to the device in its one index copy."""
        slots = np.empty(len(requests), np.int64)
        for i, req in enumerate(requests):
            slot = self._slots.get(req.engine_id)
            if slot is None:
                slot = self._slots[req.engine_id] = self._take_slot()
            slots[i] = slot
        return slots

    def keep(self, bundle: Bundle, slots: np.ndarray, steps: StepIndices) -> None:
        """``bundle``'s rows (at most one per request, at ``slots`` from :meth:`place`)
        become their requests' last rows."""
        # Sampling ports alone bundle no token rows; with token ports both are the same rows.
        rows = bundle.rows if bundle.sampled_rows is None else bundle.sampled_rows
        for i, req in enumerate(rows.requests):
            self._held[req.engine_id] = (
                int(slots[i]),
                req,
                int(rows.row[i]),
                int(rows.position[i]),
                bool(rows.is_decode[i]),
                bool(rows.recomputed[i]),
            )
        self._token_ids = self._store(self._token_ids, rows.token_ids, slots, steps)
        for table, tensors in ((self._token, bundle.hidden), (self._sample, bundle.per_sample)):
            for key in table.keys() | tensors.keys():
                table[key] = self._store(table.get(key), tensors.get(key), slots, steps)

    def take(self, requests: list[RequestInfo], step: int) -> Bundle | None:
        """The held last rows of ``requests`` as one bundle (None: none has one); their slots
        are let go."""
        for r in requests:
            if r.engine_id in self._slots:
                self._free.append(self._slots.pop(r.engine_id))
        held = [h for r in requests if (h := self._held.pop(r.engine_id, None)) is not None]
        if not held or self._token_ids is None:
            return None
        slots, reqs, row, position, is_decode, recomputed = zip(*held, strict=True)
        idx = index_to(np.array(slots, np.int64), self._token_ids.device)  # the step's device
        rows = RowInfo(
            row=np.array(row, np.int64),
            requests=list(reqs),
            position=np.array(position, np.int64),
            is_decode=np.array(is_decode, np.bool_),
            recomputed=np.array(recomputed, np.bool_),
            token_ids=self._token_ids.index_select(0, idx),
        )
        bundle = Bundle(step=step, rows=rows)
        for key, t in self._token.items():
            bundle.hidden[key] = t.index_select(0, idx)
        if self._sample:
            bundle.sampled_rows = rows
            for key, t in self._sample.items():
                bundle.per_sample[key] = t.index_select(0, idx)
        return bundle

    def _take_slot(self) -> int:
        if not self._free:
            # Grow by doubling: the holders are copied at most log2(live requests) times.
            new = max(8, 2 * self._capacity)
            self._free = list(range(new - 1, self._capacity - 1, -1))
            self._capacity = new
        return self._free.pop()

    def _store(
        self,
        holder: torch.Tensor | None,
        values: torch.Tensor | None,
        slots: np.ndarray,
        steps: StepIndices,
    ) -> torch.Tensor:
        """``values`` copied into ``holder``'s rows ``slots`` (made or grown first); ``None``: a
        stale tap, left out of the step's bundle, whose rows then read NaN (as on a GPU, where
        stale rows are delivered as NaN), as do rows never written."""
        like = values if values is not None else holder
        assert like is not None
        fill = float("nan") if like.is_floating_point() else 0
        if holder is None or holder.shape[0] < self._capacity:
            grown = like.new_full((self._capacity, *like.shape[1:]), fill)
            if holder is not None:
                grown[: holder.shape[0]].copy_(holder)
            holder = grown
        index = steps.index(slots, holder.device)
        if values is None:
            return holder.index_fill_(0, index, fill)
        return holder.index_copy_(0, index, values)
