"""What every runner adapter shares: the reads that do not depend on the runner's generation
(model, config, decoder layers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from tllm_core.api.architectures import Architectures
from tllm_core.api.consumer import ModelInfo
from tllm_core.api.norms import norm_eps, rmsnorm_gain
from tllm_core.vllm_bridge.errors import UnsupportedEngineError
from tllm_core.vllm_bridge.sites import find_layers

# Tensor parallel with guidance: every rank continues from the same sampled tokens.
SyncSampled = Callable[[torch.Tensor], None] | None

# Read once the weights are loaded (``runner.model`` exists only then).
LOADED_MODEL_ATTRS = ("model.compute_logits",)
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


class RunnerAdapterBase:
    """Static facts of a hooked runner. Subclasses add ``install`` and ``request``."""

    #: the runner generation this adapter hooks ("V1", "V2"), for logs and errors
    generation: ClassVar[str] = "?"
    #: every runner attribute (dotted path) the adapter reads or wraps; checked before the
    #: weights load (``worker_setup.check_runner``)
    required_attrs: ClassVar[tuple[str, ...]] = COMMON_ATTRS

    def __init__(self, runner: Any):
        self.runner = runner

    def request(self, engine_id: str) -> tuple[dict[str, Any], int, tuple[int, ...] | None]:
        """``(extra_args, prompt length, prompt token ids)`` of a scheduled request."""
        raise NotImplementedError

    def install(self, events: Any, guides: bool, sync_sampled: SyncSampled = None) -> None:
        """Wrap the runner (instance attributes only) so that each step reports ``events``
        (``hooks.RunnerHooks``); the guide is wired only when ``guides``; ``sync_sampled``
        runs after every sampling."""
        raise NotImplementedError

    @property
    def max_num_tokens(self) -> int:
        return int(self.runner.max_num_tokens)

    @property
    def parallel_config(self) -> Any:
        return self.runner.vllm_config.parallel_config

    @property
    def async_scheduling(self) -> bool:
        """Whether vLLM schedules step k+1 before step k's sampled tokens are known."""
        sched = getattr(self.runner.vllm_config, "scheduler_config", None)
        return bool(getattr(sched, "async_scheduling", False))

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
            lm_head, full = _local_head(head, lp, vocab)
            weight = full if plain else None
        elif plain:
            weight = head.weight[:vocab]
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
