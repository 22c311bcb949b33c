"""The dress rehearsal of ``gpu_smoke.py`` (``--device fake``): every CUDA-only branch of the
smoke run and of the benchmarks it calls, run on CPU on the fake CUDA device
(:mod:`tllm_core.testing.fake_cuda`: meta tensors, stub streams, events and graphs), so that a
typo in code only a GPU reaches fails in CI, on any machine, instead of on the GPU.

Nothing is measured. On top of ``FakeCuda``'s stubs the rehearsal installs:

- CUDA events report 1 ms (not 0: the scripts divide by times); ``memory_allocated`` and
  ``max_memory_allocated`` report 0, ``reset_peak_memory_stats`` does nothing;
- ``torch.Generator(device=<fake>)`` is a CPU generator (meta has none; meta factories accept
  a CPU one);
- ``torch.compile`` returns the module uncompiled (inductor cannot compile for meta; the
  compiled taps are checked on CPU by ``tests/test_benchmarks.py``);
- ESamp's kernel operators (``torch.ops.tllm_esamp``) run their CUDA implementation on the
  fake device too (the fake device's own kernel for them does nothing): the argument checks,
  and the Triton launch built (grid, arguments, tiles) but not run, since meta tensors have no
  data (the kernels' math runs under ``TRITON_INTERPRET=1`` in ``tests/test_esamp_kernels.py``).
  Each distinct compilation is kept (``triton_configs``) for a compile check for sm_90;
- ESamp's factory takes its CUDA path on the fake device;
- ``torch.cuda.set_sync_debug_mode``: while it is ``"error"`` or ``"warn"``, the host waits
  and pageable copies the fake device sees are recorded (the fake device's prediction of
  what the GPU's sync check will find) and, under ``"error"``, raise a ``RuntimeError`` at
  the operation, as the GPU would.

:func:`scrub` replaces every number, flag and string of a rehearsed part by null (keeping
``ran_on``, ``skipped``, ``error`` and ``rehearsal``), so no rehearsal output can pass for a
measurement.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tllm_core.testing import fake_cuda
from tllm_core.testing import fake_cuda_stubs as stubs
from tllm_core.testing.fake_cuda import FakeCuda, is_cuda

RAN_ON = (
    "rehearsal: FakeCuda on CPU (meta tensors, stub streams, events and graphs); "
    "nothing measured, every value null"
)
DEVICE_NAME = "FakeCuda rehearsal (not a GPU)"
FAKE_EVENT_MS = 1.0
KEEP = frozenset({"ran_on", "skipped", "error", "traceback", "rehearsal"})
_SYNC_KINDS = ("host_wait", "pageable_copy")

_current: Rehearsal | None = None


def active() -> Rehearsal | None:
    """The rehearsal in progress, if any."""
    return _current


def scrub(value: Any, key: str | None = None) -> Any:
    """``value`` with every leaf null except under the keys of :data:`KEEP`."""
    if key in KEEP:
        return value
    if isinstance(value, dict):
        return {k: scrub(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v) for v in value]
    return None


def _arg_spec(arg: Any) -> list:
    """A kernel argument as Triton's JIT specialises it: a tensor's dtype; an int as 1, a
    multiple of 16 (16) or another (3); a float."""
    if isinstance(arg, torch.Tensor):
        return ["tensor", str(arg.dtype).removeprefix("torch.")]
    if isinstance(arg, float):
        return ["float"]
    return ["int", 1 if arg == 1 else 16 if arg % 16 == 0 else 3]


class _CudaKernels(TorchDispatchMode):
    """ESamp's kernel operators on the fake device: their CUDA implementation (checks, the
    launch built and handed to ``Launch.run``), then the operator itself for the fake
    device's counts (its meta kernel does nothing)."""

    def __init__(self, device: torch.device):
        super().__init__()
        from algorithms.esamp.kernels import ops

        self.device = device
        self.impls = {
            f"tllm_esamp::{name}": ops.CUDA_IMPLS[name]
            for name in ("grad_adam", "slot_matmul", "candidate_dot")
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = self.impls.get(func._schema.name)
        if impl is not None and any(
            isinstance(a, torch.Tensor) and a.device == self.device for a in args
        ):
            impl(*args, **kwargs)
        return func(*args, **kwargs)


def _generator_class(fc: FakeCuda) -> type:
    real = torch.Generator

    class Generator(real):  # type: ignore[misc, valid-type]
        """A CPU generator where the fake device is asked for (meta has none)."""

        def __new__(cls, device: Any = "cpu") -> torch.Generator:
            dev = torch.device(device)
            return real.__new__(cls, "cpu" if dev == fc.device else dev)

        def __init__(self, *_: Any, **__: Any) -> None:
            pass

    return Generator


class Rehearsal:
    """What the rehearsal saw that is not a measurement: Triton launches built and not run,
    and the host waits the fake device flagged under ``set_sync_debug_mode("error")``."""

    def __init__(self, fc: FakeCuda):
        self.fc = fc
        self.device = fc.device
        self.triton_launches: dict[str, int] = {}
        self.triton_configs: dict[str, dict[str, Any]] = {}
        self.sync_windows: list[dict[str, Any]] = []
        self._window: dict[tuple, int] | None = None
        self._window_at = ""
        self._raise = False
        self._set_mode = torch.cuda.set_sync_debug_mode  # FakeCuda's stub

    def flag(self, kind: str, what: str) -> None:
        """``FakeCuda._flag`` in the rehearsal: under ``set_sync_debug_mode("error")`` a
        host wait or pageable copy raises where it happens, as on a GPU."""
        type(self.fc)._flag(self.fc, kind, what)
        if self._raise and kind in _SYNC_KINDS:
            raise RuntimeError(
                f"rehearsal: {kind} ({what}) under set_sync_debug_mode('error'): on a GPU, "
                "'called a synchronizing CUDA operation'"
            )

    def _sync_findings(self) -> dict[tuple, int]:
        return {
            (f.kind, f.what, f.where, f.code, f.phase, f.in_capture): f.count
            for f in self.fc.findings(phase=None)
            if f.kind in _SYNC_KINDS
        }

    def set_sync_debug_mode(self, mode: int | str) -> None:
        self._set_mode(mode)
        on = mode in ("warn", "error", 1, 2)
        self._raise = mode in ("error", 2)
        if on and self._window is None:
            caller = sys._getframe(1)
            self._window_at = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
            self._window = self._sync_findings()
        elif not on and self._window is not None:
            before, self._window = self._window, None
            new = {
                k: n - before.get(k, 0)
                for k, n in self._sync_findings().items()
                if n > before.get(k, 0)
            }
            self.sync_windows.append(
                {
                    "set_at": self._window_at,
                    "host_waits_and_pageable_copies": sum(new.values()),
                    "sites": [f"{k[0]} at {k[2]}: {k[3]} x{n}" for k, n in new.items()],
                }
            )

    def launch_run(self, launch: Any) -> None:
        """``triton_impl.Launch.run`` in the rehearsal: counted, not run; each distinct
        compilation (kernel, constants, warps, argument types as Triton's JIT specialises
        them) kept in :attr:`triton_configs` for a compile check without a GPU."""
        self.triton_launches[launch.kernel] = self.triton_launches.get(launch.kernel, 0) + 1
        config = {
            "kernel": launch.kernel,
            "constexprs": dict(launch.constexprs),
            "num_warps": launch.num_warps,
            "args": [_arg_spec(a) for a in launch.args],
        }
        self.triton_configs.setdefault(repr(config), config)

    def summary(self) -> dict[str, Any]:
        """The rehearsal's own record (JSON-able; not a measurement of anything)."""
        steps_ran = "Triton launches built with their grids, not run (meta tensors)"
        return {
            "triton_launches_built_not_run": dict(self.triton_launches),
            "triton_configs": list(self.triton_configs.values()),
            "triton": steps_ran if self.triton_launches else "no Triton launch reached",
            "sync_debug_windows_seen_by_fake_device": list(self.sync_windows),
            # A host wait or pageable copy inside a graph capture: the GPU's capture fails.
            "capture_failures_seen_by_fake_device": [
                f"{f.kind} at {f.where}: {f.code} x{f.count}" for f in self.fc.failures()
            ],
            "torch_compile": "not rehearsed (identity under the fake device)",
        }


@contextlib.contextmanager
def rehearsal() -> Iterator[Rehearsal]:
    """The fake CUDA device with the rehearsal's stubs (module docstring); all put back on
    exit."""
    global _current
    with FakeCuda(device_name=DEVICE_NAME) as fc:
        r = Rehearsal(fc)
        patches = stubs.Patches()
        try:
            patches.apply(
                torch.cuda,
                {
                    "memory_allocated": lambda device=None: 0,
                    "max_memory_allocated": lambda device=None: 0,
                    "reset_peak_memory_stats": lambda device=None: None,
                    "set_sync_debug_mode": r.set_sync_debug_mode,
                },
            )
            patches.apply(stubs.FakeEvent, {"elapsed_time": lambda self, end: FAKE_EVENT_MS})
            patches.apply(
                torch,
                {"Generator": _generator_class(fc), "compile": lambda model, *a, **k: model},
            )
            from algorithms.esamp import factory
            from algorithms.esamp.kernels import triton_available

            patches.apply(factory, {"uses_gpu_path": is_cuda})
            patches.apply(fc, {"_flag": r.flag})
            # Findings name the first frame outside the fake device's code: r.flag's is too.
            patches.apply(fake_cuda, {"_SKIP": (*fake_cuda._SKIP, __file__)})
            if triton_available():
                from algorithms.esamp.kernels import triton_impl

                def run(launch: Any, kernels: Any = None) -> None:
                    r.launch_run(launch)

                patches.apply(triton_impl.Launch, {"run": run})
                # The GPU's SM count (the fake's properties: 132) picks split_k, as there.
                sms = torch.cuda.get_device_properties(fc.device).multi_processor_count
                patches.apply(triton_impl, {"_sm_count": lambda device: sms})
            _current = r
            with _CudaKernels(fc.device):
                yield r
        finally:
            _current = None
            patches.restore()
