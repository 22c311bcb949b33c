"""ESamp consumer: predict f(h_1) in the sampler and mix it into the logits, then train the
group's distiller on the step's rows (strictly fresh); the jobs' modules composed."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from algorithms.esamp import report
from algorithms.esamp.config import MAX_BETA, ESampConfig
from algorithms.esamp.cuda import CudaGroupedDistiller
from algorithms.esamp.factory import distiller_for
from algorithms.esamp.guide_step import NOISE_ABLATIONS, CudaGuide, Diagnostics, HostGuide
from algorithms.esamp.lifecycle import Groups, Shared
from algorithms.esamp.memory_plan import check_plan, default_slots, device_total_bytes, plan_memory
from algorithms.esamp.training import LossBook, ReturnedErrors, Trainer
from tllm_core import (
    FINAL,
    Bundle,
    Consumer,
    ConsumerContext,
    Delivery,
    FiniteF32,
    GuideView,
    HiddenStates,
    Phase,
    PlannedRequest,
    RequestInfo,
    RequestSettings,
    SamplerGuide,
    layer_key,
)

# Every counter ESamp sets, registered at 0 at construction.
COUNTER_NAMES = tuple(
    """
    decode_steps optimizer_steps rows_trained rows_visited rows_guided candidates_guided
    candidates_over_cap loss_first loss_last loss_mean groups_created groups_freed groups_alive
    rows_skipped rows_skipped_prefill rows_skipped_greedy rows_skipped_cap rows_skipped_mixed
    train_rows_skipped_cap train_rows_skipped_recomputed train_rows_skipped_mixed
    train_rows_skipped_frozen nonfinite_losses_skipped staleness_max memory_bytes_per_group
    memory_plan_bytes latent_fallback_rows finished_unseen graph_failures eager_updates
    updates_reusing_prediction warm_start_groups warm_start_rows warm_start_steps fit_rows
    fit_scale_mean diag_rows diag_top_changed rows_returned
    """.split()
)


# Config fields the memory plan takes as they are.
_PLAN_FIELDS = ("intermediate_size", "num_blocks", "optimizer_stats", "mode", "diagnostics")


class ESampRequest(RequestSettings):
    """Per-request settings: ``tllm_esamp_beta``."""

    beta: FiniteF32 | None = Field(
        None,
        ge=0,
        le=MAX_BETA,
        description="ESamp's beta for this request (0: no guidance); default: the config's beta",
    )


class ESampConsumer(Consumer):
    name = "esamp"
    proof_counter = "rows_guided"
    description = "Exploratory Sampling: an online Latent Distiller steers sampling away from familiar continuations."
    Config = ESampConfig
    Request = ESampRequest
    delivery = Delivery.END_OF_STEP

    config: ESampConfig  # the registry builds it from the spec (validated there, once)

    def __init__(
        self, config: ESampConfig, context: ConsumerContext, cuda_path: bool | None = None
    ):
        """``cuda_path``: the CUDA code path or not (default: where the distiller is CUDA)."""
        super().__init__(config, context)
        model = context.model
        self._src = context.resolve_layer(config.source_layer)
        tgt = config.target_layer
        self._tgt = FINAL if tgt == FINAL else context.resolve_layer(tgt)
        if self._tgt == self._src:
            raise ValueError(f"source_layer and target_layer both resolve to layer {self._src}")
        on_gpu = model.device.type == "cuda"
        slots = config.max_groups or config.cuda_capacity
        slots = slots or default_slots(config.cuda_rows_per_step, config.cuda_graph_max_rows)
        self.memory_plan = plan_memory(
            model.hidden_size,
            model.vocab_size,
            slots=slots,
            graph_rows=config.cuda_graph_max_rows,
            rows_per_step=config.cuda_rows_per_step,
            max_candidates=config.cuda_max_candidates,
            moment_bytes=2 if config.cuda_adam_moments == "bfloat16" and on_gpu else 4,
            dtype=model.dtype,
            noise=config.ablation in NOISE_ABLATIONS,
            **{name: getattr(config, name) for name in _PLAN_FIELDS},
        )
        # Refused before anything is allocated, not later for lack of KV cache.
        self._device_bytes = device_total_bytes(model.device)
        if self._device_bytes is not None:
            check_plan(self.memory_plan, self._device_bytes, config.max_memory_fraction)
        self.distiller = distiller_for(config, model.hidden_size, model.device, slots)
        on_cuda = isinstance(self.distiller, CudaGroupedDistiller)
        on_cuda = on_cuda if cuda_path is None else cuda_path
        src_key, tgt_key = layer_key(self._src), layer_key(self._tgt)
        self.shared = Shared(config, self.distiller, self.counters, src_key, tgt_key, on_cuda)
        self.groups = Groups(self.distiller, self.counters, config.scope, config.max_groups)
        self.diagnostics = Diagnostics(self.counters) if config.diagnostics else None
        guide = CudaGuide if on_cuda else HostGuide
        self.guide_step = guide(self.shared, self.groups, model, self.diagnostics, self._beta)
        self.losses = LossBook(self.counters)
        self.returned = ReturnedErrors(self.name, context.max_result_bytes, self.counters)
        self.trainer = Trainer(
            self.shared, self.groups, self.losses, self.guide_step.read_guided, self.returned
        )
        for name in COUNTER_NAMES:
            self.counters.add(name, 0)
        self.counters.set("memory_bytes_per_group", self.distiller.memory_bytes_per_group())
        self.counters.set("memory_plan_bytes", self.memory_plan.total_bytes)
        self.counters.set("graph_failures", self.distiller.graph_failures)

    def reads(self) -> list:
        # Warm start trains on the prompt's prefill rows too.
        phase = Phase.ALL if self.config.warm_start_steps > 0 else Phase.DECODE
        return [HiddenStates(self._src, phase), HiddenStates(self._tgt, phase)]

    def writes(self) -> list:
        # Even for beta = 0: the path runs and must leave sampling bit-identical (tested).
        return [SamplerGuide()]

    def _beta(self, req: RequestInfo) -> float:
        """The request's beta: its ``tllm_esamp_beta`` if given, else the config's."""
        given = req.settings(self).beta  # validated and cached per request
        return self.config.beta if given is None else given

    def guide(self, view: GuideView) -> None:
        self.guide_step(view)

    def on_bundle(self, bundle: Bundle) -> None:
        self.trainer.on_bundle(bundle)

    def on_request_finished(self, request: RequestInfo) -> None:
        self.groups.finish(request)
        if self.groups.freed:  # freed now, or earlier for a new group at the cap
            for serial in self.groups.freed:
                self.losses.freed(serial)
            self.groups.freed.clear()
            self.trainer.prune_losses()

    def request_result(self, request: RequestInfo) -> dict[str, Any]:
        """This request's trained decode rows: ``positions`` and ``prediction_error``."""
        if self.returned.waits_for(request.engine_id):
            self.trainer.flush()
        return self.returned.take(request)

    @classmethod
    def result_bytes(cls, config: ESampConfig, request: PlannedRequest) -> int:
        return ReturnedErrors.result_bytes(request.max_tokens)

    def result(self) -> Any:
        self.trainer.flush()
        out = {
            **self.losses.summary(),
            "counters": self.counters.snapshot(),
            "memory_plan": {
                **self.memory_plan.as_dict(),
                "max_memory_fraction": self.config.max_memory_fraction,
                # None: not checked (CPU: the state grows with live groups instead).
                "device_bytes": self._device_bytes,
            },
        }
        if self.diagnostics is not None:
            out["diagnostics"] = self.diagnostics.as_result()
        return out

    def close(self) -> None:
        self.trainer.flush()
        self.distiller.close()

    # -- what the command prints and the report shows (algorithms/esamp/report.py) ---------
    summary = staticmethod(report.summary)
    summary_warnings = staticmethod(report.warnings)
    report_plots = staticmethod(report.plots)
