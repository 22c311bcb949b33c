"""CUDA path of the grouped distiller: same math and interface as the CPU class, but

- everything is allocated at construction: the consumer is built inside vLLM's
  ``load_model``, before vLLM profiles memory and sizes the KV cache, so the slots'
  parameters and Adam state (a fixed ``capacity``: this distiller never grows), the static
  input buffers and the graph pool are accounted for (the sizes are the memory plan's,
  :mod:`algorithms.esamp.memory_plan`);
- the update is dense over slots: one step computes every slot of the state in place on
  its own rows (slots without rows are masked and keep their state), so nothing is gathered
  or scattered and one CUDA graph, captured at construction, covers every step with up to
  ``graph_max_rows`` rows per group. A failed capture is counted (``graph_failures``) and
  logged, and updates then run eagerly; a step with more rows in one group also runs
  eagerly (``eager_updates``, logged once);
- prediction reads the state rows as views (no gather) and runs, like training, on a side
  stream ordered against the main (current) stream with CUDA events only
  (``wait_stream`` / ``wait_event``): no device-wide or host sync;
- training inputs are packed by the main stream into the static ``[S, M]`` buffers (slot
  ``s``'s rows at ``[s, :count]``), then the graph is replayed.

Ordering: every predict and train is enqueued on the one side stream, so a prediction always
sees every update enqueued before it (strict staleness; measured on the device, read at
:meth:`CudaGroupedDistiller.staleness_max`). Importing this module needs no GPU.

**This path has never run on a GPU**: no GPU was available where it was written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from algorithms.esamp.adam import STATS
from algorithms.esamp.graph_update import train_dense
from algorithms.esamp.memory_plan import round_rows as _bucket
from algorithms.esamp.mlp import forward_packed
from algorithms.esamp.packing import Packing, make_packing
from algorithms.esamp.slots import SlotDistiller, TrainResult

log = logging.getLogger("tllm")


def _to_device(a: Any, device: torch.device) -> torch.Tensor:
    # Pinned host memory + non_blocking: an async copy; the caching host allocator keeps the
    # block alive until the copy has run.
    return torch.as_tensor(a).pin_memory().to(device, non_blocking=True)


@dataclass
class _Inputs:
    xp: torch.Tensor  # [S, M, H]: slot s's rows at [s, :count]
    tp: torch.Tensor
    mask: torch.Tensor  # [S, M] bool
    valid: torch.Tensor  # [S] bool: slots with rows in the step
    losses: torch.Tensor | None = None  # [S] static outputs of the graph
    ok: torch.Tensor | None = None
    stats: torch.Tensor | None = None  # [S, len(STATS)] written by the update (optimizer_stats)

    @classmethod
    def zeros(cls, slots: int, rows: int, hidden: int, device: torch.device) -> _Inputs:
        return cls(
            xp=torch.zeros(slots, rows, hidden, device=device),
            tp=torch.zeros(slots, rows, hidden, device=device),
            mask=torch.zeros(slots, rows, dtype=torch.bool, device=device),
            valid=torch.zeros(slots, dtype=torch.bool, device=device),
            stats=torch.full((slots, len(STATS)), float("nan"), device=device),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The inputs, refilled each step."""
        return (self.xp, self.tp, self.mask, self.valid)

    def allocated(self) -> tuple[torch.Tensor, ...]:
        """Every tensor :meth:`zeros` allocated (the inputs and the stats the update writes)."""
        return (*self.tensors(), self.stats)


class CudaGroupedDistiller(SlotDistiller):
    growable = False  # the graph and the memory profile hold the state's storage

    def __init__(
        self,
        hidden_size: int,
        *,
        device: torch.device | str = "cuda",
        use_cuda_graph: bool = True,
        capacity: int = 8,
        graph_max_rows: int = 16,
        **kwargs: Any,
    ):
        if graph_max_rows < 1:
            raise ValueError(f"graph_max_rows must be >= 1, got {graph_max_rows}")
        self.stream: torch.cuda.Stream | None = None
        super().__init__(hidden_size, device=device, capacity=capacity, **kwargs)
        dev = self.device
        self.stream = torch.cuda.Stream(device=dev)
        self.use_cuda_graph = use_cuda_graph
        self.graph_failures = 0
        self.eager_updates = 0
        self._warned_eager = False
        self.graph: torch.cuda.CUDAGraph | None = None
        # Guards the static input buffers: the main stream must not refill them before the
        # side stream has consumed the previous step.
        self._inputs_free = torch.cuda.Event()
        self._stale = torch.zeros((), dtype=torch.long, device=dev)
        self.graph_rows = _bucket(graph_max_rows)
        self._static = _Inputs.zeros(capacity, self.graph_rows, self.shape.hidden_size, dev)
        self.stream.wait_stream(torch.cuda.current_stream(dev))  # initial state
        if use_cuda_graph:
            self._capture()
        self.stream.synchronize()

    # -- ordering ---------------------------------------------------------------------
    def _drain(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _ordered(self, change) -> None:
        with torch.cuda.stream(self.stream):
            change()

    def synchronize(self) -> None:
        """Host wait for the side stream (only for reading losses back / shutdown)."""
        self._drain()

    def staleness_max(self) -> int:
        """Reads the device-side maximum: a host sync (call it where one is paid anyway)."""
        self._drain()
        return int(self._stale.item())

    # -- predict ----------------------------------------------------------------------
    def predict(self, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        pk = make_packing(slots)
        if not pk.slots.size:
            return torch.zeros(0, self.shape.hidden_size, device=x.device)
        self._check_live(pk)
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)  # x was produced on the main stream
        with torch.cuda.stream(self.stream), torch.no_grad():
            dev = self.device
            rs = _to_device(pk.slots[pk.row_group], dev)
            rp = _to_device(pk.row_pos, dev)
            # Every slot's weights as views (dense, like the update): no [G, P] gather.
            xp = torch.zeros(self.capacity, pk.max_rows, x.shape[-1], device=dev)
            xp[rs, rp] = x.float()
            gs = _to_device(pk.slots, dev)
            lag = _to_device(self._submitted[pk.slots], dev) - self.applied.index_select(0, gs)
            torch.maximum(self._stale, lag.max(), out=self._stale)
            y = forward_packed(self.theta, xp, self.shape)[rs, rp]
        x.record_stream(self.stream)
        cur.wait_stream(self.stream)  # the sampler consumes y on the main stream
        y.record_stream(cur)
        return y

    # -- train ----------------------------------------------------------------------
    def _run(self, e: _Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        return train_dense(
            self.theta,
            self.m,
            self.v,
            self.step,
            e.valid,
            e.xp,
            e.tp,
            e.mask,
            self.shape,
            self.hp,
            applied=self.applied,
            stats=e.stats,
        )

    def _capture(self) -> None:
        """Warm up and capture the update. With no slot valid (as the buffers are at
        construction) the warm-up runs change no state. Capture synchronizes the device
        (``torch.cuda.graph`` does): it happens only here, at construction."""
        e = self._static
        try:
            with torch.cuda.stream(self.stream):
                for _ in range(2):
                    self._run(e)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                e.losses, e.ok = self._run(e)
            self.graph = graph
        except RuntimeError as err:
            # Capture is an optimisation: fall back to eager updates, loudly.
            self.graph_failures += 1
            self.graph = None
            log.warning(
                "esamp: CUDA graph capture of the update failed (%s); update steps run "
                "eagerly (counters graph_failures, eager_updates)",
                err,
            )

    def _inputs_for(self, max_rows: int) -> _Inputs:
        """The static buffers, or fresh ones for a step with more rows per group than the
        graph holds (run eagerly, counted)."""
        if max_rows <= self.graph_rows:
            return self._static
        if not self._warned_eager:
            self._warned_eager = True
            log.warning(
                "esamp: an update step with %d rows in one group exceeds the CUDA graph's "
                "%d (graph_max_rows); such steps run eagerly (counter eager_updates)",
                max_rows,
                self.graph_rows,
            )
        e = _Inputs.zeros(self.capacity, _bucket(max_rows), self.shape.hidden_size, self.device)
        for t in e.allocated():
            t.record_stream(self.stream)  # made on the main stream, used on the side one
        return e

    def _fill(self, e: _Inputs, pk: Packing, x: torch.Tensor, target: torch.Tensor) -> None:
        """Pack the rows into the input buffers, on the main stream (the bundle tensors are
        only valid there and during the call)."""
        dev = self.device
        cur = torch.cuda.current_stream(dev)
        cur.wait_event(self._inputs_free)  # previous replay has read the buffers
        rs = _to_device(pk.slots[pk.row_group], dev)
        rp = _to_device(pk.row_pos, dev)
        for t in e.tensors():
            t.zero_()
        e.xp[rs, rp] = x.float()
        e.tp[rs, rp] = target.float()
        e.mask[rs, rp] = True
        e.valid[_to_device(pk.slots, dev)] = True

    def _train(self, pk: Packing, x: torch.Tensor, target: torch.Tensor) -> TrainResult:
        e = self._inputs_for(pk.max_rows)
        self._fill(e, pk, x, target)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            gs = _to_device(pk.slots, self.device)
            if e is self._static and self.graph is not None:
                self.graph.replay()
                losses, ok = e.losses, e.ok
            else:
                self.eager_updates += 1
                losses, ok = self._run(e)
            losses, ok = losses.index_select(0, gs), ok.index_select(0, gs)
            stats = e.stats.index_select(0, gs) if self.hp.stats else None
            self._inputs_free.record(self.stream)
        return TrainResult(pk.slots, losses, ok, stats=stats)
