"""The runner adapters, the only code that reads or wraps vLLM's model runners (CONTRACT.md,
"Runners"): what every generation reads the same way, then one adapter per generation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from tllm_core.api.architectures import Architectures
from tllm_core.api.consumer import ModelInfo
from tllm_core.api.norms import norm_eps, rmsnorm_gain
from tllm_core.api.rows import StepLayout
from tllm_core.vllm_bridge.errors import UnsupportedEngineError
from tllm_core.vllm_bridge.sites import find_layers
from tllm_core.vllm_bridge.version import require_attrs

# Tensor parallel with guidance: every rank continues from the same sampled tokens.
SyncSampled = Callable[[torch.Tensor], None] | None

# Read once the weights are loaded (``runner.model`` exists only then).
LOADED_MODEL_ATTRS = ("model.compute_logits",)
# Below this a temperature means greedy (vLLM's sampling epsilon).
_GREEDY_EPS = 1e-5
# What every adapter reads or wraps on its runner (this base and the step wrappers).
COMMON_ATTRS = (
    "execute_model",
    "execute_model_state",
    "max_num_tokens",
    "device",
    "model_config",
    "vllm_config.additional_config",
    "vllm_config.parallel_config",
)


# Request ids of the V2 runner's start-up warm-up (``gpu/warmup.py``; run through the real
# ``execute_model`` once tllm's hooks are in place, with JIT warm-up on: GPUs).
WARMUP_IDS = ("_warmup_", "_v2_mixed_warmup")


class RunnerAdapterBase:
    """Static facts of a hooked runner; each generation adds ``request`` and ``install``."""

    #: the runner generation this adapter hooks ("V1", "V2"), for logs and errors
    generation: ClassVar[str] = "?"
    #: every runner attribute (dotted path) it reads or wraps (``worker_setup.check_runner``)
    required_attrs: ClassVar[tuple[str, ...]] = COMMON_ATTRS

    def __init__(self, runner: Any):
        self.runner = runner
        self.live = False  # the step in flight was reported with its rows (``begin``)
        self.max_num_tokens = int(runner.max_num_tokens)
        # Whether vLLM schedules step k+1 before step k's sampled tokens are known.
        sched = getattr(runner.vllm_config, "scheduler_config", None)
        self.async_scheduling = bool(getattr(sched, "async_scheduling", False))

    def request(self, engine_id: str) -> tuple[dict[str, Any], int, tuple[int, ...] | None]:
        """``(extra_args, prompt length, prompt token ids)`` of a scheduled request."""
        raise NotImplementedError

    def install(self, events: Any, guides: bool, sync_sampled: SyncSampled = None) -> None:
        """Wrap the runner's instance attributes so that each step reports ``events``
        (``hooks.RunnerHooks``); the guide only when ``guides``."""
        raise NotImplementedError

    def _finished(self, events: Any, scheduler_output: Any) -> list[str]:
        """Before a step runs: who finished since the last one."""
        finished = list(scheduler_output.finished_req_ids)
        events.finished(finished)
        self.live = False
        return finished

    def _begin(self, events: Any, layout: Callable[[], Any]) -> None:
        if not events.active:  # no consumer: count the step, build nothing
            events.begin(None)
            return
        rows = layout()  # first: a layout that raises leaves the step unreported
        self.live = True
        events.begin(rows)

    def _sampled(self, events: Any, sampled: torch.Tensor, sync_sampled: SyncSampled) -> None:
        if sync_sampled is not None:
            sync_sampled(sampled)
        if self.live:
            events.sampled(sampled[:, 0])

    def describe(self) -> str:
        cls = type(self.runner)
        return f"{self.generation} runner {cls.__module__}.{cls.__name__}"

    def decoder_layers(self, architectures: Architectures) -> nn.ModuleList:
        """The model's decoder layers, where ``architectures`` say."""
        num = self.runner.model_config.get_total_num_hidden_layers()
        return find_layers(self.runner.model, num, architectures)

    def model_info(self) -> ModelInfo:
        runner = self.runner
        model = runner.model
        mc = runner.model_config
        vocab = mc.get_vocab_size()
        head = getattr(model, "lm_head", None)
        lp = getattr(model, "logits_processor", None)
        plain = (
            head is not None
            and getattr(head, "bias", None) is None
            and lp is not None
            and getattr(lp, "soft_cap", None) is None
            and float(getattr(lp, "scale", 1.0)) == 1.0
            and isinstance(getattr(head, "weight", None), torch.Tensor)
        )
        lm_head, weight = model.compute_logits, head.weight[:vocab] if plain else None
        if runner.vllm_config.parallel_config.tensor_parallel_size > 1:
            # compute_logits all-gathers over the TP group: a collective that only the leader
            # would call. Consumers get a local head built from the gathered weight instead.
            lm_head, full = _local_head(head, lp, vocab)
            weight = full if plain else None
        norm, gain, eps = _final_norm(model, mc.get_hidden_size(), mc.dtype, runner.device)
        return ModelInfo(
            hidden_size=mc.get_hidden_size(),
            num_layers=mc.get_total_num_hidden_layers(),
            vocab_size=vocab,
            dtype=mc.dtype,
            device=runner.device,
            lm_head=lm_head,
            lm_head_weight=weight,
            final_norm=norm,
            final_norm_weight=gain,
            final_norm_eps=eps if gain is not None else None,
        )


def _final_norm(
    model: Any, width: int, dtype: torch.dtype, device: torch.device
) -> tuple[Any, torch.Tensor | None, float]:
    """(callable, plain RMSNorm gain or None, eps) of the final norm ``model.model.norm``;
    (None, None, 0) without one."""
    norm = getattr(getattr(model, "model", None), "norm", None)
    if not isinstance(norm, nn.Module):
        return None, None, 0.0
    eps = norm_eps(norm)

    def final_norm(h: torch.Tensor) -> torch.Tensor:
        out = norm(h.contiguous())
        return out[0] if isinstance(out, tuple) else out

    with torch.no_grad():
        try:
            gain = rmsnorm_gain(final_norm, width, eps, dtype, device)
        except Exception:  # noqa: BLE001 - a norm of another form: the callable still serves
            gain = None
    return final_norm, gain, eps


def _local_head(head: Any, lp: Any, vocab: int) -> tuple[Any, torch.Tensor]:
    """(hidden -> logits without collectives, full ``[vocab, H]`` weight); a collective: every
    TP rank calls it (it all-gathers the lm_head's vocabulary shards)."""
    weight = getattr(head, "weight", None)
    if (
        not isinstance(weight, torch.Tensor)
        or getattr(head, "bias", None) is not None
        or lp is None
        or getattr(lp, "logits_as_input", False)
    ):
        raise UnsupportedEngineError(
            "tllm under tensor parallel needs a plain lm_head (an unquantized weight, no "
            f"bias); this model's is {type(head).__name__}"
        )
    from vllm.distributed.parallel_state import get_tp_group

    full = get_tp_group().all_gather(weight.detach(), dim=0)[:vocab].contiguous()
    soft_cap, scale = getattr(lp, "soft_cap", None), float(getattr(lp, "scale", 1.0))

    def lm_head(hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(hidden.to(full.dtype), full)
        if soft_cap is not None:
            logits = torch.tanh(logits / soft_cap) * soft_cap
        if scale != 1.0:
            logits = logits * scale
        return logits

    return lm_head, full


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
    _ids: list[str] | tuple[()] = ()  # the step's requests, set by each layout

    def request(self, engine_id: str) -> tuple[dict[str, Any], int, tuple[int, ...] | None]:
        st = self.runner.requests[engine_id]
        extra = dict((st.sampling_params.extra_args or {}) if st.sampling_params else {})
        ids = st.prompt_token_ids  # None for a prompt given as embeddings: its length is kept
        return extra, int(st.num_prompt_tokens), None if ids is None else tuple(ids)

    def _layout(self, num_scheduled_tokens: np.ndarray) -> StepLayout:
        ib = self.runner.input_batch
        n = ib.num_reqs
        nsched = np.asarray(num_scheduled_tokens[:n], dtype=np.int64)
        self._ids = list(ib.req_ids[:n])  # the step's requests, for the guide's min_p check
        return StepLayout(
            engine_ids=self._ids,
            num_scheduled=nsched,
            num_computed=ib.num_computed_tokens_cpu[:n].astype(np.int64),
            num_tokens=ib.num_tokens_no_spec[:n].astype(np.int64),
            token_ids=self.runner.input_ids.gpu[: int(nsched.sum())],
        )

    def _min_p_active(self) -> bool:
        sps = (getattr(self.runner.requests.get(rid), "sampling_params", None) for rid in self._ids)
        return any(sp is not None and sp.min_p > 0 for sp in sps)

    def install(self, events: Any, guides: bool, sync_sampled: SyncSampled = None) -> None:
        r = self.runner
        prepare, execute, sample = r._prepare_inputs, r.execute_model, r._sample

        def _prepare_inputs(scheduler_output, num_scheduled_tokens, *a, **kw):
            out = prepare(scheduler_output, num_scheduled_tokens, *a, **kw)
            self._begin(events, lambda: self._layout(num_scheduled_tokens))
            return out

        def execute_model(scheduler_output, *a, **kw):
            self._finished(events, scheduler_output)
            out = execute(scheduler_output, *a, **kw)
            st = r.execute_model_state
            if st is not None and self.live:
                events.forward_done(st.hidden_states, st.logits)
            return out

        def _sample(logits, spec_decode_metadata, *a, **kw):
            out = sample(logits, spec_decode_metadata, *a, **kw)
            self._sampled(events, out.sampled_token_ids, sync_sampled)
            return out

        r._prepare_inputs = _prepare_inputs
        r.execute_model = execute_model
        r._sample = _sample
        if guides:
            tk = r.sampler.topk_topp_sampler
            tk.forward = self._guided_forward(events, tk.forward)

    def _guided_forward(self, events: Any, orig: Any):
        """``topk_topp_sampler.forward`` with the guide between filtering and sampling."""
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        def forward(logits, generators, k, p):
            if not self.live:
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
            is_random = np.ones(n, bool) if md.all_random else ib.temperature_cpu[:n] >= _GREEDY_EPS
            if events.guide(cand, temp, is_random, filters or self._min_p_active()):
                return orig(cand, generators, None, None)
            return orig(logits, generators, k, p)

        return forward


class V2RunnerAdapter(RunnerAdapterBase):
    generation = "V2"
    required_attrs = (
        *COMMON_ATTRS,
        "add_requests",
        "prepare_inputs",
        "sample",
        "structured_outputs_worker",
    )
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
        self._final: torch.Tensor | None = None  # the step's final hidden states
        self._logits_read = False  # the step's logits were reported (before a grammar's mask)

    def request(self, engine_id: str) -> tuple[dict[str, Any], int, tuple[int, ...] | None]:
        return self._admitted.get(engine_id, ({}, 0, None))

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

    def install(self, events: Any, guides: bool, sync_sampled: SyncSampled = None) -> None:
        r = self.runner
        require_attrs(r, self.sampler_attrs, "V2 runner")
        execute, add, prepare, sample = r.execute_model, r.add_requests, r.prepare_inputs, r.sample
        sampler, raw_sample = r.sampler, r.sampler.sample

        def execute_model(scheduler_output, *a, **kw):
            if kw.get("dummy_run") or (len(a) >= 2 and a[1]):
                return execute(scheduler_output, *a, **kw)
            for rid in self._finished(events, scheduler_output):
                self._admitted.pop(rid, None)
            self._final, self._logits_read = None, False
            out = execute(scheduler_output, *a, **kw)
            st = r.execute_model_state
            if st is not None and self.live:
                self._final = st.hidden_states
            return out

        def add_requests(scheduler_output, *a, **kw):
            for new in scheduler_output.scheduled_new_reqs:
                sp, ids = new.sampling_params, new.prompt_token_ids
                extra = dict((sp.extra_args or {}) if sp is not None else {})
                n = getattr(new, "prompt_len", None)
                n = len(ids or ()) if n is None else int(n)
                self._admitted[new.req_id] = (extra, n, None if ids is None else tuple(ids[:n]))
            return add(scheduler_output, *a, **kw)

        def prepare_inputs(scheduler_output, *a, **kw):
            batch = prepare(scheduler_output, *a, **kw)
            if any(str(e).startswith(WARMUP_IDS) for e in batch.req_ids[: batch.num_reqs]):
                self.live = False  # vLLM's own start-up requests: no user's rows, no step
                return batch
            self._begin(events, lambda: self._layout(batch))
            return batch

        def logits_computed(logits: torch.Tensor) -> None:
            if self.live and not self._logits_read:
                self._logits_read = True
                events.forward_done(self._final, logits)

        def sampler_sample(logits, *a, **kw):
            logits_computed(logits)
            return raw_sample(logits, *a, **kw)

        grammar = r.structured_outputs_worker
        if grammar is not None:  # masks structured-output rows in place: report them before
            raw_mask = grammar.apply_grammar_bitmask

            def apply_grammar_bitmask(logits, *a, **kw):
                logits_computed(logits)
                return raw_mask(logits, *a, **kw)

            grammar.apply_grammar_bitmask = apply_grammar_bitmask

        def runner_sample(*a, **kw):
            out = sample(*a, **kw)
            self._sampled(events, out[0].sampled_token_ids, sync_sampled)
            return out

        r.execute_model = execute_model
        r.add_requests = add_requests
        r.prepare_inputs = prepare_inputs
        r.sample = runner_sample
        sampler.sample = sampler_sample
        if guides:
            sampler._sample_random = self._guided_sample_random(events, sampler)

    def _guided_sample_random(self, events: Any, sampler: Any):
        """``sampler._sample_random`` with the guide between filtering and sampling."""
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        orig = sampler._sample_random
        states = sampler.sampling_states

        def _sample_random(
            processed, expanded_idx_mapping, idx_mapping_np, pos, top_k, top_p, fused
        ):
            rows = (expanded_idx_mapping, idx_mapping_np, pos)
            if not self.live:
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
            if events.guide(cand, temperature, is_random, filters or min_p):
                return orig(cand, *rows, None, None, False)
            if work is processed:
                # Filtered in place already: the rest of vLLM's own (unfused) path.
                return orig(cand, *rows, None, None, fused)
            return orig(processed, *rows, top_k, top_p, fused)

        return _sample_random
