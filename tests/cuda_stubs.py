"""Stand-ins for ``torch.cuda``'s streams, events and graphs, so the CUDA distiller's host
logic (row plans, layouts, graph bodies, result ring) runs on CPU tensors: a graph "replay"
re-runs the captured body on the same static buffers, as a real replay reads them. For host
waits, pageable copies and allocations use ``tllm_core.testing.fake_cuda`` instead."""

from __future__ import annotations

import contextlib

import pytest
import torch

import algorithms.esamp.cuda as cuda_mod


class Stream:
    def wait_stream(self, other) -> None: ...

    def wait_event(self, event) -> None: ...

    def synchronize(self) -> None: ...


class Event:
    def record(self, stream=None) -> None: ...

    def query(self) -> bool:
        return True

    def synchronize(self) -> None: ...


class Graph:
    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        with torch.no_grad():
            self.fn()


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: None)
    monkeypatch.setattr(cuda_mod, "capture_graph", lambda fn, stream, pool: (Graph(fn), None))


@pytest.fixture
def cuda_stubs(monkeypatch):
    install(monkeypatch)
