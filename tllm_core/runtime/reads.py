"""A consumer's read ports resolved to producers, and the cut of a step into its bundle; a
per-request consumer's rows of a step (:class:`RowSelection`); each request's last rows held
until its finish (:class:`LastRows`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tllm_core.api.bundles import Bundle, GuideView
from tllm_core.api.ports import Phase, PortDeclarationError, ReadPort
from tllm_core.api.producer import Producer, TapRequest
from tllm_core.api.rows import RequestInfo, RowInfo, row_mask
from tllm_core.api.step import StaleTapError, StepCapture
from tllm_core.api.transfers import index_to
from tllm_core.api.windows import takes_last
from tllm_core.runtime.buffer_pool import StepIndices


@dataclass
class PortRead:
    """One resolved port (phases of ports with the same key merged) and its producer."""

    port: ReadPort
    producer: Producer
    phase: Phase


@dataclass
class ReadPlan:
    """A consumer's read ports by key, split by row kind."""

    token: dict[str, PortRead] = field(default_factory=dict)
    sample: dict[str, PortRead] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.token and not self.sample

    def taps(self) -> set[TapRequest]:
        return {
            t
            for r in (*self.token.values(), *self.sample.values())
            for t in r.producer.taps(r.port)
        }

    @staticmethod
    def phase(*tables: dict[str, PortRead]) -> Phase | None:
        out: Phase | None = None
        for r in (r for t in tables for r in t.values()):
            out = r.phase.union(out)
        return out


def plan_reads(
    ports: list[ReadPort],
    resolve_layer: Callable[[int], int],
    producer_for: Callable[[ReadPort], Producer],
) -> ReadPlan:
    """Resolve layer indices (ValueError on bad ones) and producers; merge same-key phases."""
    plan = ReadPlan()
    for p in ports:
        if not isinstance(p, ReadPort):
            raise PortDeclarationError.of("reads", p)
        port = p.resolve(resolve_layer)
        table = plan.token if port.rows == "token" else plan.sample
        old = table.get(port.key)
        if old is None:
            table[port.key] = PortRead(port, producer_for(port), port.phase)
        else:
            old.phase = port.phase.union(old.phase)
    return plan


def _gather(t: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
    return t.index_select(0, index_to(idx, t.device))


def read_unconfirmed(
    r: PortRead, step: StepCapture, buffers: StepIndices | None
) -> tuple[torch.Tensor, set[str], torch.Tensor | None]:
    """The port's tensor read before the stamps arrive, its taps, and (floating point only) a
    0-dim bool on the device (no host read): True when this step's forward did not stamp every
    tap (None: none has a stamp)."""
    with step.unconfirmed() as taps:
        t = r.producer.read(r.port, step)
    if not t.is_floating_point():
        return t, taps, None
    flag = None if buffers is None else buffers.pool.take((2,), torch.bool, t.device)
    ok = step.written(taps, flag)
    if ok is None:
        return t, taps, None
    return t, taps, ~ok if flag is None else ok.logical_not_()


@dataclass(frozen=True)
class RowMasks:
    """Masks over ``step.rows`` (None: every row) a consumer's token and sampling ports may
    take, beyond their phases and windows."""

    token: np.ndarray | None = None
    sample: np.ndarray | None = None


def step_runs(step: StepCapture) -> list[tuple[RequestInfo, int, int]]:
    """``(request, start, stop)`` of each scheduled request's rows (from the sampling rows)."""
    stops = (np.asarray(step.sample_token_row, np.int64) + 1).tolist()
    starts = [0, *stops[:-1]]
    requests = step.rows.requests
    return [(requests[b - 1], a, b) for a, b in zip(starts, stops, strict=True)]


def bundle_rows(
    plan: ReadPlan, step: StepCapture, masks: RowMasks | None = None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A bundle's token rows (into ``step.rows``) and sampling rows (into the sampling rows),
    narrowed by ``masks``, None where it has none. Host metadata only."""
    rows = step.rows
    masks = masks or RowMasks()
    prompt_lengths = functools.cache(rows.prompt_lengths)  # only windows need them

    def pick(reads: dict[str, PortRead], at: Any, keep: Any, narrow: Any) -> np.ndarray | None:
        phase = ReadPlan.phase(reads)
        if phase is None:
            return None
        mask = keep & row_mask(
            phase, rows.is_decode[at], rows.position[at], lambda: prompt_lengths()[at]
        )
        if narrow is not None:
            mask = mask & narrow[at]
        return np.nonzero(mask)[0] if mask.any() else None

    token = pick(plan.token, slice(None), True, masks.token)
    return token, pick(plan.sample, step.sample_token_row, step.sample_kept, masks.sample)


def bundle_indices(plan: ReadPlan, step: StepCapture, masks: RowMasks) -> list[np.ndarray]:
    """Every host index :func:`build_bundle` sends to the device for this bundle."""
    token, sample = bundle_rows(plan, step, masks)
    out = [] if token is None else [token]
    if sample is not None:
        out += [sample, step.sample_token_row[sample]]
    return out


def build_bundle(
    plan: ReadPlan,
    step: StepCapture,
    masks: RowMasks | None = None,
    on_stale: Callable[[str, StaleTapError], None] | None = None,
    unconfirmed: list[tuple[str, set[str]]] | None = None,
    buffers: StepIndices | None = None,
) -> Bundle | None:
    """The consumer's bundle for this step (rows per :func:`bundle_rows`), or None when it
    selects no row; a stale port is left out and reported to ``on_stale``. ``unconfirmed``:
    before the stamps arrive, floating-point ports are cut at once, NaN where the forward did
    not write them, and ``(port key, tap keys)`` appended to check later. ``buffers``: gather
    into reused buffers."""
    rows = step.rows
    gather = _gather if buffers is None else buffers.gather
    bundle = Bundle(step=step.step, rows=rows.take(np.zeros(0, np.int64), rows.token_ids[:0]))

    def read(r: PortRead) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The port's tensor and its stale flag (None: known to be written)."""
        if unconfirmed is not None and not step.confirmed:
            t, taps, stale = read_unconfirmed(r, step, buffers)
            if t.is_floating_point():
                if stale is not None:
                    unconfirmed.append((r.port.key, set(taps)))
                return t, stale
            if not any(k in step.stamps for k in taps):
                return t, None
        try:
            return r.producer.read(r.port, step), None
        except StaleTapError as e:
            if on_stale is not None:
                on_stale(r.port.key, e)
            return None, None

    def cut(r: PortRead, idx: np.ndarray) -> torch.Tensor | None:
        t, stale = read(r)
        if t is None:
            return None
        out = gather(t, idx)
        if stale is not None:
            out.masked_fill_(stale, float("nan"))
        return out

    token, sample = bundle_rows(plan, step, masks)
    if token is not None:
        bundle.rows = rows.take(token, gather(rows.token_ids, token))
        cuts = {k: cut(r, token) for k, r in plan.token.items() if r.phase is not Phase.GUIDE}
        bundle.hidden = {k: t for k, t in cuts.items() if t is not None}  # GUIDE: at guide time
    if sample is not None:
        in_rows = step.sample_token_row[sample]  # the same rows, as indices into step.rows
        bundle.sampled_rows = rows.take(in_rows, gather(rows.token_ids, in_rows))
        cuts = {k: cut(r, sample) for k, r in plan.sample.items()}
        bundle.per_sample = {k: t for k, t in cuts.items() if t is not None}
    if not bundle.hidden and not bundle.per_sample:
        return None
    return bundle


def span(index: np.ndarray) -> slice | None:
    """``index`` (sorted, distinct) as a slice when it is one range, else None."""
    if index.size and int(index[-1]) - int(index[0]) + 1 == index.size:
        return slice(int(index[0]), int(index[-1]) + 1)
    return None


class RowSelection:
    """A per-request consumer's rows of a step (where ``mask`` is true), cut without a device
    allocation or host wait: views where they form one range (a guide writes in place, undone
    by ``GuideView.rollback``), else gathered into reused buffers and written back."""

    def __init__(self, mask: np.ndarray) -> None:
        self.mask = mask
        self.index = np.nonzero(mask)[0]
        self.span = span(self.index)

    def __len__(self) -> int:
        return int(self.index.size)

    def indices(self) -> list[np.ndarray]:
        """The host index :meth:`cut` sends (none for a range)."""
        return [] if self.span is not None else [self.index]

    def cut(self, t: torch.Tensor, buffers: StepIndices) -> torch.Tensor:
        """``t``'s selected rows: a view for a range, else gathered into a reused buffer."""
        if self.span is not None:
            return t[self.span]
        return buffers.gather(t, self.index)

    def rows(self, rows: RowInfo, buffers: StepIndices) -> RowInfo:
        """The selected rows' metadata and token ids."""
        return rows.take(self.index, self.cut(rows.token_ids, buffers))

    def guide_view(
        self,
        buffers: StepIndices,
        step: int,
        rows: RowInfo,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        is_random: np.ndarray,
        filtered: bool,
        hidden: dict[str, torch.Tensor],
        changed: torch.Tensor,
    ) -> GuideView:
        """The consumer's guide view of the step's sampling rows."""
        return GuideView(
            step,
            self.rows(rows, buffers),
            self.cut(logits, buffers),
            self.cut(temperature, buffers),
            is_random[self.mask],
            filtered,
            {k: self.cut(v, buffers) for k, v in hidden.items()},
            changed,
        )

    def write_back(self, logits: torch.Tensor, view: GuideView, buffers: StepIndices) -> None:
        """A guide that wrote: its logits into the step's (a range wrote them in place)."""
        if self.span is None:
            logits.index_copy_(0, buffers.index(self.index, logits.device), view.logits)


def last_rows(reads: ReadPlan, narrows: frozenset[str], windowed: bool) -> LastRows | None:
    """The holder of a consumer's last rows (None: it takes none), carrying the ports whose
    window is ``last`` and, with per-request windows, the row kinds they ``narrows``."""

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
    return LastRows(plan, ReadPlan.phase(reads.token, reads.sample))


class LastRows:
    """Each request's last row (window ``last``), held on the device until it finishes (which
    row is last is known only then), as ``[capacity, ...]`` tensors grown by doubling.
    ``ports``: the phases of the consumer's ports; ``every``: whether their window is ``last``
    (else only requests that set it ask)."""

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
        """The slots of ``requests``' rows (found at the plan, sent in its one index copy)."""
        for req in requests:
            if req.engine_id not in self._slots:
                self._slots[req.engine_id] = self._take_slot()
        return np.array([self._slots[req.engine_id] for req in requests], np.int64)

    def keep(self, bundle: Bundle, slots: np.ndarray, steps: StepIndices) -> None:
        """``bundle``'s rows (one per request at most) become their requests' last rows."""
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
        """The held last rows of ``requests`` as one bundle (None: none); their slots freed."""
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
        return Bundle(
            step=step,
            rows=rows,
            hidden={k: t.index_select(0, idx) for k, t in self._token.items()},
            sampled_rows=rows if self._sample else None,
            per_sample={k: t.index_select(0, idx) for k, t in self._sample.items()},
        )

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
        """``values`` copied into ``holder``'s rows ``slots`` (grown first); ``None``: a stale
        tap, whose rows then read NaN (as on a GPU), as do rows never written."""
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
