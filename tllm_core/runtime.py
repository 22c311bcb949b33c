"""The engine-side runtime: builds consumers, routes each step's data to them.

Engine-neutral: the vLLM bridge calls :meth:`begin_step`, :meth:`guide`,
:meth:`end_step` and :meth:`finish_requests`; nothing here imports vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from producers.bundle import ReadPlan, build_bundle, plan_reads
from producers.step import StepCapture
from tllm_core.bundles import EditPlan, GuideView
from tllm_core.bus import Bus
from tllm_core.consumer import Consumer, ConsumerContext, ModelInfo
from tllm_core.counters import Counters
from tllm_core.ports import FINAL, ResidualEdit, SamplerGuide, resolve_layer
from tllm_core.registry import Registry
from tllm_core.rows import RequestInfo, RowInfo
from tllm_core.settings import RuntimeSettings

log = logging.getLogger("tllm")


@dataclass
class _Slot:
    consumer: Consumer
    reads: ReadPlan
    edit_layers: set[int] = field(default_factory=set)
    guides: bool = False
    per_request: bool = False

    def acts_on(self, request: RequestInfo) -> bool:
        return not self.per_request or self.consumer.name in request.enabled_consumers

    def enabled(self, requests: list[RequestInfo]) -> np.ndarray | None:
        """Row mask of requests this consumer acts on; None when it acts on all."""
        if not self.per_request:
            return None
        return np.fromiter((self.acts_on(r) for r in requests), bool, len(requests))


def build_consumers(
    settings: RuntimeSettings, model: ModelInfo, registry: Registry, counters: Counters
) -> list[_Slot]:
    """Validate specs, construct consumers and resolve their ports (errors before generation)."""
    slots = []
    configs = registry.check(settings.consumers)
    for spec, config in zip(settings.consumers, configs, strict=True):
        cls = registry.get(spec.name)

        def resolve(i: int, _n=model.num_layers) -> int:
            return resolve_layer(i, _n)

        context = ConsumerContext(
            model=model, counters=counters, resolve_layer=resolve, per_request=spec.per_request
        )
        consumer = cls(config, context)
        reads = plan_reads(consumer.reads(), resolve)
        slot = _Slot(consumer, reads, per_request=spec.per_request)
        for w in consumer.writes():
            if isinstance(w, ResidualEdit):
                slot.edit_layers.add(resolve(w.layer))
            elif isinstance(w, SamplerGuide):
                slot.guides = True
            else:
                raise TypeError(f"consumer {spec.name!r}: not a write port: {w!r}")
        slots.append(slot)
    return slots


class Runtime:
    def __init__(
        self, settings: RuntimeSettings, model: ModelInfo, registry: Registry | None = None
    ):
        self.settings = settings
        self.model = model
        self.counters = Counters()
        self.slots = build_consumers(settings, model, registry or Registry(), self.counters)
        self.bus = Bus(self.counters, settings.queue_size, settings.overflow)
        self.step_index = 0
        self._guide_hidden_keys: set[str] = set()
        for s in self.slots:
            if s.guides:
                self._guide_hidden_keys |= set(s.reads.hidden)

    # -- what the bridge must provide -------------------------------------------------
    @property
    def capture_layers(self) -> set[int]:
        keys = {k for s in self.slots for k in s.reads.hidden if k != FINAL}
        return {int(k.split(".")[1]) for k in keys}

    @property
    def needs_final(self) -> bool:
        return any(FINAL in s.reads.hidden for s in self.slots)

    @property
    def edit_layers(self) -> set[int]:
        return set().union(*(s.edit_layers for s in self.slots)) if self.slots else set()

    @property
    def guides(self) -> bool:
        return any(s.guides for s in self.slots)

    # -- per step ---------------------------------------------------------------------
    def count_step(self) -> None:
        """One engine step (alone when there is no consumer to build row metadata for)."""
        self.step_index += 1
        self.counters.add("engine_steps")

    def begin_step(self, rows: RowInfo) -> list[EditPlan]:
        """Before the forward: collect each editing consumer's plan."""
        self.count_step()
        self.counters.add("rows_seen", len(rows))
        plans = []
        for s in self.slots:
            if not s.edit_layers:
                continue
            mask = s.enabled(rows.requests)
            if mask is not None and not mask.any():
                continue
            plan = EditPlan(rows, s.edit_layers, self.model.hidden_size, self.model.num_layers)
            if self.bus.call(s.consumer, "edit", s.consumer.edit, rows, plan) and plan.ops:
                if mask is not None:
                    plan.restrict(mask)
                plans.append(plan)
        return plans

    def guide(
        self,
        step: StepCapture,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        is_random: np.ndarray,
        filtered: bool,
    ) -> None:
        """In the sampler, after filtering: let guiding consumers change candidate logits."""
        srows = step.sample_rows()
        idx = torch.from_numpy(step.sample_token_row)
        hidden = {}
        for key in self._guide_hidden_keys:
            buf = step.hidden[key]
            hidden[key] = buf.index_select(0, idx.to(buf.device))
        for s in self.slots:
            if not s.guides or not self.bus.active(s.consumer):
                continue
            allowed = s.enabled(srows.requests)
            if allowed is None:
                view = GuideView(step.step, srows, logits, temperature, is_random, filtered, hidden)
                if not self._call_guide(s, view):
                    view.rollback()
            elif allowed.any():
                # Per-request consumer: it sees only its requests' rows, on a copy written
                # back only if it succeeds.
                sel = torch.from_numpy(np.nonzero(allowed)[0]).to(logits.device)
                view = GuideView(
                    step.step,
                    srows.select(allowed),
                    logits[sel],
                    temperature[sel],
                    is_random[allowed],
                    filtered,
                    {k: v[sel] for k, v in hidden.items()},
                )
                if self._call_guide(s, view):
                    logits[sel] = view.logits

    def _call_guide(self, s: _Slot, view: GuideView) -> bool:
        if not self.bus.call(s.consumer, "guide", s.consumer.guide, view):
            return False
        self.counters.add("rows_guided", view.rows_guided)
        self.counters.add("candidates_guided", view.candidates_guided)
        return True

    def end_step(self, step: StepCapture) -> None:
        """After sampling: deliver bundles, then mark positions as seen."""
        for key in step.hidden:
            self.counters.add(f"rows_captured.{key}", len(step.rows))
        if step.logits is not None:
            self.counters.add("rows_captured.logits", int(step.sample_kept.sum()))
        for s in self.slots:
            if s.reads.empty:
                continue
            bundle = build_bundle(s.reads, step, s.enabled(step.rows.requests))
            if bundle is not None:
                self.bus.publish(s.consumer, bundle)
        for i, req in enumerate(step.rows.requests):
            pos = int(step.rows.position[i])
            if pos > req.max_position_seen:
                req.max_position_seen = pos

    def finish_requests(self, requests: list[RequestInfo]) -> None:
        for req in requests:
            self.counters.add("requests_finished")
            for s in self.slots:
                if s.acts_on(req):
                    self.bus.finished(s.consumer, req)

    # -- results ----------------------------------------------------------------------
    def collect(self) -> dict[str, Any]:
        self.bus.flush()
        consumers = {}
        results = {}
        for s in self.slots:
            c = s.consumer
            try:
                # First: result() may settle deferred work that the counters then include.
                results[c.name] = c.result()
            except Exception as e:  # noqa: BLE001
                results[c.name] = {"error": f"{type(e).__name__}: {e}"}
            consumers[c.name] = c.counters.snapshot()
        return {
            "runtime": self.counters.snapshot(),
            "consumers": consumers,
            "results": results,
            "errors": list(self.bus.errors),
        }

    def close(self) -> dict[str, Any]:
        """Flush queues, close consumers, return the final report."""
        self.bus.flush()
        for s in self.slots:
            self.bus.call(s.consumer, "close", s.consumer.close)
        self.bus.close()
        return self.collect()
