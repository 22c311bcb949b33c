"""CUDA path of the grouped distiller: same math and interface as the CPU class, but

- everything is allocated at construction: the consumer is built inside vLLM's
  ``load_model``, before vLLM profiles memory and sizes the KV cache, so the slots'
  parameters and Adam state (a fixed ``capacity``: this distiller never grows), the static
  input buffers and the graph pool are accounted for;
- the update step is captured as a CUDA graph at construction for every bucket (groups and
  rows per group, each a power of two, up to ``capacity`` and ``graph_max_rows``), never
  during generation. A failed capture is counted (``graph_failures``) and logged, and that
  bucket's updates run eagerly; a step outside the captured buckets also runs eagerly
  (``eager_updates``, logged once);
- prediction and training run on a side stream, ordered against the main (current) stream
  with CUDA events only (``wait_stream`` / ``wait_event``): no device-wide or host sync;
- training inputs are packed by the main stream into the static ``[G, M]`` buffers (padded
  rows are masked out of the loss, padded groups point at a scratch slot and are never
  updated), then the bucket's graph is replayed.

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

from algorithms.esamp.graph_update import train_packed
from algorithms.esamp.mlp import forward_packed
from algorithms.esamp.packing import Packing, make_packing
from algorithms.esamp.slots import SlotDistiller, TrainResult

log = logging.getLogger("tllm")


def _bucket(n: int) -> int:
    """Next power of two (>= 1): a few graphs cover every batch shape."""
    return 1 << max(0, int(n) - 1).bit_length()


def _buckets(limit: int) -> list[int]:
    """Every bucket up to ``_bucket(limit)``: 1, 2, 4, ..."""
    return [1 << k for k in range(_bucket(limit).bit_length())]


def _to_device(a: Any, device: torch.device) -> torch.Tensor:
    # Pinned host memory + non_blocking: an async copy; the caching host allocator keeps the
    # block alive until the copy has run.
    return torch.as_tensor(a).pin_memory().to(device, non_blocking=True)


@dataclass
class _GraphEntry:
    xp: torch.Tensor  # [G, M, H] static inputs
    tp: torch.Tensor
    mask: torch.Tensor  # [G, M] bool
    gslots: torch.Tensor  # [G] long
    gvalid: torch.Tensor  # [G] bool
    losses: torch.Tensor | None = None  # [G] static outputs
    ok: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class CudaGroupedDistiller(SlotDistiller):
    _SCRATCH = 1  # one extra slot at index ``capacity`` absorbs padded graph groups
    growable = False  # graphs and the memory profile hold the state's storage

    def __init__(
        self,
        hidden_size: int,
        *,
        device: torch.device | str = "cuda",
        use_cuda_graph: bool = True,
        capacity: int = 64,
        graph_max_rows: int = 64,
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
        self._pool = None
        # Guards the static input buffers: the main stream must not refill them before the
        # side stream has consumed the previous step.
        self._inputs_free = torch.cuda.Event()
        self._stale = torch.zeros((), dtype=torch.long, device=dev)
        # Static inputs of the largest bucket; every bucket uses a prefix of them (replays
        # are serialized on the side stream and guarded by _inputs_free).
        g, m, h = _bucket(capacity), _bucket(graph_max_rows), self.shape.hidden_size
        self._static = _GraphEntry(
            xp=torch.zeros(g * m * h, device=dev),
            tp=torch.zeros(g * m * h, device=dev),
            mask=torch.zeros(g * m, dtype=torch.bool, device=dev),
            gslots=torch.full((g,), self.scratch_slot, dtype=torch.long, device=dev),
            gvalid=torch.zeros(g, dtype=torch.bool, device=dev),
        )
        self.stream.wait_stream(torch.cuda.current_stream(dev))  # initial state
        self._graphs: dict[tuple[int, int], _GraphEntry] = {}
        for gb in _buckets(capacity):
            for mb in _buckets(graph_max_rows):
                self._graphs[(gb, mb)] = self._new_entry(gb, mb)
        self.stream.synchronize()

    @property
    def scratch_slot(self) -> int:
        return self.capacity

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
            rg, rp = _to_device(pk.row_group, self.device), _to_device(pk.row_pos, self.device)
            xp = torch.zeros(len(pk.slots), pk.max_rows, x.shape[-1], device=self.device)
            xp[rg, rp] = x.float()
            gs = _to_device(pk.slots, self.device)
            lag = _to_device(self._submitted[pk.slots], self.device) - self.applied[gs]
            torch.maximum(self._stale, lag.max(), out=self._stale)
            y = forward_packed(self.theta.index_select(0, gs), xp, self.shape)[rg, rp]
        x.record_stream(self.stream)
        cur.wait_stream(self.stream)  # the sampler consumes y on the main stream
        y.record_stream(cur)
        return y

    # -- train ----------------------------------------------------------------------
    def _new_entry(self, g: int, m: int) -> _GraphEntry:
        """The entry of bucket ``(g, m)``: views of the static inputs, and its graph
        captured now when graphs are on."""
        h, s = self.shape.hidden_size, self._static
        e = _GraphEntry(
            xp=s.xp[: g * m * h].view(g, m, h),
            tp=s.tp[: g * m * h].view(g, m, h),
            mask=s.mask[: g * m].view(g, m),
            gslots=s.gslots[:g],
            gvalid=s.gvalid[:g],
        )
        if self.use_cuda_graph:
            self._capture(e)
        return e

    def _transient_entry(self, g: int, m: int) -> _GraphEntry:
        """Buffers for a step outside the captured buckets (run eagerly, counted)."""
        h, dev = self.shape.hidden_size, self.device
        self.eager_updates += 1
        if not self._warned_eager:
            self._warned_eager = True
            log.warning(
                "esamp: an update step with %d rows in one group exceeds the CUDA graph "
                "buckets (graph_max_rows); such steps run eagerly (counter eager_updates)",
                m,
            )
        return _GraphEntry(
            xp=torch.zeros(g, m, h, device=dev),
            tp=torch.zeros(g, m, h, device=dev),
            mask=torch.zeros(g, m, dtype=torch.bool, device=dev),
            gslots=torch.full((g,), self.scratch_slot, dtype=torch.long, device=dev),
            gvalid=torch.zeros(g, dtype=torch.bool, device=dev),
        )

    def _run(self, e: _GraphEntry) -> tuple[torch.Tensor, torch.Tensor]:
        return train_packed(
            self.theta,
            self.m,
            self.v,
            self.step,
            e.gslots,
            e.gvalid,
            e.xp,
            e.tp,
            e.mask,
            self.shape,
            self.hp,
            applied=self.applied,
        )

    def _capture(self, e: _GraphEntry) -> None:
        """Warm up and capture the update for this bucket. With all groups invalid (as the
        buffers are at construction) the warm-up runs change no state. Capture synchronizes
        the device (``torch.cuda.graph`` does): it happens only here, at construction.

        Graphs share one memory pool: safe because replays are serialized on one stream and
        each graph's static outputs stay referenced."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                for _ in range(2):
                    self._run(e)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self.stream, capture_error_mode="thread_local"
            ):
                e.losses, e.ok = self._run(e)
            e.graph = graph
        except RuntimeError as err:
            # Capture is an optimisation: fall back to eager updates for this bucket, loudly.
            self.graph_failures += 1
            e.graph = None
            log.warning(
                "esamp: CUDA graph capture failed for bucket %s (%s); its update steps run "
                "eagerly (counters graph_failures, eager_updates)",
                tuple(e.xp.shape[:2]),
                err,
            )

    def _fill(self, e: _GraphEntry, pk: Packing, x: torch.Tensor, target: torch.Tensor) -> None:
        """Pack the rows into the static buffers, on the main stream (the bundle tensors are
        only valid there and during the call)."""
        dev, gp = self.device, len(pk.slots)
        cur = torch.cuda.current_stream(dev)
        cur.wait_event(self._inputs_free)  # previous replay has read the buffers
        rg, rp = _to_device(pk.row_group, dev), _to_device(pk.row_pos, dev)
        e.xp.zero_()
        e.tp.zero_()
        e.mask.zero_()
        e.xp[rg, rp] = x.float()
        e.tp[rg, rp] = target.float()
        e.mask[rg, rp] = True
        e.gslots.fill_(self.scratch_slot)
        e.gslots[:gp] = _to_device(pk.slots, dev)
        e.gvalid.zero_()
        e.gvalid[:gp] = True

    def _train(self, pk: Packing, x: torch.Tensor, target: torch.Tensor) -> TrainResult:
        key = (_bucket(len(pk.slots)), _bucket(pk.max_rows))
        e = self._graphs.get(key) or self._transient_entry(*key)
        self._fill(e, pk, x, target)
        gp = len(pk.slots)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if e.graph is not None:
                e.graph.replay()
                losses, ok = e.losses[:gp].clone(), e.ok[:gp].clone()
            else:
                if key in self._graphs:  # a bucket whose capture failed
                    self.eager_updates += 1
                losses, ok = self._run(e)
                losses, ok = losses[:gp], ok[:gp]
            self._inputs_free.record(self.stream)
        return TrainResult(pk.slots, losses, ok)
