"""The engine-side runtime: builds consumers, routes each step's data to them. Engine-neutral:
the vLLM bridge calls begin_step, guide, end_step and finish_requests."""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tllm_core.api.bundles import Bundle, GuideView
from tllm_core.api.consumer import (
    Consumer,
    ConsumerConfig,
    ConsumerContext,
    ControlError,
    ModelInfo,
)
from tllm_core.api.consumer_spec import ConsumerSpec
from tllm_core.api.counters import Counters
from tllm_core.api.edits import EditBuffers, EditPlan
from tllm_core.api.port_names import tap_port_name
from tllm_core.api.ports import Edit, Phase, PortDeclarationError, SamplerGuide, resolve_layer
from tllm_core.api.producer import TapRequest
from tllm_core.api.request_settings import WINDOW_FIELD, request_key
from tllm_core.api.rows import RequestInfo, RowInfo, request_runs, row_mask
from tllm_core.api.step import StaleTapError, StepCapture
from tllm_core.api.windows import takes_last
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.buffer_pool import GuidedCounts, StepIndices
from tllm_core.runtime.build_error import ENGINE, LayerResolver, explain
from tllm_core.runtime.bus import Bus
from tllm_core.runtime.reads import (
    LastRows,
    PortRead,
    ReadPlan,
    RowMasks,
    RowSelection,
    build_bundle,
    bundle_indices,
    last_rows,
    plan_reads,
    read_unconfirmed,
    step_runs,
)
from tllm_core.runtime.request_results import ResultStore
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.runtime.stamp_copies import StampRead, StampReader
from tllm_core.runtime.watchdog import (
    BACKGROUND,
    CLOSE,
    STEP,
    EngineStop,
    Hung,
    Watchdog,
    write_note,
)

log = logging.getLogger("tllm")


@dataclass
class _Slot:
    consumer: Consumer
    reads: ReadPlan
    edits: dict[str, TapRequest] = field(default_factory=dict)  # port key -> its edit tap
    transforms: dict[str, Any] = field(default_factory=dict)  # port key -> in-graph module
    guides: bool = False
    per_request: bool = False
    window_key: str | None = None  # ``tllm_{name}_window`` when its Request declares one
    last: LastRows | None = None  # window ``last``: the rows held
    # Set by each step's plan: its guide's rows, the rows it may take, the rows held as last.
    selection: RowSelection | None = None
    masks: RowMasks = field(default_factory=RowMasks)
    held: tuple[np.ndarray, np.ndarray] | None = None

    def acts_on(self, request: RequestInfo) -> bool:
        return request.acted_on_by(self.consumer.name, self.per_request)

    def enabled(self, requests: list[RequestInfo]) -> np.ndarray | None:
        """Row mask of requests this consumer acts on; None when it acts on all."""
        if not self.per_request:
            return None
        out = np.empty(len(requests), np.bool_)
        for req, start, stop in request_runs(requests):  # once per request, not per row
            out[start:stop] = self.acts_on(req)
        return out


def _write_plan(
    plan: EditPlan,
    allowed: dict[str, str],
    buffers: dict[str, EditBuffers],
    owner: str,
    steps: StepIndices,
    index: np.ndarray | None,
) -> None:
    """Check, then write, one consumer's plan (``index``: its rows in the step's) into the
    edit taps' buffers, its row indices sent in one copy per device."""
    if index is not None:
        plan.remap(index)
    by_device: dict[torch.device, list[np.ndarray]] = {}
    for key, ops in plan.ops.items():
        by_device.setdefault(buffers[allowed[key]].add.device, []).extend(r for r, _, _ in ops)
    for device, arrays in by_device.items():
        steps.send(arrays, device)
    for key, ops in plan.ops.items():
        buffers[allowed[key]].check(ops, key, steps.index)
    for key, ops in plan.ops.items():
        buffers[allowed[key]].write(ops, owner, steps.index)


def build_consumers(
    specs: Sequence[ConsumerSpec],
    configs: Sequence[ConsumerConfig],
    model: ModelInfo,
    registry: Registry,
    data_parallel: tuple[int, int] = (0, 1),
    where: str = ENGINE,
    model_path: str = "",
    max_result_bytes: int = ConsumerContext.max_result_bytes,
) -> list[_Slot]:
    """Construct consumers and resolve their ports (else a ConsumerBuildError)."""
    slots = []
    for spec, config in zip(specs, configs, strict=True):
        resolve = LayerResolver(model.num_layers)
        cls = registry.get(spec.name)  # an unknown name: ConsumerSpecError as it is
        try:
            context = ConsumerContext(
                model=model,
                resolve_layer=resolve,
                parse_port=registry.parse_port,
                per_request=spec.per_request,
                data_parallel_rank=data_parallel[0],
                data_parallel_size=data_parallel[1],
                max_result_bytes=max_result_bytes,
            )
            slots.append(_slot(cls(config, context), spec, resolve, registry))
        except Exception as e:
            raise explain(spec.name, config, e, resolve, where, model_path) from e
    return slots


def _slot(
    consumer: Consumer, spec: ConsumerSpec, resolve: LayerResolver, registry: Registry
) -> _Slot:
    """A constructed consumer's ports resolved."""
    cls = type(consumer)
    reads = plan_reads(consumer.reads(), resolve, registry.producer_for)
    slot = _Slot(consumer, reads, per_request=spec.per_request)
    if cls.Request is not None and WINDOW_FIELD in cls.Request.model_fields:
        slot.window_key = request_key(cls.name, WINDOW_FIELD)
    slot.last = last_rows(reads, cls.request_window_rows, windowed=slot.window_key is not None)
    for w in consumer.writes():
        if isinstance(w, Edit):
            target = w.target.resolve(resolve)
            slot.edits[target.key] = registry.producer_for(target).edit_tap(target)
            if w.transform is not None:
                slot.transforms[target.key] = w.transform
        elif isinstance(w, SamplerGuide):
            slot.guides = True
        else:
            raise PortDeclarationError.of("writes", w)
    guide_only = [r.port for r in reads.token.values() if r.phase is Phase.GUIDE]
    if guide_only and not slot.guides:
        raise ValueError(
            f"read port {guide_only[0]!r} has Phase.GUIDE (read at guide time only) but the "
            "consumer declares no SamplerGuide write port: it would never see that data; "
            "use another phase to get it in on_bundle"
        )
    return slot


def _kept_rows(step: StepCapture) -> np.ndarray:
    """The step's rows with a kept sample (each request's last row so far)."""
    kept = np.zeros(len(step.rows), np.bool_)
    kept[step.sample_token_row[step.sample_kept]] = True
    return kept


_NOT_ACTING = (
    "this consumer did not act on the request (it is per-request: name it in tllm_consumers)"
)


class Runtime:
    """One engine's consumers and their step flow. ``deliver=False``: a follower (a tensor-
    parallel rank whose output is not kept) builds them only to ask for the same taps."""

    def __init__(
        self,
        settings: RuntimeSettings,
        model: ModelInfo,
        registry: Registry | None = None,
        deliver: bool = True,
        data_parallel: tuple[int, int] = (0, 1),
    ):
        self.settings = settings
        self.model = model
        self.deliver = deliver
        self.counters = Counters()
        self._guided_step = -1  # the last step whose sampler called guide()
        registry = registry or Registry()
        configs = registry.check(settings.consumers)  # the configs arrived as JSON
        self.slots = build_consumers(
            settings.consumers,
            configs,
            model,
            registry,
            data_parallel,
            max_result_bytes=settings.max_result_bytes,
        )
        self.configured = bool(self.slots)
        # What the bridge installs, on a follower too (its forward must match).
        self.taps = frozenset(t for s in self.slots for t in s.reads.taps() | {*s.edits.values()})
        for tap in sorted(self.taps, key=lambda t: t.key):  # before any consumer's first step
            registry.architectures.check_site(tap.site)
        self.edit_taps = frozenset(t for s in self.slots for t in s.edits.values())
        self.guides = any(s.guides for s in self.slots)
        self._transforms: dict[str, list[tuple[str, Any]]] = {}
        for s in self.slots:
            for k, module in s.transforms.items():
                self._transforms.setdefault(s.edits[k].key, []).append((s.consumer.name, module))
        if not deliver:
            for s in self.slots:
                s.consumer.close()  # never used: writes and keeps nothing
            self.slots = []
        self.watchdog = Watchdog(
            {
                STEP: settings.callback_deadline_s,
                BACKGROUND: settings.background_deadline_s,
                CLOSE: settings.close_deadline_s,
            },
            self._hung,
        )
        self._engine_stop = EngineStop(settings.hung_stop_s)
        self.results = ResultStore(self.counters, settings.max_result_bytes)
        self.bus = Bus(self.counters, settings, self.watchdog, self.results)
        self.step_index = 0
        self._buffers = StepIndices()
        self._planned: StepCapture | None = None  # the step whose indices were sent
        self._window_warned: set[str] = set()  # consumers whose bad window was logged
        self._guided = GuidedCounts(self._buffers.pool)
        self._stamps = StampReader()
        # Steps delivered before their stamps arrived, with the ports handed out unchecked.
        self._unsettled: deque[tuple[StepCapture, StampRead, list[tuple[str, set[str]]]]] = deque()
        self.tap_errors: list[dict[str, str]] = []
        self._closed_report: dict[str, Any] | None = None
        # Every port read by some consumer (phases merged): what rows_captured counts.
        self._read_ports: dict[str, PortRead] = {
            k: r for s in self.slots for k, r in (*s.reads.token.items(), *s.reads.sample.items())
        }
        self._guide_reads = {k: r for s in self.slots if s.guides for k, r in s.reads.token.items()}

    def _hung(self, hung: Hung) -> None:
        """A background consumer is switched off; otherwise the front end is told, engine stopped."""
        self.counters.add("callbacks_hung", of=hung.consumer)
        if hung.kind == BACKGROUND:
            self.bus.abandon(hung.consumer, hung.report())
            return
        log.error("tllm: %s", hung.report())
        self.bus.errors.append(
            {"consumer": hung.consumer, "where": hung.callback, "error": hung.message()}
        )
        write_note(self.settings.fault_file, hung)
        self._engine_stop.schedule(hung)

    def transforms(self, tap_key: str) -> list[tuple[str, Any]]:
        """In-graph transforms on an edit tap, in consumer order: ``(consumer name, module)``."""
        return list(self._transforms.get(tap_key, []))

    def count_step(self) -> None:
        """One engine step (called alone when no consumer needs row metadata)."""
        self.step_index += 1
        self.counters.add("engine_steps")

    def begin_step(self, rows: RowInfo, buffers: dict[str, EditBuffers]) -> None:
        """Before the forward: write each editing consumer's plan into the reset edit buffers."""
        self.count_step()
        self.counters.add("rows_seen", len(rows))
        for b in buffers.values():
            b.reset()
        resolve = functools.partial(resolve_layer, num_layers=self.model.num_layers)
        for s in self.slots:
            if not s.edits or not self.bus.active(s.consumer):
                continue
            mask = s.enabled(rows.requests)
            if mask is not None and not mask.any():
                continue
            # A per-request consumer sees (and can select) only its requests' rows.
            sel = None if mask is None else RowSelection(mask)
            own = rows if sel is None else sel.rows(rows, self._buffers)
            allowed = {k: t.key for k, t in s.edits.items()}
            widths = {k: buffers[t].add.shape[-1] for k, t in allowed.items() if t in buffers}
            plan = EditPlan(
                own, allowed, self.model.hidden_size, resolve, set(s.transforms), widths
            )
            c, acted = s.consumer, own.requests
            if self.bus.call(c, "edit", c.edit, own, plan, requests=acted) and plan.ops:
                # In the consumer's isolation: a bad plan is its failure.
                index = None if sel is None else sel.index
                args = (plan, allowed, buffers, c.name, self._buffers, index)
                self.bus.call(c, "edit (buffers)", _write_plan, *args, requests=acted)

    def _plan(self, step: StepCapture, guide_rows: list[np.ndarray] = ()) -> None:
        """Send every index the step's guide (``guide_rows``: more of its own) and bundles use
        to the device, once, in one copy."""
        if self._planned is step:
            return
        self._planned = step
        arrays = [step.sample_token_row, *guide_rows] if self.guides else []
        # Per-request guides' rows, as indices into the sampling rows.
        requests = [step.rows.requests[i] for i in step.sample_token_row] if self.guides else []
        for s in self.slots:
            mask = s.enabled(requests) if s.guides else None
            s.selection = RowSelection(mask) if mask is not None and mask.any() else None
            arrays += s.selection.indices() if s.selection is not None else []
        runs = functools.cache(functools.partial(step_runs, step))  # only if windows are taken
        kept = _kept_rows(step) if any(s.last is not None for s in self.slots) else None
        for s in self.slots:
            s.held = None
            if s.reads.empty:
                continue
            enabled = s.enabled(step.rows.requests)
            if step.past_stop is not None:  # rows a synchronous engine never computes
                enabled = ~step.past_stop if enabled is None else enabled & ~step.past_stop
            s.masks = RowMasks(enabled, enabled)
            last = None
            if s.last is not None and s.last.every:  # each request's last row so far
                last = kept.copy() if enabled is None else kept & enabled
            if s.window_key is not None:
                s.masks, last = self._windowed(s, step, runs(), enabled, last)
            arrays += bundle_indices(s.reads, step, s.masks)
            if s.last is not None and last is not None and last.any():
                slots = s.last.place([step.rows.requests[r] for r in np.nonzero(last)[0]])
                s.held = last, slots
                arrays += [*bundle_indices(s.last.plan, step, RowMasks(last, last)), slots]
        self._buffers.plan(arrays, step.rows.token_ids.device)

    def _windowed(
        self,
        s: _Slot,
        step: StepCapture,
        runs: list[tuple[RequestInfo, int, int]],
        enabled: np.ndarray | None,
        last: np.ndarray | None,
    ) -> tuple[RowMasks, np.ndarray | None]:
        """``enabled`` and ``last`` narrowed by the windows of requests that set the window
        key; a window the engine cannot parse takes no row (counted)."""
        key, out, rows = s.window_key, None, step.rows
        for j, (req, start, stop) in enumerate(runs):
            if key not in req.extra_args or (enabled is not None and not enabled[start]):
                continue
            try:
                window = req.window(s.consumer)
            except ValueError as e:
                self.counters.add(f"rows_window_invalid.{s.consumer.name}", stop - start)
                if s.consumer.name not in self._window_warned:
                    self._window_warned.add(s.consumer.name)
                    log.warning("tllm: %s: %s; none of its rows are taken", s.consumer.name, e)
                keep, held = np.zeros(stop - start, np.bool_), False
            else:
                if window is None:
                    continue
                here = (rows.is_decode[start:stop], rows.position[start:stop])
                prompt = functools.partial(np.full, stop - start, req.num_prompt_tokens, np.int64)
                keep = row_mask(window, *here, prompt)
                held = (
                    s.last is not None
                    and takes_last(window)
                    and bool(step.sample_kept[j])
                    and (s.last.every or bool(row_mask(s.last.ports, *here, prompt)[-1]))
                )
            if out is None:
                out = np.ones(len(rows), np.bool_) if enabled is None else enabled.copy()
            out[start:stop] &= keep
            if held or last is not None:
                last = np.zeros(len(rows), np.bool_) if last is None else last
                last[stop - 1] = held
        out = enabled if out is None else out
        narrows = type(s.consumer).request_window_rows
        token = out if "token" in narrows else enabled
        sample = out if "sample" in narrows else enabled
        return RowMasks(token, sample), last

    def guide(
        self,
        step: StepCapture,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        is_random: np.ndarray,
        filtered: bool,
    ) -> bool:
        """In the sampler, after filtering: guides change candidate logits; True when one wrote."""
        self._guided_step = step.step
        idx = step.sample_token_row
        # Rows whose draw is kept: random (greedy ones took vLLM's argmax before), not
        # mid-prefill (that token is discarded). Their index goes in the step's one copy.
        drawn = np.flatnonzero(is_random & ~step.rows.mid_prefill[idx])
        self._plan(step, [drawn] if len(drawn) < len(idx) else [])
        srows = step.rows.take(idx, self._buffers.gather(step.rows.token_ids, idx))
        hidden = {}
        for key, r in self._guide_reads.items():
            # No stamp read (the host would wait for the forward): unwritten rows read NaN.
            try:
                hidden[key] = self._guide_rows(step, r)
            except StaleTapError as e:
                self._stale(key, e)
        changed = False
        for s in self.slots:
            if not s.guides or not self.bus.active(s.consumer):
                continue
            sel = s.selection  # per-request: only its requests' rows
            if s.per_request and sel is None:
                continue  # no request of the step switched it on
            n = len(srows) if sel is None else len(sel)
            counts = self._buffers.pool.take((n,), torch.long, logits.device)
            args = (logits, temperature, is_random, filtered, hidden, counts)
            if sel is None:
                view = GuideView(step.step, srows, *args)
            else:
                view = sel.guide_view(self._buffers, step.step, srows, *args)
            self.counters.add("rows_guide_visited", len(view.rows))
            if not self.bus.call(
                s.consumer, "guide", s.consumer.guide, view, requests=view.rows.requests
            ):
                view.rollback()  # the step's logits (or a gathered copy) as they were
                continue
            view.commit()
            if view.wrote:
                self._guided.add(view.changed_per_row())
                if sel is not None:
                    sel.write_back(logits, view, self._buffers)
                changed = True
        if changed and len(drawn):  # rows left without a candidate: one pass, on the device
            row_max = self._buffers.pool.take((len(logits),), logits.dtype, logits.device)
            torch.amax(logits, -1, out=row_max)
            if len(drawn) < len(idx):
                row_max = self._buffers.gather(row_max, drawn)
            self._guided.add_empty(row_max)
        return changed

    def _guide_rows(self, step: StepCapture, r: PortRead) -> torch.Tensor:
        """A token port at the sampling rows, NaN (on the device) where this step's forward
        did not write its taps."""
        buf, _, stale = read_unconfirmed(r, step, self._buffers)
        rows = self._buffers.gather(buf, step.sample_token_row)
        return rows if stale is None else rows.masked_fill_(stale, float("nan"))

    def _stale(self, key: str, error: StaleTapError | str) -> None:
        """A tap buffer the forward did not write: never delivered, counted, an error."""
        self.counters.add("stale_captures", of=key)
        if not any(e["where"] == key for e in self.tap_errors):
            log.error("tllm: %s; not delivered", error)
            self.tap_errors.append({"consumer": "(runtime)", "where": key, "error": str(error)})

    def end_step(self, step: StepCapture) -> None:
        """After sampling: deliver bundles, mark positions, count what the taps confirm. Until
        the stamps arrive, a stale tap's rows are delivered as NaN and checked later."""
        if self.guides and self._guided_step != step.step and step.sample_kept.any():
            # vLLM calls no sampler hook for an all-greedy batch: say why guides did nothing.
            self.counters.add("steps_greedy")
        read = self._stamps.start(step.stamps, step.edited)
        step.stamp_values = read.values
        if read.ready():
            step.confirm()
        unchecked: list[tuple[str, set[str]]] = []
        if step.past_stop is not None and self._planned is step:  # planned at guide time
            self._planned = None  # again, without the rows past a stop
        self._plan(step)
        # Again now: async scheduling may have dropped rows since the plan.
        kept = _kept_rows(step) if any(s.held is not None for s in self.slots) else None
        for s in self.slots:
            if s.reads.empty or not self.bus.active(s.consumer):  # switched off: nothing cut
                continue
            # A port stale in both the step's bundle and its last rows: one read refused.
            stale: dict[str, StaleTapError] = {}
            mine: list[tuple[str, set[str]]] = []
            bundle = build_bundle(s.reads, step, s.masks, stale.setdefault, mine, self._buffers)
            if bundle is not None:
                if s.reads.token:  # the token rows its phases and windows kept
                    self.counters.add(f"rows_bundled.{s.consumer.name}", len(bundle.rows))
                self.bus.publish(s.consumer, bundle)
            if s.held is not None:  # held on the device, delivered at the requests' finish
                assert s.last is not None and kept is not None
                mask, slots = s.held
                still = kept[mask]
                if not still.all():  # rows past a stop, dropped since the plan (async)
                    mask, slots = mask & kept, slots[still]
                masks = RowMasks(mask, mask)
                held = build_bundle(s.last.plan, step, masks, stale.setdefault, mine, self._buffers)
                if held is None:  # every port stale: the rows are held, reading NaN
                    idx = np.nonzero(mask)[0]
                    rows = step.rows.take(idx, self._buffers.gather(step.rows.token_ids, idx))
                    held = Bundle(step=step.step, rows=rows)
                s.last.keep(held, slots, self._buffers)
            for key, error in stale.items():
                self._stale(key, error)
            unchecked.extend(dict(mine).items())
        self._planned = None  # its device indices are let go (a later plan reuses them)
        self._buffers.release()
        for i, req in enumerate(step.rows.requests):
            req.max_position_seen = max(req.max_position_seen, int(step.rows.position[i]))
        self._unsettled.append((step, read, unchecked))
        self._settle(wait=False)

    def _settle(self, wait: bool) -> None:
        """Count and check delivered steps whose stamps arrived, in order (``wait``: all)."""
        while self._unsettled and (wait or self._unsettled[0][1].ready()):
            step, _, unchecked = self._unsettled.popleft()
            self._count_step(step, unchecked)

    def _count_step(self, step: StepCapture, unchecked: list[tuple[str, set[str]]]) -> None:
        stale = step.confirm()
        stale_at = f"was not written by step {step.step}'s forward (stale buffer)"
        for key, r in self._guide_reads.items():  # read at guide time only: no bundle reports it
            if r.phase is Phase.GUIDE and any(t.key in stale for t in r.producer.taps(r.port)):
                self._stale(key, f"the tap of {key!r} {stale_at}: the guide read NaN rows")
        for key, taps in unchecked:
            if taps & stale:
                port = tap_port_name(min(taps & stale))
                self._stale(
                    key, f"the tap of {port!r} {stale_at}: {key!r} was delivered as NaN rows"
                )
        kept = int(step.sample_kept.sum())
        for key, r in self._read_ports.items():
            taps = r.producer.taps(r.port)
            if all(t.key in step.tensors and t.key not in stale for t in taps):
                self.counters.add(
                    f"rows_captured.{key}", len(step.rows) if r.port.rows == "token" else kept
                )
        for tap_key, n in step.edited_rows().items():
            self.counters.add("rows_edited", n, of=tap_port_name(tap_key))

    def finish_requests(self, requests: list[RequestInfo]) -> None:
        for s in self.slots:  # window ``last``: the rows come before the finish notices
            if s.last is not None and len(s.last):
                bundle = s.last.take(requests, self.step_index)
                if bundle is not None and self.bus.active(s.consumer):
                    self.counters.add(f"rows_bundled.{s.consumer.name}", len(bundle.rows))
                    self.bus.publish(s.consumer, bundle)
        for req in requests:
            self.counters.add("requests_finished")
            asked = req.results_asked
            for s in self.slots:
                if s.acts_on(req):
                    self.bus.finished(s.consumer, req)
                elif s.consumer.name in asked:
                    self.results.put(req, s.consumer.name, {"error": _NOT_ACTING})
            if asked and self.deliver:
                mine = {s.consumer.name for s in self.slots}
                for name in sorted(asked - mine):
                    self.results.put(req, name, {"error": f"no consumer {name!r} in this engine"})

    def take_results(self, request_ids: list[str], wait_s: float = 0.0) -> dict[str, Any]:
        """Take the results made for these caller ids, after waiting ``wait_s`` at most."""
        if wait_s > 0:
            self.bus.flush(wait_s)
        return self.results.take(request_ids)

    def control(self, name: str, action: str, payload: dict[str, Any]) -> dict[str, Any]:
        """A control request for consumer ``name`` (between steps): ``{"reply": ...}`` or
        ``{"error": message, "status": http_status}``."""
        slot = next((s for s in self.slots if s.consumer.name == name), None)
        if slot is None:
            return {"error": f"no consumer {name!r} in this engine", "status": 404}
        try:
            return {"reply": slot.consumer.control(action, payload)}
        except ControlError as e:
            return {"error": str(e), "status": e.status}
        except (ValueError, TypeError, KeyError) as e:
            return {"error": f"{name}: {type(e).__name__}: {e}", "status": 400}

    def collect(self) -> dict[str, Any]:
        self._settle(wait=True)
        self.bus.flush()
        rows, candidates, empty = self._guided.drain()
        self.counters.add("rows_guided", rows)
        self.counters.add("candidates_guided", candidates)
        self.counters.add("rows_without_candidates", empty)
        consumers = {}
        results = {}
        for s in self.slots:
            c = s.consumer
            if self.bus.abandoned(c.name):  # its thread is stuck in it: not asked again
                results[c.name] = {"error": "switched off: a callback passed its deadline"}
            else:
                try:
                    with self.watchdog.watching(c.name, "result", CLOSE):
                        # First: result() may settle deferred work the counters then include.
                        results[c.name] = c.result()  # bounded: under the watchdog
                except Exception as e:  # noqa: BLE001
                    results[c.name] = {"error": f"{type(e).__name__}: {e}"}
            consumers[c.name] = c.counters.snapshot()
        return {
            "runtime": self.counters.snapshot(),
            "consumers": consumers,
            "results": results,
            "errors": list(self.bus.errors) + list(self.tap_errors),
        }

    def close(self) -> dict[str, Any]:
        """Flush queues, close consumers (once), return the final report."""
        if self._closed_report is None:
            self.bus.flush()
            # Threads stopped before their consumers close: one that lagged hears the rest of
            # its queue as dropped (its records say so), never a bundle after its close.
            busy = self.bus.close()
            for s in self.slots:
                if s.consumer.name in busy:
                    continue  # its thread is still inside it: closing now would race it
                # Failed consumers too: what they hold (buffered rows, a manifest) is written.
                self.bus.call(
                    s.consumer, "close", s.consumer.close, even_if_disabled=True, kind=CLOSE
                )
            self._closed_report = self.collect()
            self.watchdog.close()
        return self._closed_report
