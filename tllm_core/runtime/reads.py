"""A consumer's read ports resolved to producers, and the cut of a step into its bundle."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tllm_core.api.bundles import Bundle
from tllm_core.api.ports import Phase, ReadPort
from tllm_core.api.producer import Producer, TapRequest
from tllm_core.api.rows import RequestInfo, row_mask
from tllm_core.api.step import StaleTapError, StepCapture
from tllm_core.api.transfers import index_to
from tllm_core.runtime.step_indices import StepIndices


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
    def phase(reads: dict[str, PortRead]) -> Phase | None:
        out: Phase | None = None
        for r in reads.values():
            out = r.phase.union(out)
        return out


def plan_reads(
    ports: list[ReadPort],
    resolve_layer: Callable[[int], int],
    producer_for: Callable[[ReadPort], Producer],
) -> ReadPlan:
    """Resolve layer indices (ValueError on bad ones), find each port's producer, merge the
    phases of ports with the same key."""
    plan = ReadPlan()
    for p in ports:
        if not isinstance(p, ReadPort):
            raise TypeError(f"not a read port: {p!r}")
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


def unwritten(
    step: StepCapture, taps: set[str], device: torch.device, buffers: StepIndices | None = None
) -> torch.Tensor | None:
    """On the device, without a host read: a 0-dim bool, True when this step's forward did
    not stamp every tap in ``taps`` (None: none has a stamp)."""
    flag = None if buffers is None else buffers.pool.take((2,), torch.bool, device)
    ok = step.written(taps, flag)
    if ok is None:
        return None
    return ~ok if flag is None else ok.logical_not_()


@dataclass(frozen=True)
class RowMasks:
    """The step's token rows a consumer may take beyond its ports' phases and windows: masks
    over ``step.rows`` (None: every row) for its token ports and its sampling ports."""

    token: np.ndarray | None = None
    sample: np.ndarray | None = None


def step_runs(step: StepCapture) -> list[tuple[RequestInfo, int, int]]:
    """``(request, start, stop)`` of each scheduled request's rows, found from the sampling
    rows (each request's last row): per request, not per row."""
    stops = (np.asarray(step.sample_token_row, np.int64) + 1).tolist()
    starts = [0, *stops[:-1]]
    requests = step.rows.requests
    return [(requests[b - 1], a, b) for a, b in zip(starts, stops, strict=True)]


def bundle_rows(
    plan: ReadPlan, step: StepCapture, masks: RowMasks | None = None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A consumer bundle's token rows (into ``step.rows``) and sampling rows (into the step's
    sampling rows), None where it has none, narrowed by ``masks``. Host metadata only."""
    token = sample = None
    rows = step.rows
    masks = masks or RowMasks()
    prompt_lengths = functools.cache(rows.prompt_lengths)  # only windows need them
    phase = ReadPlan.phase(plan.token)
    if phase is not None:
        mask = row_mask(phase, rows.is_decode, rows.position, prompt_lengths)
        if masks.token is not None:
            mask = mask & masks.token
        if mask.any():
            token = np.nonzero(mask)[0]
    phase = ReadPlan.phase(plan.sample)
    if phase is not None:
        at = step.sample_token_row
        mask = step.sample_kept & row_mask(
            phase, rows.is_decode[at], rows.position[at], lambda: prompt_lengths()[at]
        )
        if masks.sample is not None:
            mask = mask & masks.sample[at]
        if mask.any():
            sample = np.nonzero(mask)[0]
    return token, sample


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
    """The consumer's bundle for this step (rows narrowed by ``masks``, see
    :func:`bundle_rows`), or None when it selects no row; a stale port is left out and
    reported to ``on_stale``. ``unconfirmed``: while the stamps are on their way to the host,
    floating-point ports are cut without waiting, their rows NaN where this step's forward
    did not write the taps, and ``(port key, tap keys)`` appended for the caller to check
    later. ``buffers``: gather into its reused buffers (else every tensor is new)."""
    rows = step.rows
    gather = _gather if buffers is None else buffers.gather
    bundle = Bundle(step=step.step, rows=rows.take(np.zeros(0, np.int64), rows.token_ids[:0]))

    def read(r: PortRead) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The port's tensor, and a 0-dim bool on its device, True when its taps were not
        written by this step's forward (None: known to be written)."""
        if unconfirmed is not None and not step.confirmed:
            with step.unconfirmed() as taps:
                t = r.producer.read(r.port, step)
            if t.is_floating_point():
                stale = unwritten(step, taps, t.device, buffers)
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
        for key, r in plan.token.items():
            if r.phase is Phase.GUIDE:
                continue  # read at guide time only
            t = cut(r, token)
            if t is not None:
                bundle.hidden[key] = t
    if sample is not None:
        in_rows = step.sample_token_row[sample]  # the same rows, as indices into step.rows
        bundle.sampled_rows = rows.take(in_rows, gather(rows.token_ids, in_rows))
        for key, r in plan.sample.items():
            t = cut(r, sample)
            if t is not None:
                bundle.per_sample[key] = t
    if not bundle.hidden and not bundle.per_sample:
        return None
    return bundle
