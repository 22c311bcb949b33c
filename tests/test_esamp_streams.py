"""Stream lifetimes of the CUDA distiller, checked on CPU with fake streams: a tensor that
one stream allocates and another stream uses must be handed to the caching allocator with
``record_stream`` for that stream, else its memory can be reused while the other stream
still reads or writes it (a use after free that no CPU test would see otherwise).

The fakes stand in for ``torch.cuda``'s streams, events and stream context; a dispatch mode
notes, per storage, the stream current when it was created and every stream that used it.
Tensors that outlive the call (the distiller's state and static buffers) are exempt."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import algorithms.esamp.cuda as cuda_mod

H, INTER = 16, 8


class FakeStream:
    def __init__(self, name: str):
        self.name = name

    def wait_stream(self, other) -> None: ...

    def wait_event(self, event) -> None: ...

    def synchronize(self) -> None: ...


class Streams(TorchDispatchMode):
    """The current fake stream, and per storage its creating stream and its users."""

    def __init__(self):
        super().__init__()
        self.main = self.current = FakeStream("main")
        self.created: dict[int, FakeStream] = {}
        self.used: dict[int, set[str]] = {}
        self.recorded: dict[int, set[str]] = {}
        self.host: set[int] = set()
        self.alive: list[torch.Tensor] = []

    @staticmethod
    def key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {self.key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for k in inputs:
            self.used.setdefault(k, set()).add(self.current.name)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and self.key(t) not in inputs:
                self.created[self.key(t)] = self.current
                self.used[self.key(t)] = {self.current.name}
                self.alive.append(t)  # no address is reused while the mode is on
        return out

    def misses(self, keep: set[int]) -> list[tuple[int, str, set[str]]]:
        """Storages used on a stream that did not create them and not recorded for it."""
        out = []
        for k, users in self.used.items():
            made = self.created.get(k, self.main).name  # made before the call: the caller's
            need = users - {made} - self.recorded.get(k, set())
            if need and k not in keep | self.host:
                out.append((k, made, need))
        return out


@pytest.fixture
def streams(monkeypatch):
    st = Streams()

    @contextmanager
    def stream_ctx(s):
        old, st.current = st.current, s
        try:
            yield
        finally:
            st.current = old

    def record_stream(t, s):
        st.recorded.setdefault(Streams.key(t), set()).add(s.name)

    class FakeEvent:
        def record(self, stream=None) -> None: ...

        def query(self) -> bool:
            return True

        def synchronize(self) -> None: ...

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream("side"))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: st.current)
    monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    return st


def _persistent(d) -> set[int]:
    ts = [v for v in vars(d).values() if isinstance(v, torch.Tensor)]
    ts += [v for v in vars(d.results).values() if isinstance(v, torch.Tensor)]
    # The host buffers of the plan and result copies (tllm_core's transfer rings).
    ts += [*d._plans.buffers, *(t for b in d.results._copies._host for t in b)]
    return {Streams.key(t) for t in ts}


@pytest.mark.parametrize("rows", [2, 5], ids=["first_layout", "longer_groups"])
def test_cross_stream_tensors_are_recorded(streams, rows):
    """Predict and train, eagerly (no graph: every temporary is made on a stream), with 2
    rows per group (the first layout) and 5 (over graph_max_rows 4: the layout of two
    groups of 8 rows; 16 packed rows)."""
    d = cuda_mod.CudaGroupedDistiller(
        H,
        device="cpu",
        use_cuda_graph=False,
        capacity=4,
        graph_max_rows=4,
        intermediate_size=INTER,
        optimizer_stats=True,
    )
    slots = torch.tensor([d.alloc(), d.alloc()]).repeat_interleave(rows)
    x = torch.randn(len(slots), H)
    with streams:
        y = d.predict(slots, x)
        res = d.train_step(slots, x, x + 1)
    d.synchronize()
    assert y.shape == x.shape and res.updated.all()
    assert d.eager_updates == 1
    assert streams.misses(_persistent(d)) == []
