"""Run CUDA-path code on a fake device and flag what would make the host wait, copy from
pageable memory, allocate, first use cuBLAS on a stream, or race between streams, during
the steps (docs/fake-cuda.md: what is flagged, counted, and not seen)::

    with FakeCuda() as fc:
        d = Distiller(device=fc.device)  # construction: counted, never a failure
        with fc.step():                  # one step: every finding here fails assert_clean
            d.train_step(...)
    fc.assert_clean()

The device is ``torch.device("meta")`` (7B shapes cost nothing), ``torch.cuda`` is stubbed
and a ``TorchDispatchMode`` applies the rule table of :mod:`.fake_cuda_checker`; ``order=True``
adds race checks, ``rehearsal=True`` lets a script that measures run, ``device="cpu"``
computes instead (nothing checked).
"""

from __future__ import annotations

import contextlib
import itertools
import linecache
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any
from unittest import mock

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from tllm_core.testing import fake_cuda_stubs as stubs
from tllm_core.testing.fake_cuda_checker import Checker, fresh_outputs, tensor_bytes
from tllm_core.testing.fake_cuda_order import Site, StreamOrder, site_parts

KINDS = ("host_wait", "pageable_copy", "allocation", "first_cublas", "race")
_SYNC_KINDS = ("host_wait", "pageable_copy")  # what set_sync_debug_mode("error") raises at
PHASES = ("construction", "steps", "teardown")

# Frames never named in a finding: torch, this package, and contextlib (stub context managers).
_SKIP = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(__file__) + os.sep,
    contextlib.__file__,
)


def _site() -> Site:
    """The (code, line) of the first frame outside torch and this package."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_SKIP):
        f = f.f_back
    return None if f is None else (f.f_code, f.f_lineno)


@dataclass
class Finding:
    kind: str
    what: str
    file: str
    line: int
    function: str
    code: str
    phase: str
    in_capture: bool
    count: int = 1

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}:{self.function}"


def _stats() -> dict[str, Any]:
    return {
        "launches": 0,
        "bytes": 0,
        "allocated_bytes": 0,
        "graph_replays": 0,
        **dict.fromkeys(KINDS, 0),
    }


def active() -> FakeCuda | None:
    """The active ``FakeCuda``, found through its bound ``torch.cuda.is_available`` patch."""
    owner = getattr(torch.cuda.is_available, "__self__", None)
    return owner if isinstance(owner, FakeCuda) else None


def is_cuda(device: torch.device | str) -> bool:
    """Whether code should take its CUDA branch on ``device``: a CUDA device, or the active
    fake device (type ``"meta"``)."""
    dev = torch.device(device)
    fc = active()
    return dev.type == "cuda" or (fc is not None and dev == fc.device)


class FakeCuda:
    """The fake device and its record (see the module docstring)."""

    def __init__(
        self,
        total_memory: int = 80 * 2**30,
        device_name: str = "FakeCuda (meta)",
        order: bool = False,
        rehearsal: bool = False,
        kernels: Mapping[str, Callable[..., Any]] | None = None,
        device: torch.device | str = "meta",
    ):
        self.device = torch.device(device)
        self.computes = self.device.type != "meta"
        self.total_memory = total_memory
        self.device_name = device_name
        self.rehearsal = rehearsal
        # Operator name -> its CUDA implementation, run before the operator's meta kernel.
        self.kernels = dict(kernels or {})
        self.sync_debug_mode: int | str = 0
        self.sync_windows: list[dict[str, Any]] = []
        self._window: tuple[str, dict[tuple, int]] | None = None
        self.launches_built: dict[str, int] = {}
        self.launch_configs: dict[str, dict[str, Any]] = {}
        self.phase = "construction"
        self._lock = threading.RLock()
        self._findings: dict[tuple, Finding] = {}
        self._phase_stats = {p: _stats() for p in PHASES}
        self._by_op: dict[str, dict[str, list[int]]] = {p: {} for p in PHASES}
        self._per_step: list[dict[str, Any]] = []
        self._step: dict[str, Any] | None = None
        self._capture: stubs.FakeGraph | None = None
        self._pinned = WeakTensorKeyDictionary()
        self._pinned_at: dict[int, Any] = {}  # storage address -> pinned storage
        self._cublas_streams: set[int] = set()
        self._patches = contextlib.ExitStack()
        self._mode: Checker | None = None
        self._quiet = threading.local()
        self._stream_ids = itertools.count()
        self.default_stream = stubs.FakeStream(self)
        self._cublas_streams.add(self.default_stream.stream_id)
        self.order: StreamOrder | None = None
        if order:
            self.order = StreamOrder(
                self.is_pinned,
                lambda what, site: self._flag("race", what, site),
                _site,
                self.default_stream.stream_id,
            )

    # -- entering and leaving ---------------------------------------------------------
    def __enter__(self) -> FakeCuda:
        if active() is not None:  # the patches are process-wide
            raise RuntimeError("a FakeCuda is already active; nest none and share none")
        # Made before any is installed: the Tensor stubs keep the original torch.tensor.
        cuda, tensor, factories = (
            stubs.cuda_stubs(self),
            stubs.tensor_stubs(self),
            stubs.factory_stubs(self),
        )
        try:
            self.patch(torch.cuda, cuda)
            self.patch(torch.Tensor, tensor)
            self.patch(torch, factories)
            if self.rehearsal:
                self.patch(torch, stubs.rehearsal_stubs(self))
            mode = Checker(self)
            mode.__enter__()
            self._mode = mode
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
        finally:
            self._mode = None
            self._pinned_at.clear()
            self._patches.close()

    def patch(self, owner: Any, attrs: dict[str, Any]) -> None:
        """Set ``owner``'s attributes while this device is active (put back on exit)."""
        self._patches.enter_context(mock.patch.multiple(owner, **attrs))

    def is_available(self) -> bool:
        return True

    def new_stream_id(self) -> int:
        return next(self._stream_ids)

    # -- phases -------------------------------------------------------------------------
    def start_steps(self) -> None:
        """From now on findings are failures (construction is over)."""
        self.phase = "steps"

    @contextlib.contextmanager
    def steps(self) -> Iterator[None]:
        """The steps phase for the block; after it, the teardown phase (not failures)."""
        self.start_steps()
        try:
            yield
        finally:
            self.phase = "teardown"

    @contextlib.contextmanager
    def step(self) -> Iterator[dict[str, Any]]:
        """One step (starts the steps phase): its counts are one entry of ``per_step``."""
        if self.phase != "steps":
            self.start_steps()
        self._step = _stats()
        self._per_step.append(self._step)
        try:
            yield self._step
        finally:
            self._step = None

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Operations of this thread in the block are neither checked nor counted."""
        prev = getattr(self._quiet, "on", False)
        self._quiet.on = True
        try:
            yield
        finally:
            self._quiet.on = prev

    # -- pinned host memory -------------------------------------------------------------
    def is_fake(self, t: torch.Tensor) -> bool:
        return t.device.type == "meta"

    def mark_pinned(self, t: torch.Tensor) -> None:
        self._pinned[t] = True
        # A view made in inference mode has no ``_base``: found by its storage instead
        # (kept alive here, so its address is not reused).
        storage = t.untyped_storage()
        if storage.nbytes():  # an empty one has no address of its own
            self._pinned_at[storage.data_ptr()] = storage
        if self.order is not None:
            self.order.fresh(t)

    def is_pinned(self, t: torch.Tensor) -> bool:
        # A view of a pinned tensor keeps its base (and so the pinned storage) alive.
        if t in self._pinned or (t._base is not None and t._base in self._pinned):
            return True
        if t.device.type != "cpu":
            return False
        storage = t.untyped_storage()
        return bool(storage.nbytes()) and storage.data_ptr() in self._pinned_at

    # -- the sync debug mode and launches built ------------------------------------------
    def set_sync_debug_mode(self, mode: int | str) -> None:
        """As on a GPU, under ``"error"`` a host wait or pageable copy raises. Each window
        from switching it on to off is kept in ``sync_windows`` with what was seen."""
        self.sync_debug_mode = mode
        on = mode in ("warn", "error", 1, 2)
        if on and self._window is None:
            file, line, _ = site_parts(_site())
            self._window = (f"{os.path.basename(file)}:{line}", self._sync_counts())
        elif not on and self._window is not None:
            (at, before), self._window = self._window, None
            new = {k: n - before.get(k, 0) for k, n in self._sync_counts().items()}
            sites = [f"{k[0]} at {k[2]}: {k[3]} x{n}" for k, n in new.items() if n > 0]
            total = sum(n for n in new.values() if n > 0)
            self.sync_windows.append(
                {"set_at": at, "host_waits_and_pageable_copies": total, "sites": sites}
            )

    def _sync_counts(self) -> dict[tuple, int]:
        return {
            (f.kind, f.what, f.where, f.code, f.phase, f.in_capture): f.count
            for f in self.findings(phase=None)
            if f.kind in _SYNC_KINDS
        }

    def launch_built(self, kernel: str, config: dict[str, Any]) -> None:
        """A kernel launch built, not run (meta tensors have no data): counted, each
        distinct ``config`` kept in ``launch_configs``."""
        self.launches_built[kernel] = self.launches_built.get(kernel, 0) + 1
        self.launch_configs.setdefault(repr(config), config)

    # -- recording ----------------------------------------------------------------------
    def _count(self, key: str, n: int = 1, phase: str | None = None) -> None:
        with self._lock:
            self._phase_stats[phase or self.phase][key] += n
            if self._step is not None and (phase or self.phase) == "steps":
                self._step[key] += n

    def _flag(self, kind: str, what: str, site: Site = None) -> None:
        file, line, function = site_parts(site or _site())
        in_capture = self._capture is not None
        key = (self.phase, kind, what, file, line, in_capture)
        with self._lock:
            self._count(kind)
            if key in self._findings:
                self._findings[key].count += 1
            else:
                code = linecache.getline(file, line).strip() if line else ""
                self._findings[key] = Finding(
                    kind, what, file, line, function, code, self.phase, in_capture
                )
        if kind in _SYNC_KINDS and self.sync_debug_mode in ("error", 2):
            raise RuntimeError(
                f"FakeCuda: {kind} ({what}) under set_sync_debug_mode('error'): on a GPU, "
                "'called a synchronizing CUDA operation'"
            )

    def _host_wait(self, what: str, joins_current: bool = True) -> None:
        """``joins_current``: the host waits for the current stream (else the caller tells
        the stream order)."""
        self._flag("host_wait", what)
        if joins_current and self.order is not None:
            self.order.host_joins_stream(torch.cuda.current_stream())

    def _factory_copy(self, what: str, out: torch.Tensor) -> None:
        self._flag("pageable_copy", what)
        if self.order is not None:  # made in C++, out of the dispatch mode's sight
            self.order.fresh(out)
            self.order.tensors(True, [(out, True)])
        self._launch(what, tensor_bytes(out) * 2)
        self._allocated(what, out)

    def _launch(self, op: str, nbytes: int, n: int = 1) -> None:
        with self._lock:
            if self._capture is not None:  # recorded, run by each replay
                by_op = self._capture.by_op
            else:
                self._count("launches", n)
                self._count("bytes", nbytes)
                by_op = self._by_op[self.phase]
            counts = by_op.setdefault(op, [0, 0])
            counts[0] += n
            counts[1] += nbytes

    def _allocated(self, what: str, t: torch.Tensor) -> None:
        nbytes = tensor_bytes(t)
        if not nbytes:
            return
        if self._capture is not None:  # the graph's pool, allocated at capture
            self._capture.pool_bytes += nbytes
            self._count("allocation", phase="construction")
            self._count("allocated_bytes", nbytes, phase="construction")
            return
        self._flag("allocation", what)
        self._count("allocated_bytes", nbytes)

    def _matmul(self) -> None:
        s = torch.cuda.current_stream()
        if s.stream_id in self._cublas_streams:
            return
        self._cublas_streams.add(s.stream_id)
        if self.phase != "construction":
            self._flag("first_cublas", f"first matrix product on {s!r}")

    def _begin_capture(self, graph: stubs.FakeGraph) -> None:
        if self._capture is not None:
            raise RuntimeError("FakeCuda: a graph capture is already in progress")
        self._capture = graph
        if self.order is not None:
            self.order.begin_capture()

    def _end_capture(self, graph: stubs.FakeGraph) -> None:
        self._capture = None
        if self.order is not None:
            self.order.end_capture(graph)

    def _replay(self, graph: stubs.FakeGraph) -> None:
        self._count("graph_replays")
        if self.computes:
            with torch.no_grad():
                for func, args, kwargs, out in graph.ops:
                    new = tree_leaves(fresh_outputs(func, func(*args, **kwargs)))
                    for o, n in zip(tree_leaves(fresh_outputs(func, out)), new, strict=True):
                        if isinstance(o, torch.Tensor):  # into the captured storage, as CUDA
                            o.copy_(n)
        for op, (n, nbytes) in graph.by_op.items():
            self._launch(op, nbytes, n)
        if self.order is not None:
            self.order.replay(graph)

    # -- results ------------------------------------------------------------------------
    def findings(self, phase: str | None = "steps", kind: str | None = None) -> list[Finding]:
        """Findings, deduplicated by kind, what and source line (``count``: occurrences)."""
        with self._lock:
            return [
                f
                for f in self._findings.values()
                if (phase is None or f.phase == phase) and (kind is None or f.kind == kind)
            ]

    def failures(self) -> list[Finding]:
        """Findings in the steps, any host wait or copy inside a graph capture (on a GPU
        the capture itself fails) and every race (a wrong value in any phase)."""
        return [
            f
            for f in self._findings.values()
            if f.phase == "steps"
            or f.kind == "race"
            or (f.in_capture and f.kind in ("host_wait", "pageable_copy"))
        ]

    def report(self) -> dict[str, Any]:
        """Per phase: the counts, ``by_op`` (launches and bytes, most bytes first) and the
        findings; ``steps`` also has ``per_step``. JSON-able."""
        with self._lock:
            out: dict[str, Any] = {}
            for p in PHASES:
                out[p] = dict(self._phase_stats[p])
                by_op = sorted(self._by_op[p].items(), key=lambda kv: -kv[1][1])
                out[p]["by_op"] = {op: {"launches": n, "bytes": b} for op, (n, b) in by_op}
                out[p]["findings"] = [
                    {**asdict(f), "where": f.where} for f in self._findings.values() if f.phase == p
                ]
            out["steps"]["per_step"] = [dict(s) for s in self._per_step]
            return out

    def assert_clean(self) -> None:
        """Raise an AssertionError listing every failure with its source line."""
        bad = self.failures()
        if bad:
            lines = [
                f"FakeCuda: {len(bad)} finding(s) that would stall, allocate or race on a GPU:"
            ]
            for f in bad:
                cap = " (in a graph capture)" if f.in_capture else ""
                lines.append(f"  {f.kind}: {f.what} at {f.where} x{f.count}{cap}")
                lines.append(f"      {f.code}")
            raise AssertionError("\n".join(lines))
