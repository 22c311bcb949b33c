"""ESamp's training, after sampling: each step's decode rows (warm start: prompt rows first)
train their group's distiller; results read back become the loss counters and curves."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from algorithms.esamp.lifecycle import Group, Groups, Shared, row_index, rows_id, select_rows
from algorithms.esamp.slots import TrainResult
from tllm_core import Bundle, Counters, RequestInfo, RequestRows, array_json_bytes, request_runs

# Queued updates: read back every _FLUSH_EVERY without waiting, with a wait at _FLUSH_LIMIT
# (bounded bookkeeping); device counters sent every _READ_EVERY non-waiting flushes.
_FLUSH_EVERY = 256
_FLUSH_LIMIT = 4 * _FLUSH_EVERY
_READ_EVERY = 32
_CURVE_POINTS = 64
T = TypeVar("T")

# One submitted train step: the groups' serials and ages (steps before it), its result.
Submitted = tuple[list[int], list[int], TrainResult]


class ByAge:
    """Per step index within a group: the sums of some values and how many were added."""

    def __init__(self) -> None:
        self.sums: list[list[float]] = []
        self.counts: list[int] = []

    def add(self, age: int, values: list[float]) -> None:
        while len(self.counts) <= age:
            self.sums.append([0.0] * len(values))
            self.counts.append(0)
        self.sums[age] = [s + v for s, v in zip(self.sums[age], values, strict=True)]
        self.counts[age] += 1

    def curve(self, points: int | None = _CURVE_POINTS) -> list[list[float]]:
        """``[step index, the means, count]`` per index with data (at most ``points``, evenly)."""
        ages = [a for a, n in enumerate(self.counts) if n]
        if points is not None and len(ages) > points:
            picks = np.unique(np.linspace(0, len(ages) - 1, points).round().astype(int))
            ages = [ages[i] for i in picks]
        return [[a, *(s / self.counts[a] for s in self.sums[a]), self.counts[a]] for a in ages]


def split_final(items: list[T], block: bool, result: Callable[[T], TrainResult]) -> tuple:
    """(``items`` whose ``result`` is readable now, oldest first; the rest). ``block``: all."""
    n = 0
    while n < len(items) and (block or result(items[n]).ready()):
        n += 1
    return items[:n], items[n:]


class LossBook:
    def __init__(self, counters: Counters):
        self.counters = counters
        # optimizer_stats (STATS order): by step index, and in total (at index 0)
        self._opt_by_age, self._opt_total = ByAge(), ByAge()
        self._sum, self._n = 0.0, 0
        self._first: float | None = None
        self._last: float | None = None
        self._by_age = ByAge()
        # Per-group first and last losses as sums (a last loss is kept only while needed).
        self._group_last: dict[int, float] = {}  # serial -> last loss
        self._freed: set[int] = set()  # freed groups whose losses may still be read back
        self._gfirst_sum = self._glast_sum = 0.0
        self._g_n = 0

    def add(self, ready: list[Submitted]) -> None:
        """Count final train steps: a group's update whose loss was non-finite did not run."""
        steps = bad = rows = train_steps = 0
        for serials, ages, res in ready:
            losses = res.losses.cpu().tolist()
            ok = res.updated.cpu().tolist()
            counts = res.counts.tolist()
            stats = res.stats.cpu().tolist() if res.stats is not None else None
            train_steps += any(ok)
            for i, (serial, age, loss, good, n) in enumerate(
                zip(serials, ages, losses, ok, counts, strict=True)
            ):
                if not good:
                    bad += 1
                    continue
                steps += 1
                rows += n
                self._add_loss(serial, age, loss)
                if stats is not None:
                    self._opt_by_age.add(age, stats[i])
                    self._opt_total.add(0, stats[i])
        if self._opt_total.counts:
            (clipped, share, size, norm), n = self._opt_total.sums[0], self._opt_total.counts[0]
            self.counters.set("optimizer_updates_measured", n)
            self.counters.set("optimizer_clipped_updates", int(clipped))
            self.counters.set("optimizer_clip_rate", clipped / n)
            self.counters.set("optimizer_eps_share", share / n)
            self.counters.set("optimizer_update_size", size / n)
            self.counters.set("optimizer_grad_norm", norm / n)
        self.counters.add("optimizer_steps", steps)
        self.counters.add("rows_trained", rows)
        self.counters.add("decode_steps", train_steps)
        self.counters.add("nonfinite_losses_skipped", bad)
        if self._n:
            self.counters.set("loss_first", self._first)
            self.counters.set("loss_last", self._last)
            self.counters.set("loss_mean", self._sum / self._n)

    def _add_loss(self, serial: int, age: int, loss: float) -> None:
        self._sum += loss
        self._n += 1
        if self._first is None:
            self._first = loss
        self._last = loss
        self._by_age.add(age, [loss])
        last = self._group_last.get(serial)
        if last is None:  # the group's first loss
            self._g_n += 1
            self._gfirst_sum += loss
            self._glast_sum += loss
        else:
            self._glast_sum += loss - last
        self._group_last[serial] = loss

    def freed(self, serial: int) -> None:
        """Group ``serial`` will train no more (its last losses may still be in flight)."""
        self._freed.add(serial)

    def prune(self, waiting: set[int]) -> None:
        """Forget the last loss of freed groups with no submitted update still ``waiting``."""
        for s in self._freed - waiting:
            self._group_last.pop(s, None)
            self._freed.discard(s)

    def summary(self) -> dict[str, Any]:
        return {
            "loss_first": self._first,
            "loss_last": self._last,
            "loss_mean": self._sum / self._n if self._n else None,
            "group_loss_first_mean": self._gfirst_sum / self._g_n if self._g_n else None,
            "group_loss_last_mean": self._glast_sum / self._g_n if self._g_n else None,
            # [step index within a group, mean loss over groups, number of groups]
            "loss_curve": self._by_age.curve(),
            # [step index, clip rate, eps share, update size, gradient norm, updates]
            "optimizer_curve": self._opt_by_age.curve(),
        }


class ReturnedErrors:
    """Per-request results (``tllm_results: "esamp"``): each decode row's prediction error."""

    EMPTY = {"positions": np.zeros(0, np.int64), "prediction_error": np.zeros(0, np.float32)}

    def __init__(self, name: str, limit: int, counters: Counters):
        self.name, self.counters = name, counters
        self.rows = RequestRows(limit, name)
        # (result, its rows' indices in the step's submission, their requests, positions)
        self._pending: list[tuple[TrainResult, np.ndarray, list[RequestInfo], np.ndarray]] = []
        self._waiting: Counter[str] = Counter()  # engine id -> pending steps with its rows

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
        done, self._pending = split_final(self._pending, block, lambda p: p[0])
        for res, at, requests, positions in done:
            errors = res.row_errors.numpy()[at].astype(np.float32)
            for req, a, b in request_runs(requests):
                self.rows.add(req.engine_id, positions=positions[a:b], prediction_error=errors[a:b])
            self._waiting -= Counter({r.engine_id for r in requests})  # drops those at 0
            self.counters.add("rows_returned", len(at))

    def take(self, request: RequestInfo) -> dict[str, Any]:
        return self.rows.take(request.engine_id, self.EMPTY)

    @staticmethod
    def result_bytes(max_tokens: int) -> int:
        """An upper bound of a request's result (one decode row per generated token)."""
        return array_json_bytes(max_tokens, 8) + array_json_bytes(max_tokens, 4) + 64


class Trainer:
    def __init__(
        self,
        shared: Shared,
        groups: Groups,
        losses: LossBook,
        read_deferred: Callable[[bool], None],
        returned: ReturnedErrors,
    ):
        self.s, self.groups, self.losses, self.returned = shared, groups, losses, returned
        self.read_deferred = read_deferred  # the device counters (True: wait for them)
        self.training = shared.cfg.train and shared.cfg.ablation != "frozen"
        self._pending: list[Submitted] = []
        # Warm-start steps not yet read back; True marks a warm start's first step.
        self._warm_pending: list[tuple[TrainResult, bool]] = []
        self._flushes = 0

    def on_bundle(self, bundle: Bundle) -> None:
        rows, counters = bundle.rows, self.s.counters
        is_dec = np.asarray(rows.is_decode, dtype=bool)
        if self.s.cfg.warm_start_steps > 0 and len(rows) and not is_dec.all():
            self._warm_start(bundle, is_dec)
        if len(rows) == 0 or not is_dec.any():
            return
        if self.s.cfg.skip_mixed_batches and not is_dec.all():
            counters.add("train_rows_skipped_mixed", int(is_dec.sum()))
            return
        recomputed = np.asarray(rows.recomputed, dtype=bool)  # preemption: trained on already
        sel, slots, capped = self.groups.claim(
            rows.requests, np.flatnonzero(is_dec).tolist(), lambda i, *_: not recomputed[i]
        )
        counters.add("train_rows_skipped_recomputed", int((is_dec & recomputed).sum()))
        counters.add("train_rows_skipped_cap", capped)
        # Indices into sel of the rows whose request asks for ESamp's result.
        wants = (k for k, i in enumerate(sel) if rows.requests[i].wants_result(self.returned.name))
        asking = np.fromiter(wants, np.int64)
        rid = rows_id(bundle.step, bundle.rows, sel)
        submitted = self._submit(bundle, sel, slots, 1, rid, row_errors=asking.size > 0)
        if not submitted:
            return
        res = submitted[0]
        if asking.size:
            at = [sel[k] for k in asking]
            positions = np.asarray(rows.position, np.int64)[at]
            self.returned.submitted(res, asking, [rows.requests[i] for i in at], positions)
        groups = [self.groups.by_slot[int(s)] for s in res.slots]
        self._pending.append(([g.serial for g in groups], [g.age for g in groups], res))
        for g in groups:
            g.age += 1
        self._after_submit()

    def _warm_start(self, bundle: Bundle, is_dec: np.ndarray) -> None:
        """warm_start_steps: train each new group on its first request's prompt rows, once."""
        recomputed = np.asarray(bundle.rows.recomputed, dtype=bool)
        first: dict[int, str] = {}  # id(group) -> engine id whose rows are used

        def admit(i: int, req: RequestInfo, g: Group) -> bool:
            if g.warmed and id(g) not in first:
                return False
            return first.setdefault(id(g), req.engine_id) == req.engine_id

        prompt_rows = np.flatnonzero(~is_dec & ~recomputed).tolist()
        sel, slots, capped = self.groups.claim(bundle.rows.requests, prompt_rows, admit)
        self.s.counters.add("train_rows_skipped_cap", capped)
        sel, slots = self._last_rows(sel, slots, self.s.distiller.max_step_rows)
        for slot in slots:
            self.groups.by_slot[slot].warmed = True
        submitted = self._submit(bundle, sel, slots, self.s.cfg.warm_start_steps)
        if not submitted:
            return
        self._warm_pending += [(res, k == 0) for k, res in enumerate(submitted)]
        self._after_submit()  # its counters: from the results, in flush

    def _last_rows(
        self, sel: list[int], slots: list[int], limit: int | None
    ) -> tuple[list[int], list[int]]:
        """At most ``limit`` rows (a CUDA step's packed rows), an equal share per group: each
        group's last prompt rows (a long prompt trained as far as the step holds)."""
        if limit is None or len(sel) <= limit:
            return sel, slots
        share = limit // len(set(slots))
        keep: list[int] = []
        for slot in dict.fromkeys(slots):
            keep += [k for k, s in enumerate(slots) if s == slot][-share:]
        keep.sort()
        self.s.counters.add("warm_start_rows_skipped", len(sel) - len(keep))
        return [sel[k] for k in keep], [slots[k] for k in keep]

    def _submit(
        self,
        bundle: Bundle,
        sel: list[int],
        slots: list[int],
        steps: int,
        rows: object = None,
        row_errors: bool = False,
    ) -> list[TrainResult]:
        """``steps`` train steps of rows ``sel`` (``row_errors``: the first measures them)."""
        if not sel:
            return []
        if not self.training:
            self.s.counters.add("train_rows_skipped_frozen", len(sel))
            return []
        src, tgt = bundle.hidden[self.s.src_key], bundle.hidden[self.s.tgt_key]
        slot_t = torch.tensor(slots, dtype=torch.long)
        idx = row_index(sel, src.device, self.s.arange)
        x, target = select_rows(src, sel, idx), select_rows(tgt, sel, idx)
        train = self.s.distiller.train_step
        return [train(slot_t, x, target, rows, row_errors and k == 0) for k in range(steps)]

    def _after_submit(self) -> None:
        """Read back the results of submitted train steps as the distiller allows."""
        n = len(self._pending)
        if not (self.s.on_cuda or self.s.distiller.asynchronous) or n >= _FLUSH_LIMIT:
            self.flush()
        elif self.s.distiller.asynchronous or n >= _FLUSH_EVERY:
            # Those already run, no waiting: every step on the CPU side thread; on CUDA in
            # batches (each read back is a copy and an event).
            self.flush(block=False)

    def flush(self, block: bool = True) -> None:
        """Read results back and update the counters (``block=False``: those already run)."""
        s = self.s
        if block and (self._pending or self._warm_pending):
            s.distiller.synchronize()
        elif not block:
            s.distiller.poll()  # results already copied back (CUDA: no waiting)
        s.counters.max("staleness_max", s.distiller.staleness_max())  # host-side on CUDA
        s.counters.set("eager_updates", s.distiller.eager_updates)
        s.counters.set("updates_reusing_prediction", s.distiller.updates_reusing_prediction)
        self._flushes += 1
        if block or self._flushes % _READ_EVERY == 0:
            self.read_deferred(block)
        done, self._warm_pending = split_final(self._warm_pending, block, lambda p: p[0])
        for res, first in done:  # warm-start updates: counted once final, those that ran
            ok = res.updated.cpu().numpy().astype(bool)
            s.counters.add("warm_start_steps", int(ok.sum()))
            s.counters.add("nonfinite_losses_skipped", int((~ok).sum()))
            if first:  # the groups (and their rows) that a warm start updated
                s.counters.add("warm_start_groups", int(ok.sum()))
                s.counters.add("warm_start_rows", int(np.asarray(res.counts)[ok].sum()))
        ready, self._pending = split_final(self._pending, block, lambda p: p[2])
        if ready:
            self.losses.add(ready)
        self.returned.read(block)
        self.prune_losses()

    def prune_losses(self) -> None:
        """Drop the loss state of freed groups with no update still to read back."""
        self.losses.prune({s for serials, _, _ in self._pending for s in serials})
