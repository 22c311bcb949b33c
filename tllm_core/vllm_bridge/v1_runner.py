"""Adapter for vLLM's V1 model runner (``GPUModelRunner`` and its ``CPUModelRunner``).

The only code that reads or wraps the V1 runner's state (see CONTRACT.md). It turns the
runner's per-step calls into the engine-neutral events of :class:`StepEvents`; another
runner (vLLM's V2 runner) would be one more adapter with the same interface.

Instance-level wrappers (never class-level) on one runner:

- ``_prepare_inputs``: after vLLM lays out the step -> ``begin(layout)``.
- ``execute_model``: before -> ``finished(ids)``; after -> ``forward_done(final, logits)``.
- ``sampler.topk_topp_sampler.forward`` (only when a consumer guides): filter
  (top-k/top-p; min-p already applied) -> ``guide(...)`` -> sample with vLLM's own code.
- ``_sample``: after sampling -> ``sampled(token_ids)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from tllm_core.consumer import ModelInfo
from tllm_core.rows import StepLayout
from tllm_core.vllm_bridge.version import UnsupportedEngineError


class StepEvents(Protocol):
    """What an adapter reports per engine step (implemented by ``RunnerHooks``)."""

    def begin(self, layout: StepLayout | None) -> None: ...

    def finished(self, engine_ids: list[str]) -> None: ...

    def forward_done(self, final_hidden: torch.Tensor | None, logits: torch.Tensor) -> None: ...

    def guide(
        self, logits: torch.Tensor, temperature: torch.Tensor, is_random: np.ndarray, filtered: bool
    ) -> None: ...

    def sampled(self, token_ids: torch.Tensor) -> None: ...

    @property
    def active(self) -> bool: ...


class V1RunnerAdapter:
    def __init__(self, runner: Any):
        self.runner = runner

    # -- static facts -------------------------------------------------------------------
    @property
    def max_num_tokens(self) -> int:
        return int(self.runner.max_num_tokens)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def parallel_config(self) -> Any:
        return self.runner.vllm_config.parallel_config

    def decoder_layers(self) -> nn.ModuleList:
        inner = getattr(self.runner.model, "model", None)
        layers = getattr(inner, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise UnsupportedEngineError(
                f"tllm cannot find decoder layers at model.model.layers in "
                f"{type(self.runner.model).__name__}; supported: Llama/Qwen2/Qwen3/Mistral-style "
                f"decoders"
            )
        return layers

    def model_info(self) -> ModelInfo:
        runner = self.runner
        model = runner.model
        mc = runner.model_config
        vocab = mc.get_vocab_size()
        weight = None
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
        lm_head = model.compute_logits
        if self.parallel_config.tensor_parallel_size > 1:
            # compute_logits all-gathers over the TP group: a collective that only the leader
            # would call. Consumers get a local head built from the gathered weight instead.
            lm_head, full = self._local_head(head, lp, vocab)
            weight = full if plain else None
        elif plain:
            weight = head.weight[:vocab]
        return ModelInfo(
            hidden_size=mc.get_hidden_size(),
            num_layers=mc.hf_config.num_hidden_layers,
            vocab_size=vocab,
            dtype=mc.dtype,
            device=runner.device,
            lm_head=lm_head,
            lm_head_weight=weight,
        )

    @staticmethod
    def _local_head(head: Any, lp: Any, vocab: int) -> tuple[Any, torch.Tensor]:
        """(hidden -> logits without collectives, full ``[vocab, H]`` weight); called on every
        TP rank at once (it all-gathers the vocabulary shards of the lm_head)."""
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

    # -- per request / per step reads ---------------------------------------------------
    def request(self, engine_id: str) -> tuple[dict[str, Any], int]:
        """``(extra_args, prompt length)`` of a scheduled request."""
        st = self.runner.requests[engine_id]
        extra = dict((st.sampling_params.extra_args or {}) if st.sampling_params else {})
        return extra, len(st.prompt_token_ids or ())

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

    # -- wrappers -----------------------------------------------------------------------
    def install(
        self,
        events: StepEvents,
        guides: bool,
        sync_sampled: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Wrap the runner. ``sync_sampled`` (tensor parallel with guidance) makes every rank
        continue from the same sampled tokens; it runs after every sampling, on every rank."""
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
            from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

            tk = r.sampler.topk_topp_sampler
            orig = tk.forward

            def forward(logits, generators, k, p):
                if not state["live"]:
                    return orig(logits, generators, k, p)
                logits = apply_top_k_top_p(logits, k, p)
                md = r.input_batch.sampling_metadata
                n = logits.shape[0]
                temp = md.temperature[:n] if md.temperature is not None else torch.ones(n)
                is_random = (temp.cpu().numpy() >= 1e-5) if not md.all_random else np.ones(n, bool)
                filtered = k is not None or p is not None or self._min_p_active(state["ids"])
                events.guide(logits, temp, is_random, filtered)
                return orig(logits, generators, None, None)

            tk.forward = forward
