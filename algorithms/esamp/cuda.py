"""CUDA path of the grouped distiller: same math and interface as the CPU class, but

- prediction and training run on a side stream, ordered against the main (current) stream
  with CUDA events only (``wait_stream`` / ``wait_event``): no device-wide or host sync;
- training inputs are packed by the main stream into static ``[G, M]`` buffers (fixed
  capacity, bucketed to powers of two; padded rows are masked out of the loss, padded groups
  point at a scratch slot and are never updated), then the update step is replayed from a
  CUDA graph captured for that bucket.

Ordering: every predict and train is enqueued on the one side stream, so a prediction always
sees every update enqueued before it (strict staleness). Importing this module needs no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algorithms.esamp.distiller import (
    GroupedDistiller,
    Packing,
    TrainResult,
    forward_packed,
    make_packing,
    train_packed,
)


def _bucket(n: int) -> int:
    """Next power of two (>= 1): a few graphs cover every batch shape."""
    return 1 << max(0, int(n) - 1).bit_length()


def _to_device(a, device: torch.device) -> torch.Tensor:
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


class CudaGroupedDistiller(GroupedDistiller):
    _SCRATCH = 1  # one extra slot at index ``capacity`` absorbs padded graph groups

    def __init__(
        self,
        hidden_size: int,
        *,
        device: torch.device | str = "cuda",
        use_cuda_graph: bool = True,
        **kwargs,
    ):
        self._graphs: dict[tuple[int, int], _GraphEntry] = {}
        self.stream: torch.cuda.Stream | None = None
        super().__init__(hidden_size, device=device, **kwargs)
        self.stream = torch.cuda.Stream(device=self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # initial state
        self.use_cuda_graph = use_cuda_graph
        self.graph_failures = 0
        self._pool = None
        # Guards the static input buffers: the main stream must not refill them before the
        # side stream has consumed the previous step.
        self._inputs_free = torch.cuda.Event()

    @property
    def scratch_slot(self) -> int:
        return self.capacity

    # -- slots (state changes are ordered after pending side-stream work) -------------
    def _grow(self, new_capacity: int) -> None:
        if self.stream is not None:
            # Rare (capacity doubles): one host wait so pending side-stream work that uses the
            # old storage and the old graphs' pools has finished before they are released.
            self.stream.synchronize()
        super()._grow(new_capacity)
        self._graphs.clear()  # graphs captured the old storage
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def _reset(self, slot: int) -> None:
        with torch.cuda.stream(self.stream):
            super()._reset(slot)

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
            y = forward_packed(self.theta.index_select(0, gs), xp, self.shape)[rg, rp]
        x.record_stream(self.stream)
        cur.wait_stream(self.stream)  # the sampler consumes y on the main stream
        y.record_stream(cur)
        return y

    # -- train ----------------------------------------------------------------------
    def _entry(self, g: int, m: int) -> _GraphEntry:
        key = (g, m)
        e = self._graphs.get(key)
        if e is None:
            h, dev = self.shape.hidden_size, self.device
            e = _GraphEntry(
                xp=torch.zeros(g, m, h, device=dev),
                tp=torch.zeros(g, m, h, device=dev),
                mask=torch.zeros(g, m, dtype=torch.bool, device=dev),
                gslots=torch.full((g,), self.scratch_slot, dtype=torch.long, device=dev),
                gvalid=torch.zeros(g, dtype=torch.bool, device=dev),
            )
            if self.use_cuda_graph:
                self._capture(e)
            self._graphs[key] = e
        return e

    def _run(self, e: _GraphEntry):
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
        )

    def _capture(self, e: _GraphEntry) -> None:
        """Warm up and capture the update for this bucket. With all groups invalid (as the
        buffers are at creation) the warm-up runs change no state. Capture happens once per
        bucket and synchronizes the device (``torch.cuda.graph`` does); replays do not.

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
        except RuntimeError:
            # Capture is an optimisation: fall back to eager replays on the side stream.
            self.graph_failures += 1
            e.graph = None

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

    def _train(
        self, pk: Packing, x: torch.Tensor, target: torch.Tensor, forward: list | None = None
    ) -> TrainResult:
        # forward (CPU activations) is not used: the graph runs its own forward.
        e = self._entry(_bucket(len(pk.slots)), _bucket(pk.max_rows))
        self._fill(e, pk, x, target)
        gp = len(pk.slots)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if e.graph is not None:
                e.graph.replay()
                losses, ok = e.losses[:gp].clone(), e.ok[:gp].clone()
            else:
                losses, ok = self._run(e)
                losses, ok = losses[:gp], ok[:gp]
            self._inputs_free.record(self.stream)
        return TrainResult(pk.slots, losses, ok)

    def synchronize(self) -> None:
        """Host wait for the side stream (only for reading losses back / shutdown)."""
        self.stream.synchronize()
