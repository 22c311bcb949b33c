"""CUDA path of the grouped distiller: allocated and captured at construction, replayed on a
side stream without host waits. Design: docs/consumers/esamp.md, "On a GPU"."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from algorithms.esamp import kernels
from algorithms.esamp.graph_update import slot_matmul, slots_bound, train_groups
from algorithms.esamp.kernels.op_loss_dy import loss_per_row
from algorithms.esamp.mlp import ActBuffers, forward_slots, saved_forward
from algorithms.esamp.params import STATS
from algorithms.esamp.slots import Packing, SlotDistiller, TrainResult, make_packing
from tllm_core import HostCopyRing, StagingRing, pow2_rows

log = logging.getLogger("tllm")

_PLAN_BUFFERS = 8  # pinned host plan vectors in rotation
_KINDS = ("predict", "train", "train_reuse")  # per layout (train_reuse: on the prediction's)


@dataclass(frozen=True)
class Layout:
    groups: int  # G
    rows: int  # M


def layouts(capacity: int, graph_rows: int) -> list[Layout]:
    """Every layout: groups of ``graph_rows`` rows, twice as many, ..., one group of all."""
    total = capacity * graph_rows
    out, m = [], graph_rows
    while m < total:
        out.append(Layout(total // m, m))
        m *= 2
    out.append(Layout(1, total))
    return out


@dataclass
class Batch:
    layout: Layout
    groups: np.ndarray  # indices into the step's packed groups (make_packing order)


def split(counts: np.ndarray, options: list[Layout]) -> list[Batch]:
    """Batches of the step's groups that each fit one layout (usually one batch)."""
    order = np.argsort(-counts, kind="stable")
    batches, i = [], 0
    while i < len(order):
        largest = counts[order[i]]
        fits = [lay for lay in options if lay.rows >= largest]
        if not fits:
            raise ValueError(
                f"a group has {largest} rows, more than the {options[-1].rows} packed rows "
                "(cuda_capacity x cuda_graph_max_rows)"
            )
        rest = len(order) - i
        # The shortest groups holding every remaining one, else the most groups of this size.
        lay = next((x for x in fits if x.groups >= rest), fits[0])
        take = min(rest, lay.groups)
        batches.append(Batch(lay, np.sort(order[i : i + take])))
        i += take
    return batches


def fill_plan(
    out: np.ndarray,
    batch: Batch,
    pk: Packing,
    submitted: np.ndarray,
    total: int,
    capacity: int,
    ring_row: int,
) -> None:
    """One batch's row plan into pinned ``out``: ``pos [T]``, ``dest [T]`` (``T``: the trash
    row), ``group_slot [C]`` (-1: padding), ``submitted [C]``, ``ring_row``, the rows' mask."""
    row_group, row_pos = pk.row_group, pk.row_pos
    g_of = np.full(len(pk.slots), -1, dtype=np.int64)
    g_of[batch.groups] = np.arange(len(batch.groups))
    n = len(row_group)
    pos, dest = out[:total], out[total : 2 * total]
    pos.fill(total)
    dest.fill(total)
    mine = g_of[row_group] >= 0
    pos[:n][mine] = g_of[row_group[mine]] * batch.layout.rows + row_pos[mine]
    dest[:n][mine] = np.flatnonzero(mine)
    gs = out[2 * total : 2 * total + capacity]
    sub = out[2 * total + capacity : 2 * total + 2 * capacity]
    gs.fill(-1)
    sub.fill(0)
    k = len(batch.groups)
    gs[:k] = pk.slots[batch.groups]
    sub[:k] = submitted[batch.groups]
    out[2 * total + 2 * capacity] = ring_row
    mask = out[2 * total + 2 * capacity + 1 :].view(np.uint8)[:total]
    mask.fill(0)
    mask[pos[:n][mine]] = 1


def plan_size(total: int, capacity: int) -> int:
    return 2 * total + 2 * capacity + 1 + -(-total // 8)


RESULT_ROWS = 512  # update results kept on the device between copies (every _COPY_EVERY)
_COPY_EVERY = 32


@dataclass
class Pending:
    """One submitted train step."""

    parts: list[tuple[int, np.ndarray]]  # per batch: (ring row, indices of the step's groups)
    res: TrainResult  # filled in from the ring
    serial: int = 0  # updates logged before and including this one


class ResultLog:
    """The device ring of update results and ``stale``, copied back without blocking (but drain)."""

    def __init__(self, capacity: int, stats: bool, device: torch.device):
        rows = self.rows = RESULT_ROWS
        self.losses = torch.zeros(rows, capacity, device=device)
        self.ok = torch.zeros(rows, capacity, device=device)
        self.stats = torch.zeros(rows, capacity, len(STATS), device=device) if stats else None
        self.stale = torch.zeros(1, dtype=torch.long, device=device)  # max staleness seen
        self._copies = HostCopyRing(self._device_buffers(), 2, read=self._read)
        self._pending: list[Pending] = []
        self._next = 0  # updates logged so far
        self._copied = 0  # updates covered by the last copy issued
        self.staleness_max = 0

    @property
    def host_waits(self) -> int:
        """Copies the host had to wait for (a buffer still in flight, drain)."""
        return self._copies.waits

    def _device_buffers(self) -> list[torch.Tensor]:
        return [self.losses, self.ok, self.stale] + ([self.stats] if self.stats is not None else [])

    def next_row(self) -> int:
        if self._next - self._copied >= self.rows:
            raise RuntimeError("result ring overrun: copy() was not called in time")
        row = self._next % self.rows
        self._next += 1
        return row

    def add(self, p: Pending) -> None:
        p.serial = self._next
        self._pending.append(p)

    def maybe_copy(self, stream) -> None:
        """Start a background copy every _COPY_EVERY updates (and before the ring wraps)."""
        if self._next - self._copied >= min(_COPY_EVERY, self.rows // 2):
            self.copy(stream)

    def copy(self, stream) -> None:
        """Copy the ring to the host without blocking, after the updates logged."""
        if self._next == self._copied:
            return
        self._copies.send(self._device_buffers(), tag=self._next, stream=stream)
        self._copied = self._next

    def poll(self) -> None:
        self._copies.arrived()  # no waiting

    def drain(self, stream) -> None:
        """Copy and wait for every result logged (a host sync)."""
        self.copy(stream)
        self._copies.arrived(wait=True)

    def _read(self, serial: int, host: list[torch.Tensor]) -> None:
        losses, ok, stale = host[0], host[1], host[2]
        stats = host[3] if self.stats is not None else None
        self.staleness_max = max(self.staleness_max, int(stale[0]))
        while self._pending and self._pending[0].serial <= serial:
            p = self._pending.pop(0)
            res = p.res
            for row, groups in p.parts:
                k = len(groups)
                idx = torch.from_numpy(groups)
                res.losses[idx] = losses[row, :k]
                res.updated[idx] = ok[row, :k] > 0
                if res.stats is not None and stats is not None:
                    res.stats[idx] = stats[row, :k]
            res.done.set()


@contextmanager
def _matmul_precision(tf32: bool) -> Iterator[None]:
    """cuBLAS products in TF32 (or not) for the block, as the graphs bake it in."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


class CudaGroupedDistiller(SlotDistiller):
    growable = False  # the graphs and the memory profile hold the state's storage
    asynchronous = True

    def __init__(
        self,
        hidden_size: int,
        *,
        device: torch.device | str = "cuda",
        use_cuda_graph: bool = True,
        capacity: int = 8,
        graph_max_rows: int = 16,
        tf32: bool = False,
        **kwargs: Any,
    ):
        if graph_max_rows < 1:
            raise ValueError(f"graph_max_rows must be >= 1, got {graph_max_rows}")
        self.stream: torch.cuda.Stream | None = None
        super().__init__(hidden_size, device=device, capacity=capacity, **kwargs)
        dev, h = self.device, self.shape.hidden_size
        self.tf32 = tf32  # TF32 products (cuBLAS and the Triton kernels), opt-in
        self._precision = "tf32" if tf32 else "ieee"
        self.stream = torch.cuda.Stream(device=dev)
        self.graph_rows = pow2_rows(graph_max_rows)
        self.total_rows = t = capacity * self.graph_rows
        self.max_step_rows = t
        self.layouts = layouts(capacity, self.graph_rows)
        # Packed buffers (row t: the trash row of rows not in a batch).
        self.stage_x = torch.zeros(t, h, device=dev)
        self.stage_t = torch.zeros(t, h, device=dev)
        # The packed inputs and every block's output, [T + 1, H] each, in one allocation
        # (equally spaced block inputs: one Adam launch for every gate and up).
        nb, i = self.shape.num_blocks, self.shape.intermediate_size
        self.hs = torch.zeros((nb + 1) * (t + 1) * h, device=dev)
        self.xp = self.hs[: (t + 1) * h].view(t + 1, h)
        self.tp = torch.zeros(t + 1, h, device=dev)
        self.y = torch.zeros(t + 1, h, device=dev)
        # The forward (kept for an update of the same rows): a, u, s, p [T, I] per block.
        self.acts = torch.zeros(nb * 4 * t * i, device=dev)
        self._predicted: tuple | None = None  # the _key of the forward in acts (None: none)
        self.plan = torch.zeros(plan_size(t, capacity), dtype=torch.long, device=dev)
        self._plans = StagingRing(dev, _PLAN_BUFFERS, numel=plan_size(t, capacity))
        self.results = ResultLog(capacity, self.hp.stats, dev)
        self._stats = torch.zeros(capacity, len(STATS), device=dev)
        self._copied = torch.cuda.Event()  # the last train step's rows are in the buffers
        self._graphs: dict[tuple[str, Layout], torch.cuda.CUDAGraph] = {}
        self.stream.wait_stream(torch.cuda.current_stream(dev))  # initial state
        self._warm_up()
        if use_cuda_graph:
            self._capture()
        self.stream.synchronize()

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The update graph of the first layout (None: updates run eagerly)."""
        return self._graphs.get(("train", self.layouts[0]))

    def _drain(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _ordered(self, change) -> None:
        with torch.cuda.stream(self.stream):
            change()

    def synchronize(self) -> None:
        """Host wait for the side stream and every update result (reading back / shutdown)."""
        self.results.drain(self.stream)
        self._drain()

    def poll(self) -> None:
        self.results.poll()

    def staleness_max(self) -> int:
        """The device-side maximum as of the last result copy (exact after synchronize)."""
        return self.results.staleness_max

    def _pack(
        self, lay: Layout, src: torch.Tensor, dst: torch.Tensor, zero: bool = True
    ) -> torch.Tensor:
        """``src``'s rows packed into ``dst``; the other rows zeroed unless ``zero=False``."""
        t = self.total_rows
        if zero:
            dst.zero_()
        dst.index_copy_(0, self.plan[:t], src)
        return dst[: lay.groups * lay.rows].view(lay.groups, lay.rows, -1)

    def _group_slot(self, lay: Layout) -> torch.Tensor:
        t = self.total_rows
        return self.plan[2 * t : 2 * t + lay.groups]

    def _mm(self, gs: torch.Tensor) -> Callable:
        return slots_bound(partial(slot_matmul, precision=self._precision), gs)

    def _act_buffers(self, lay: Layout) -> ActBuffers:
        """Per block (h_out, a, u, s, p) ``[G, M, .]``: views of :attr:`hs` and :attr:`acts`."""
        h, i, t = self.shape.hidden_size, self.shape.intermediate_size, self.total_rows
        g, m = lay.groups, lay.rows
        out = []
        for b in range(self.shape.num_blocks):
            at = (b + 1) * (t + 1) * h
            block = [self.hs[at : at + g * m * h].view(g, m, h)]
            for j in range(4):
                at = (4 * b + j) * t * i
                block.append(self.acts[at : at + g * m * i].view(g, m, i))
            out.append(tuple(block))
        return out

    def _predict_body(self, lay: Layout) -> None:
        t, c = self.total_rows, self.capacity
        gs = self._group_slot(lay)
        sub = self.plan[2 * t + c : 2 * t + c + lay.groups]
        kernels.stale_max(sub, self.applied, gs, self.results.stale)
        xp = self._pack(lay, self.stage_x, self.xp)
        h = forward_slots(self.theta, self.shape, xp, self._mm(gs), self._act_buffers(lay))[0]
        if self.zero_output:
            flat = (h - xp).reshape(-1, h.shape[-1])
            rows = self.plan[:t].clamp(max=flat.shape[0] - 1)
        else:  # the last block's [T + 1, H] segment of hs: trash row T needs no clamp
            nb, hid = self.shape.num_blocks, self.shape.hidden_size
            flat = self.hs[nb * (t + 1) * hid :].view(t + 1, hid)
            rows = self.plan[:t]
        self.y.index_copy_(0, self.plan[t : 2 * t], flat.index_select(0, rows))

    def _train_body(self, lay: Layout, reuse: bool = False) -> None:
        """The update; ``reuse``: on the last prediction's packed rows and forward."""
        t, c = self.total_rows, self.capacity
        gs = self._group_slot(lay)
        if reuse:
            xp = self.xp[: lay.groups * lay.rows].view(lay.groups, lay.rows, -1)
            forward = saved_forward(xp, self._act_buffers(lay))
        else:  # the forward into the same buffers (its block inputs equally spaced)
            xp = self._pack(lay, self.stage_x, self.xp)
            forward = forward_slots(
                self.theta, self.shape, xp, self._mm(gs), self._act_buffers(lay)
            )
        # Targets are read on the marked rows only (kernels.loss_dy): no zeroing.
        tp = self._pack(lay, self.stage_t, self.tp, zero=False)
        if self.zero_output:
            tp.add_(xp)  # the blocks learn target + x, so that blocks(x) - x learns target
        # The packed rows' mask came with the plan (filled on the host): a view, no copy.
        at, n = 8 * (2 * t + 2 * c + 1), lay.groups * lay.rows
        mask = self.plan.view(torch.uint8)[at : at + n].view(torch.bool).view(lay.groups, -1)
        stats = self._stats[: lay.groups] if self.hp.stats else None
        state = (self.theta, self.m, self.v, self.step)
        losses, ok = train_groups(
            *state, gs, xp, tp, mask, self.shape, self.hp, self.applied, stats,
            forward=forward, precision=self._precision,
        )  # fmt: skip
        # Row ring[0] of the result ring, its first G columns: one indexed copy each.
        ring, g = self.plan[2 * t + 2 * c : 2 * t + 2 * c + 1], lay.groups
        self.results.losses[:, :g].index_copy_(0, ring, losses[None])
        self.results.ok[:, :g].index_copy_(0, ring, ok[None].float())
        if stats is not None:
            self.results.stats[:, :g].index_copy_(0, ring, stats[None])

    def _body(self, kind: str) -> Callable[[Layout], None]:
        if kind == "predict":
            return self._predict_body
        return partial(self._train_body, reuse=kind == "train_reuse")

    def _run(self, kind: str, lay: Layout) -> None:
        if kind == "train_reuse":
            self.updates_reusing_prediction += 1  # counted where it runs
        graph = self._graphs.get((kind, lay))
        if graph is not None:
            graph.replay()
            return
        with torch.no_grad(), _matmul_precision(self.tf32):
            self._body(kind)(lay)

    def _warm_up(self) -> None:
        """Run every body once with no slot: lazy allocations inside vLLM's memory profile."""
        with torch.cuda.stream(self.stream), torch.no_grad(), _matmul_precision(self.tf32):
            t, c = self.total_rows, self.capacity
            self.plan.fill_(-1)  # every group padding
            self.plan[: 2 * t].fill_(t)  # every row to the trash row
            self.plan[2 * t + 2 * c :].fill_(0)  # ring row 0, no packed row marked
            for lay in self.layouts:
                for kind in _KINDS:
                    self._body(kind)(lay)

    def _capture(self) -> None:
        """Capture the predict and two update graphs of every layout in one memory pool."""
        pool = None
        try:
            for lay in self.layouts:
                for kind in _KINDS:
                    g = torch.cuda.CUDAGraph()
                    with (
                        _matmul_precision(self.tf32),
                        torch.no_grad(),
                        torch.cuda.graph(
                            g, pool=pool, stream=self.stream, capture_error_mode="thread_local"
                        ),
                    ):
                        self._body(kind)(lay)
                    self._graphs[(kind, lay)], pool = g, g.pool()
        except RuntimeError as err:
            # Capture is an optimisation: fall back to eager runs, loudly.
            self.graph_failures += 1
            self._graphs.clear()
            log.warning(
                "esamp: CUDA graph capture failed (%s); predict and update steps run "
                "eagerly (counters graph_failures, eager_updates)",
                err,
            )

    def _send_plan(self, batch: Batch, pk, ring_row: int) -> None:
        """One pinned host-to-device copy of the batch's plan, on the side stream."""
        i, host = self._plans.take(self.plan.numel())
        sub = self._submitted[pk.slots]
        fill_plan(host.numpy(), batch, pk, sub, self.total_rows, self.capacity, ring_row)
        self._plans.send(i, self.plan, self.stream)

    def _check_rows(self, n: int) -> None:
        if n > self.total_rows:
            raise ValueError(
                f"esamp: a step of {n} rows exceeds the CUDA distiller's "
                f"{self.total_rows} packed rows (capacity x cuda_graph_max_rows); raise "
                "cuda_rows_per_step to vLLM's max_num_seqs"
            )

    def _stage(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst[: src.shape[0]].copy_(src)
        src.record_stream(self.stream)

    def _forward(self, pk: Packing, batches: list[Batch], x: torch.Tensor) -> None:
        """The prediction of ``x`` into ``y`` (on the side stream)."""
        self._stage(self.stage_x, x)
        for batch in batches:
            self._send_plan(batch, pk, 0)
            self._run("predict", batch.layout)

    def predict(self, slots: torch.Tensor, x: torch.Tensor, rows_id: object = None) -> torch.Tensor:
        """As the base class (a same ``rows_id`` is the caller's promise of the same ``x``)."""
        self._predicted = None  # the buffers are about to hold this prediction's forward
        pk = make_packing(slots)
        if not pk.slots.size:
            return self.y[:0]
        self._check_live(pk)
        self._check_rows(x.shape[0])
        batches = split(pk.counts, self.layouts)
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)  # x was produced on the main stream
        with torch.cuda.stream(self.stream):
            self._forward(pk, batches, x)
        cur.wait_stream(self.stream)  # the sampler reads y on the main stream
        self._predicted = self._key(rows_id, pk, batches)
        # A view of the static output: valid until the next predict.
        return self.y[: x.shape[0]]

    def _key(self, rows_id: object, pk, batches: list[Batch]) -> tuple | None:
        """What names the forward a prediction leaves in the buffers (None: not reusable)."""
        if rows_id is None or len(batches) != 1:
            return None
        lay = batches[0].layout
        return rows_id, self._version, pk.slots.tobytes(), pk.row_group.tobytes(), lay

    def _train(
        self, pk: Packing, x: torch.Tensor, target: torch.Tensor, rows_id: object, row_errors: bool
    ) -> TrainResult:
        """The main stream waits only for the rows' copy."""
        self._check_rows(max(x.shape[0], target.shape[0]))
        batches = split(pk.counts, self.layouts)
        key = self._key(rows_id, pk, batches)
        reuse = key is not None and key == self._predicted
        # Before the submission is counted: a prediction run for them reads no staleness.
        errors = self._row_errors(pk, batches, x, target, reuse) if row_errors else None
        self._predicted = None  # this update changes the parameters the forward used
        self._submitted[pk.slots] += 1
        self._version += 1
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        parts = []
        kind = "train_reuse" if reuse else "train"
        with torch.cuda.stream(self.stream), torch.inference_mode(False):
            if not reuse:  # else xp already holds these rows, packed by the prediction
                self._stage(self.stage_x, x)
            self._stage(self.stage_t, target)
            self._copied.record(self.stream)
            for batch in batches:
                row = self.results.next_row()
                self._send_plan(batch, pk, row)
                if (kind, batch.layout) not in self._graphs:
                    self.eager_updates += 1
                self._run(kind, batch.layout)
                parts.append((row, batch.groups))
        cur.wait_event(self._copied)  # the next forward may overwrite the rows: their copy only
        # Not inference tensors: results are written in when they arrive, maybe outside it.
        with torch.inference_mode(False):
            res = TrainResult.unfilled(pk, self.hp.stats, row_errors=errors)
        self.results.add(Pending(parts, res))
        self.results.maybe_copy(self.stream)
        return res

    def _row_errors(
        self, pk, batches: list[Batch], x: torch.Tensor, target: torch.Tensor, reuse: bool
    ) -> torch.Tensor:
        """Each row's error before the update, in pinned memory: final with the results."""
        n = x.shape[0]
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        per_row = loss_per_row(self.shape.hidden_size, self.hp.loss_reduction)
        with torch.cuda.stream(self.stream), torch.inference_mode(False), torch.no_grad():
            if not reuse:
                self._forward(pk, batches, x)
            # y: blocks(x) (- x with zero_output); target: what that is trained toward.
            diff = self.y[:n] - target.float()
            target.record_stream(self.stream)
            err = diff.square_().sum(-1).div_(per_row)
            host = torch.empty(n, dtype=torch.float32).pin_memory()
            host.copy_(err, non_blocking=True)
        return host
