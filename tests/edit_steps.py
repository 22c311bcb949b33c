"""Hidden-state edits through tllm's runtime on CUDA, counted without a GPU, for the tests and
``benchmarks/edit_fake_step.py``: a step's edit path (``Runtime.begin_step``: each editing
consumer's plan, checked and written into the edit taps' buffers) on the fake CUDA device of
``tllm_core.testing.fake_cuda`` with its stream-order checks, then the step's end.

:func:`run` counts, over ``steps`` steady steps after one warm-up step (8 requests: one
16-token prompt and 7 decode rows; bf16 states), as is or under ``torch.inference_mode`` (as
vLLM runs a step): host waits, pageable copies, device allocations and races, with where each
comes from. Cases: ``steer`` on every request and per request (every other request switches
it on, with a scale override; a vector added at one layer, one ablated at another), one
consumer per edit kind (``add``, ``replace``, ``ablate``, ``transform``) with its value on the
device, and ``add`` with a CPU value (moved to the device once: the edit buffers cache it by
identity and version).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from consumers.steer.consumer import SteerConsumer
from tllm_core import Consumer, Edit, HiddenStates, ResidualEdit, hookimpl
from tllm_core.api.consumer import ModelInfo
from tllm_core.api.edits import EditBuffers
from tllm_core.api.rows import RequestInfo, StepLayout, layout_rows
from tllm_core.api.step import StepCapture
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.runtime import Runtime
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.testing.fake_cuda import FakeCuda

H, LAYERS, V = 64, 4, 128
DTYPE = torch.bfloat16  # the model's: float32 vectors are converted
PROMPT, DECODE = 16, 7  # one request finishing a prompt, seven decoding
KINDS = ("add", "replace", "ablate", "transform", "add_cpu_value")


class _Double(torch.nn.Module):
    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return 2 * s


class KindEditor(Consumer):
    """Edits every other row of layer 1 with one kind (``kind``), its value made once."""

    name = "kind_editor"
    kind = "add"

    def __init__(self, config, context):
        super().__init__(config, context)
        g = torch.Generator().manual_seed(0)
        v = torch.randn(H, generator=g)
        self.value = v if self.kind == "add_cpu_value" else v.to(context.model.device)
        self.module = _Double()

    def writes(self):
        if self.kind == "transform":
            return [Edit(HiddenStates(1), transform=self.module)]
        return [ResidualEdit(1)]

    def edit(self, rows, plan):
        idx = np.arange(0, len(rows), 2)
        if self.kind == "transform":
            plan.transform(1, idx)
        elif self.kind in ("add", "add_cpu_value"):
            plan.add(1, idx, self.value)
        else:
            getattr(plan, self.kind)(1, idx, self.value)


class _Plugin:
    @hookimpl
    def tllm_consumers(self):
        return [SteerConsumer, KindEditor]


def _runtime(case: str, device: torch.device) -> Runtime:
    reg = Registry()
    reg.register(_Plugin(), name="edit-fake-step")
    if case.startswith("steer"):
        vectors = [
            {"layer": 1, "vector": [0.5] * H, "scale": 2.0},
            {"layer": 2, "vector": [1.0] * H, "mode": "ablate"},
        ]
        spec = {"name": "steer", "config": {"vectors": vectors}}
        if case == "steer_per_request":
            spec["per_request"] = True
    else:
        KindEditor.kind = case
        spec = {"name": "kind_editor"}
    settings = RuntimeSettings.model_validate({"consumers": [spec]})
    model = ModelInfo(H, LAYERS, V, DTYPE, device, lambda h: h, None)
    return Runtime(settings, model, reg)


def _step(rt: Runtime, device: torch.device, k: int, on: dict[str, Any]) -> StepCapture:
    n = 1 + DECODE
    reqs = [
        RequestInfo(f"e{i}", f"r{i}", i, 0, PROMPT if i == 0 else 4, extra_args=on if i % 2 else {})
        for i in range(n)
    ]
    scheduled = np.array([PROMPT] + [1] * DECODE)
    computed = np.array([0] + [4] * DECODE)
    layout = StepLayout(
        engine_ids=[r.engine_id for r in reqs],
        num_scheduled=scheduled,
        num_computed=computed,
        num_tokens=computed + scheduled,
        token_ids=torch.zeros(int(scheduled.sum()), dtype=torch.long, device=device),
    )
    rows, srow, kept = layout_rows(layout, reqs)
    stamps = {t.key: torch.full((1,), k, device=device) for t in rt.taps if t.layer is not None}
    return StepCapture(k, rows, srow, kept, {}, stamps)


def _buffers(rt: Runtime, device: torch.device) -> dict[str, EditBuffers]:
    out = {}
    for tap in rt.edit_taps:
        b = out[tap.key] = EditBuffers(64, H, DTYPE, device)
        for owner, module in rt.transforms(tap.key):
            b.add_transform(owner, module)
    return out


def _prepared(buffers: dict[str, EditBuffers]) -> int | None:
    """Values the buffers prepared so far (None: buffers that do not count them)."""
    counts = [getattr(getattr(b, "values", None), "prepared", None) for b in buffers.values()]
    return None if None in counts else sum(counts)


def run(case: str, steps: int = 3, inference: bool = False) -> dict[str, Any]:
    """One case's counts over ``steps`` steady steps (see the module docstring)."""
    logging.disable(logging.CRITICAL)  # a refused plan is counted (consumer_errors), not logged
    try:
        return _run(case, steps, inference)
    finally:
        logging.disable(logging.NOTSET)


def _run(case: str, steps: int, inference: bool) -> dict[str, Any]:
    with FakeCuda(order=True) as fc:
        rt = _runtime(case, fc.device)
        buffers = _buffers(rt, fc.device)
        # The engine's tensors are made before counting; the first step is the warm-up.
        # Per request: every other request switches steer on, with a scale of its own.
        on = {"tllm_consumers": "steer", "tllm_steer_scale": 3.0} if "per_request" in case else {}
        made = [_step(rt, fc.device, k, on) for k in range(1, steps + 2)]
        for i, step in enumerate(made):
            if i == 1:
                fc.start_steps()
                prepared = _prepared(buffers)
            with torch.inference_mode(inference):  # vLLM's model runner: True
                rt.begin_step(step.rows, buffers)
                rt.end_step(step)
        # Values moved/converted/normalised anew in the steady steps (each a device allocation,
        # which the fake does not see for an inference tensor's operations).
        now = _prepared(buffers)
        prepared = None if now is None else now - prepared
        out: dict[str, Any] = {
            "case": case,
            "inference_mode": inference,
            "steps": steps,
            "values_prepared": prepared,
        }
        for kind in ("host_wait", "pageable_copy", "allocation", "race"):
            found = fc.findings(None if kind == "race" else "steps", kind)
            out[kind] = sum(f.count for f in found)
            out[f"{kind}_at"] = sorted({f"{f.where}: {f.code.strip()}" for f in found})
        errors = rt.collect()["runtime"].get("consumer_errors", 0)
    out["consumer_errors"] = errors
    return out
