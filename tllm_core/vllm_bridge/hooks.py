"""Per-runner hooks: the only code that reads vLLM runner state (see CONTRACT.md).

Instance-level wrappers (never class-level) on one V1 runner:

- ``_prepare_inputs``: after vLLM lays out the step, build row metadata and write
  consumers' residual edits into the layer taps' buffers.
- ``execute_model``: before, report finished requests; after, pick up the final
  hidden states and logits the forward produced.
- ``sampler.topk_topp_sampler.forward``: filter (top-k/top-p; min-p already applied),
  let guiding consumers change candidate logits, then sample with vLLM's own code.
- ``_sample``: after sampling, hand the step to producers and the bus.
"""

from __future__ import annotations

import logging
import re
from time import perf_counter
from typing import Any

import numpy as np
import torch
from torch import nn

from producers.step import StepCapture
from tllm_core.consumer import ModelInfo
from tllm_core.ports import FINAL, layer_key
from tllm_core.registry import Registry
from tllm_core.rows import RequestInfo, RowInfo
from tllm_core.runtime import Runtime
from tllm_core.settings import RuntimeSettings
from tllm_core.vllm_bridge.taps import EditBuffers, LayerTap
from tllm_core.vllm_bridge.version import UnsupportedEngineError, check_runner, check_version

log = logging.getLogger("tllm")

# Engine ids: "{external}-{8 chars}"; n>1 children: "{index}_{external}-{8 chars}".
_SUFFIX = re.compile(r"^(?P<base>.*)-[0-9A-Za-z]{8}$")
_CHILD = re.compile(r"^(?P<index>\d+)_(?P<rest>.+)$")


def parse_engine_id(engine_id: str, extra_args: dict[str, Any]) -> tuple[str, int]:
    """(caller's request id, sample index) from vLLM's internal request id."""
    rest, sample = engine_id, 0
    n_hint = extra_args.get("tllm_n")
    m = _CHILD.match(engine_id)
    if m and (n_hint is None or int(n_hint) > 1):
        sample, rest = int(m.group("index")), m.group("rest")
    m = _SUFFIX.match(rest)
    return (m.group("base") if m else rest), sample


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedEngineError(
            f"tllm cannot find decoder layers at model.model.layers in {type(model).__name__}; "
            f"supported: Llama/Qwen2/Qwen3/Mistral-style decoders"
        )
    return layers


def _model_info(runner: Any) -> ModelInfo:
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
    if plain:
        weight = head.weight[:vocab]
    return ModelInfo(
        hidden_size=mc.get_hidden_size(),
        num_layers=mc.hf_config.num_hidden_layers,
        vocab_size=vocab,
        dtype=mc.dtype,
        device=runner.device,
        lm_head=model.compute_logits,
        lm_head_weight=weight,
    )


class RunnerHooks:
    def __init__(self, runner: Any, runtime: Runtime):
        self.runner = runner
        self.runtime = runtime
        self.requests: dict[str, RequestInfo] = {}
        self.step: StepCapture | None = None
        self.num_tokens = 0
        info = runtime.model
        max_tokens = runner.max_num_tokens
        layers = find_decoder_layers(runner.model)
        self.capture: dict[str, torch.Tensor] = {}
        self.edits: dict[int, EditBuffers] = {}
        for i in sorted(runtime.capture_layers | runtime.edit_layers):
            cap = None
            if i in runtime.capture_layers:
                cap = torch.zeros(
                    max_tokens, info.hidden_size, dtype=info.dtype, device=info.device
                )
                self.capture[layer_key(i)] = cap
            edit = None
            if i in runtime.edit_layers:
                edit = self.edits[i] = EditBuffers(
                    max_tokens, info.hidden_size, info.dtype, info.device
                )
            layers[i] = LayerTap(layers[i], cap, edit)
        self._install_wrappers()

    # -- installation -------------------------------------------------------------------
    def _install_wrappers(self) -> None:
        r = self.runner
        prepare, execute, sample = r._prepare_inputs, r.execute_model, r._sample

        def _prepare_inputs(scheduler_output, num_scheduled_tokens, *a, **kw):
            out = prepare(scheduler_output, num_scheduled_tokens, *a, **kw)
            t = perf_counter()
            if self.runtime.slots:
                self._begin_step(num_scheduled_tokens)
            else:  # runtime loaded without consumers: count steps, build nothing
                self.runtime.count_step()
            self._host_time("begin_step", t)
            return out

        def execute_model(scheduler_output, *a, **kw):
            self._finish(scheduler_output.finished_req_ids)
            self.step = None
            out = execute(scheduler_output, *a, **kw)
            st = r.execute_model_state
            if st is not None and self.step is not None:
                if self.runtime.needs_final:
                    self.step.hidden[FINAL] = st.hidden_states[: self.num_tokens]
                self.step.logits = st.logits
            return out

        def _sample(logits, spec_decode_metadata, *a, **kw):
            out = sample(logits, spec_decode_metadata, *a, **kw)
            if self.step is not None:
                t = perf_counter()
                self.step.sampled_token_ids = out.sampled_token_ids[:, 0]
                self.runtime.end_step(self.step)
                self._host_time("end_step", t)
            return out

        r._prepare_inputs = _prepare_inputs
        r.execute_model = execute_model
        r._sample = _sample
        if self.runtime.guides:
            tk = r.sampler.topk_topp_sampler
            tk.forward = self._make_guided_forward(tk.forward)

    def _make_guided_forward(self, orig):
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        def forward(logits, generators, k, p):
            step = self.step
            if step is None:
                return orig(logits, generators, k, p)
            t = perf_counter()
            logits = apply_top_k_top_p(logits, k, p)
            md = self.runner.input_batch.sampling_metadata
            n = logits.shape[0]
            temp = md.temperature[:n] if md.temperature is not None else torch.ones(n)
            is_random = (temp.cpu().numpy() >= 1e-5) if not md.all_random else np.ones(n, bool)
            filtered = k is not None or p is not None or self._min_p_active(step)
            self.runtime.guide(step, logits, temp, is_random, filtered)
            self._host_time("guide", t)
            return orig(logits, generators, None, None)

        return forward

    def _host_time(self, phase: str, since: float) -> None:
        """Engine-thread seconds tllm spent in ``phase`` (``host_s.*`` runtime counters)."""
        dt = perf_counter() - since
        self.runtime.counters.add(f"host_s.{phase}", dt)
        self.runtime.counters.add("host_s", dt)

    def _min_p_active(self, step: StepCapture) -> bool:
        ids = {r.engine_id for r in step.rows.requests}
        for rid in ids:
            st = self.runner.requests.get(rid)
            if st is not None and st.sampling_params is not None and st.sampling_params.min_p > 0:
                return True
        return False

    # -- per step -------------------------------------------------------------------------
    def _request(self, engine_id: str) -> RequestInfo:
        req = self.requests.get(engine_id)
        if req is None:
            st = self.runner.requests[engine_id]
            extra = dict((st.sampling_params.extra_args or {}) if st.sampling_params else {})
            rid, sample = parse_engine_id(engine_id, extra)
            req = RequestInfo(
                engine_id=engine_id,
                request_id=rid,
                prompt_index=int(extra.get("tllm_prompt_index", -1)),
                sample_index=sample,
                num_prompt_tokens=len(st.prompt_token_ids or ()),
                extra_args=extra,
            )
            self.requests[engine_id] = req
        return req

    def _begin_step(self, num_scheduled_tokens: np.ndarray) -> None:
        ib = self.runner.input_batch
        num_reqs = ib.num_reqs
        reqs = [self._request(rid) for rid in ib.req_ids[:num_reqs]]
        nsched = np.asarray(num_scheduled_tokens[:num_reqs], dtype=np.int64)
        total = int(nsched.sum())
        self.num_tokens = total
        req_idx = np.repeat(np.arange(num_reqs), nsched)
        cu = np.cumsum(nsched)
        offs = np.arange(total) - np.repeat(cu - nsched, nsched)
        computed = ib.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        positions = computed[req_idx] + offs
        n_prompt = np.array([q.num_prompt_tokens for q in reqs], dtype=np.int64)
        seen = np.array([q.max_position_seen for q in reqs], dtype=np.int64)
        rows = RowInfo(
            row=np.arange(total, dtype=np.int64),
            requests=[reqs[i] for i in req_idx],
            position=positions,
            is_decode=positions >= n_prompt[req_idx],
            recomputed=positions <= seen[req_idx],
            token_ids=self.runner.input_ids.gpu[:total],
        )
        kept = computed + nsched >= ib.num_tokens_no_spec[:num_reqs]
        self.step = StepCapture(
            step=self.runtime.step_index + 1,
            rows=rows,
            sample_token_row=cu - 1,
            sample_kept=kept,
            hidden={k: buf[:total] for k, buf in self.capture.items()},
        )
        plans = self.runtime.begin_step(rows)
        for layer, buffers in self.edits.items():
            buffers.reset()
            if plans:
                n = buffers.apply(layer, plans)
                self.runtime.counters.add(f"rows_edited.layer.{layer}", n)
                self.runtime.counters.add("rows_edited", n)

    def _finish(self, engine_ids) -> None:
        done = [self.requests.pop(e) for e in engine_ids if e in self.requests]
        if done:
            self.runtime.finish_requests(done)

    def finish_all(self) -> None:
        """Treat every known request as finished (offline runs: generate() has returned)."""
        self._finish(list(self.requests))


def install(runner: Any, raw_settings: dict[str, Any]) -> RunnerHooks:
    """Called from the plugin's ``load_model`` wrapper in the process that runs the model."""
    check_version()
    check_runner(runner)
    settings = RuntimeSettings.model_validate(raw_settings)
    # Consumer state (e.g. trainable parameters) must not be inference tensors.
    with torch.inference_mode(False):
        runtime = Runtime(settings, _model_info(runner), Registry())
    hooks = RunnerHooks(runner, runtime)
    runner._tllm_hooks = hooks
    log.info(
        "tllm: hooked %s (capture layers %s, final %s, edit layers %s, guide %s) for consumers %s",
        type(runner).__name__,
        sorted(runtime.capture_layers),
        runtime.needs_final,
        sorted(runtime.edit_layers),
        runtime.guides,
        [s.consumer.name for s in runtime.slots],
    )
    return hooks
