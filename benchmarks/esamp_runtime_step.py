"""ESamp driven through tllm's runtime, as the vLLM bridge drives it, without vLLM.

The runtime is built with the built-in producers, the bridge's architectures and ESamp
registered directly (no entry points: the GPU image runs a checkout, not an install). One
decode step is what the bridge does around the model: ``begin_step``; the forward's writes
(the tapped hidden states and their stamps, made by the caller); ``guide`` on the filtered
logits; the sampler (the caller's); ``end_step`` (bundles, ESamp's training submission, the
stamps' read). Used by ``esamp_gpu_step`` (times on a GPU) and ``esamp_fake_step`` (counts on
the fake device).

``per_request`` makes ESamp a per-request consumer (``{"per_request": true}`` in its spec, as
``tllm serve`` users run it), switched on by some requests' ``tllm_consumers`` extra arg, the
way a client's ``vllm_xargs`` reach the engine: ``"interleaved"``, every other prompt's
requests (rows of several runs); ``"block"``, the first half of the prompts (one contiguous
run of rows; with one prompt, that prompt); ``"all"``, every request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

import numpy as np
import torch

import producers.plugin as producers_plugin
import tllm_core.vllm_bridge.plugin as bridge_plugin
from algorithms.esamp.consumer import ESampConsumer
from tllm_core.api.consumer import ModelInfo
from tllm_core.api.request_settings import CONSUMERS_KEY
from tllm_core.api.rows import RequestInfo, StepLayout, layout_rows
from tllm_core.api.step import StepCapture
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.runtime import Runtime
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.runtime.stamp_copies import StampRead

PER_REQUEST = ("interleaved", "block", "all")


def switched_on(prompts: int, per_request: str) -> list[bool]:
    """Which prompts' requests switch ESamp on (see the module docstring)."""
    if per_request not in PER_REQUEST:
        raise ValueError(f"per_request must be one of {PER_REQUEST} or None, got {per_request!r}")
    if per_request == "interleaved":
        return [p % 2 == 0 for p in range(prompts)]
    if per_request == "block":
        return [p < max(1, prompts // 2) for p in range(prompts)]
    return [True] * prompts


class RuntimeStep:
    """A runtime with ESamp (config ``cfg``) over ``prompts`` x ``n`` decode rows; with
    ``per_request``, a per-request ESamp switched on by some of the requests."""

    def __init__(
        self,
        model: ModelInfo,
        prompts: int,
        n: int,
        cfg: dict[str, Any],
        per_request: str | None = None,
    ) -> None:
        reg = Registry(load_entry_points=False)
        reg.register(producers_plugin, name="producers")
        reg.register(bridge_plugin, name="vllm-bridge")
        reg.use(ESampConsumer)
        spec = {"name": "esamp", "config": cfg, "per_request": per_request is not None}
        settings = RuntimeSettings.model_validate({"consumers": [spec]})
        with torch.inference_mode(False):  # as the engine builds consumers (trainable state)
            self.runtime = Runtime(settings, model, reg)
        self.device = model.device
        on = switched_on(prompts, per_request) if per_request else [False] * prompts
        self.requests = [
            RequestInfo(
                f"{p}-{s}", f"r{p}", p, s, 3, extra_args={CONSUMERS_KEY: "esamp"} if on[p] else {}
            )
            for p in range(prompts)
            for s in range(n)
        ]
        # The rows ESamp acts on.
        self.acted_on = sum(on) * n if per_request else prompts * n
        self.rows = len(self.requests)
        self.token_ids = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        # The taps the forward writes (and stamps) vs those filled after it ("final").
        self.tap_keys = sorted(t.key for t in self.runtime.taps)
        self.stamps = {
            t.key: torch.zeros(1, dtype=torch.long, device=self.device)
            for t in self.runtime.taps
            if t.layer is not None
        }
        self._position = 5

    @property
    def consumer(self) -> ESampConsumer:
        return self.runtime.slots[0].consumer

    @torch.inference_mode()  # as vLLM runs a step (close and collect run outside it)
    def step(
        self,
        hidden: Callable[[str], torch.Tensor],
        logits: torch.Tensor,
        temperature: torch.Tensor,
        sample: Callable[[torch.Tensor], torch.Tensor],
    ) -> float:
        """One decode step (every row a sampled decode row); ``hidden(tap_key)``: that tap's
        ``[rows, H]`` states, ``logits``: already filtered (min-p). Returns the host seconds
        of the runtime's calls (``begin_step``, ``guide``, ``end_step``; not the sampler)."""
        r = self.rows
        layout = StepLayout(
            engine_ids=[q.engine_id for q in self.requests],
            num_scheduled=np.ones(r, np.int64),
            num_computed=np.full(r, self._position, np.int64),
            num_tokens=np.full(r, self._position + 1, np.int64),
            token_ids=self.token_ids,
        )
        self._position += 1
        rows, sample_row, kept = layout_rows(layout, self.requests)
        number = self.runtime.step_index + 1
        for stamp in self.stamps.values():
            stamp.fill_(number)  # the forward's stamp writes (on the device)
        step = StepCapture(
            number, rows, sample_row, kept, {k: hidden(k) for k in self.tap_keys}, dict(self.stamps)
        )
        t0 = perf_counter()
        self.runtime.begin_step(rows, {})
        self.runtime.guide(step, logits, temperature, np.ones(r, bool), True)
        t1 = perf_counter()
        step.tensors["sampled"] = sample(logits)
        t2 = perf_counter()
        with self._stamps_as_written(number):
            self.runtime.end_step(step)
        return (t1 - t0) + (perf_counter() - t2)

    @contextmanager
    def _stamps_as_written(self, number: int) -> Iterator[None]:
        """On the meta device (the test kit's fake CUDA) a read-back has no values (it reads
        ones): the step's stamps are answered as its forward wrote them, after their copy and
        event were made as on a GPU. Elsewhere nothing changes."""
        if self.device.type != "meta":
            yield
            return
        real = StampRead.values

        def values(read: StampRead) -> list[int]:
            real(read)
            return [number] * read.n_stamps + [0] * (len(read.keys) - read.n_stamps)

        StampRead.values = values  # type: ignore[method-assign]
        try:
            yield
        finally:
            StampRead.values = real  # type: ignore[method-assign]

    def close(self) -> dict[str, Any]:
        """The runtime's final report (ESamp's result under ``results``)."""
        return self.runtime.close()
