"""The taps and per-step flow of one engine, on a runner adapter's step events (``runners.py``);
nothing here reads a runner's internals."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

import numpy as np
import torch

from tllm_core.api.architectures import Architectures
from tllm_core.api.edits import EditBuffers
from tllm_core.api.rows import RequestInfo, StepLayout, layout_rows
from tllm_core.api.step import StepCapture
from tllm_core.runtime.runtime import Runtime
from tllm_core.vllm_bridge.engine_ids import parse_engine_id
from tllm_core.vllm_bridge.layouts import builtin_architectures
from tllm_core.vllm_bridge.parallel import ParallelInfo, sync_edits, sync_sampled
from tllm_core.vllm_bridge.runners import RunnerAdapterBase
from tllm_core.vllm_bridge.sites import TapBuffers, install_tap, tap_info


class RunnerHooks:
    """The step events an adapter reports, on top of a :class:`Runtime`. Per engine step, in
    order: ``finished`` -> ``begin`` -> the forward -> ``forward_done`` -> ``guide`` (when a
    consumer guides) -> ``sampled``."""

    def __init__(
        self,
        adapter: RunnerAdapterBase,
        runtime: Runtime,
        rank: ParallelInfo | None = None,
        architectures: Architectures | None = None,
    ):
        self.adapter = adapter
        self.runtime = runtime
        self.rank = rank or ParallelInfo()
        # Tensor parallel: the leader's edits and (when guiding) sampled tokens go to all ranks.
        self._sync = self.rank.tp_size > 1
        self.requests: dict[str, RequestInfo] = {}
        self._aborting: set[str] = set()
        self._final: dict[str, Any] | None = None  # the report of close()
        self.step: StepCapture | None = None
        # Async scheduling: step k+1 is scheduled before step k's tokens are known, so a step
        # is delivered when the next one reports who finished (its rows past a stop not kept).
        self._pending: StepCapture | None = None
        self.num_tokens = 0
        info = runtime.model
        dev, max_tokens = info.device, adapter.max_num_tokens
        self.clock = torch.zeros(1, dtype=torch.int64, device=dev)
        self.buffers: dict[str, TapBuffers] = {}
        self.edits: dict[str, EditBuffers] = {}
        self.tap_info: dict[str, dict[str, Any]] = {}  # sites.tap_info of non-hidden taps
        self._needs = {t.key for t in runtime.taps}
        edit_keys = {t.key for t in runtime.edit_taps}
        archs = architectures or builtin_architectures()
        layers = adapter.decoder_layers(archs)
        model_name = type(getattr(adapter.runner, "model", None)).__name__
        # Child sites (attn, mlp) first: the residual tap wraps the whole layer.
        for tap in sorted(runtime.taps, key=lambda t: (t.site == "residual", t.key)):
            if tap.layer is None:
                continue  # step sites: read from the runner after the forward
            site = tap_info(layers, tap.site, tap.layer, model_name, archs)
            if site:
                self.tap_info[tap.key] = site
            width, dtype = site.get("width", info.hidden_size), site.get("dtype", info.dtype)
            edit = None
            if tap.key in edit_keys:
                edit = self.edits[tap.key] = EditBuffers(max_tokens, width, dtype, dev)
                for owner, module in runtime.transforms(tap.key):
                    edit.add_transform(owner, module)
            capture = torch.zeros(max_tokens, width, dtype=dtype, device=dev)
            stamp = torch.full((1,), -1, dtype=torch.int64, device=dev)
            buffers = TapBuffers(capture, edit, self.clock, stamp, torch.zeros_like(stamp))
            self.buffers[tap.key] = buffers
            install_tap(layers, tap.site, tap.layer, buffers, model_name, archs)
        sync = sync_sampled if self._sync and runtime.guides else None
        adapter.install(self, guides=runtime.guides, sync_sampled=sync)

    @property
    def active(self) -> bool:
        """Whether any consumer needs row metadata (else ``begin(None)`` only counts)."""
        return self.runtime.configured

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Engine-thread seconds tllm spent in ``phase`` (``host_s.*`` runtime counters)."""
        since = perf_counter()
        yield
        dt = perf_counter() - since
        self.runtime.counters.add(f"host_s.{phase}", dt)
        self.runtime.counters.add("host_s", dt)

    def _request(self, engine_id: str) -> RequestInfo:
        req = self.requests.get(engine_id)
        if req is None:
            extra, n_prompt, prompt_ids = self.adapter.request(engine_id)
            rid, sample, parent = parse_engine_id(engine_id, extra)
            req = RequestInfo(
                engine_id=engine_id,
                request_id=rid,
                prompt_index=int(extra.get("tllm_prompt_index", -1)),
                sample_index=sample,
                num_prompt_tokens=n_prompt,
                extra_args=extra,
                cut_short=rid in self._aborting,
                prompt_token_ids=prompt_ids,
                parent_id=parent,
            )
            self.runtime.results.reuse(rid, engine_id, parent)  # a new request: wanted
            self.requests[engine_id] = req
        return req

    def begin(self, layout: StepLayout | None) -> None:
        with self._timed("begin_step"):
            self.step = None
            if layout is None:
                self.runtime.count_step()
                return
            reqs = [self._request(e) for e in layout.engine_ids]
            rows, sample_row, kept = layout_rows(layout, reqs)
            self.num_tokens = total = layout.total
            step_no = self.runtime.step_index + 1
            self.step = StepCapture(
                step=step_no,
                rows=rows,
                sample_token_row=sample_row,
                sample_kept=kept,
                tensors={k: b.capture[:total] for k, b in self.buffers.items()},
                stamps={k: b.stamp for k, b in self.buffers.items()},
                edited={k: self.buffers[k].edited for k in self.edits},
                tap_info=self.tap_info,
            )
            self.clock.fill_(step_no)
            self.runtime.begin_step(rows, self.edits)
            if self._sync and self.edits:
                sync_edits([self.edits[k] for k in sorted(self.edits)], self.clock.device)

    def finished(self, engine_ids: list[str]) -> None:
        self._deliver_pending(set(engine_ids))
        done = [self.requests.pop(e) for e in engine_ids if e in self.requests]
        if done:
            self.runtime.finish_requests(done)

    def _deliver_pending(self, stopped: set[str]) -> None:
        """Deliver the deferred step; sampling rows of ``stopped`` requests are not kept."""
        step, self._pending = self._pending, None
        if step is None:
            return
        with self._timed("end_step"):
            if stopped:
                reqs = step.sample_rows().requests
                past = step.sample_kept & np.array([r.engine_id in stopped for r in reqs], bool)
                if past.any():
                    step.sample_kept = step.sample_kept & ~past
                    self.runtime.counters.add("rows_past_stop", int(past.sum()))
                    gone = {r.engine_id for r, p in zip(reqs, past, strict=True) if p}
                    step.past_stop = np.array([r.engine_id in gone for r in step.rows.requests])
            self.runtime.end_step(step)

    def forward_done(self, final_hidden: torch.Tensor | None, logits: torch.Tensor) -> None:
        if self.step is None:
            return
        if "final" in self._needs and final_hidden is not None:
            self.step.tensors["final"] = final_hidden[: self.num_tokens]
        # vLLM's sampler may filter or scale the logits in place (fp32 logits are not
        # copied): a logits reader gets them as the model computed them.
        self.step.tensors["logits"] = logits.clone() if "logits" in self._needs else logits

    def guide(
        self, logits: torch.Tensor, temperature: torch.Tensor, is_random: np.ndarray, filtered: bool
    ) -> bool:
        if self.step is None:
            return False
        with self._timed("guide"):
            return self.runtime.guide(self.step, logits, temperature, is_random, filtered)

    def sampled(self, token_ids: torch.Tensor) -> None:
        if self.step is None:
            return
        self.step.tensors["sampled"] = token_ids
        if self.adapter.async_scheduling:
            self._pending = self.step
            return
        with self._timed("end_step"):
            self.runtime.end_step(self.step)

    def close(self) -> dict[str, Any]:
        """Close the runtime once; later calls return the same final report."""
        if self._final is None:
            self._deliver_pending(set())
            self._final = self.runtime.close()
        return self._final

    def mark_aborted(self, request_ids: list[str]) -> None:
        """Mark these caller ids ``cut_short`` before the front end aborts them."""
        ids = {str(i) for i in request_ids}
        self._aborting |= ids
        for req in self.requests.values():
            if req.request_id in ids:
                req.cut_short = True

    def mark_cut_short(self, engine_ids: list[str]) -> None:
        """Mark these engine ids ``cut_short`` before the server aborts them."""
        for e in self.requests.keys() & set(engine_ids):
            self.requests[e].cut_short = True

    def finish_all(self) -> None:
        """Treat every known request as finished (an offline batch ended or was interrupted)."""
        self._deliver_pending(set())
        self.finished(list(self.requests))
        self._aborting.clear()
