"""The producer plugin interface: which engine taps a port needs, and how to read them.

A producer serves one or more read-port types. For each port a consumer declares, the
runtime asks the producer serving it for the :class:`TapRequest` s the engine bridge must
install, and after the step it asks the producer to :meth:`~Producer.read` the step's
tapped tensors into the port's data. Row selection (phase, per-request consumers) is the
runtime's job; a producer only turns taps into one tensor for the whole step.

Producers register through the ``tllm_producers`` hook, built-ins included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from tllm_core.ports import ReadPort
from tllm_core.step import StepCapture

# Tap sites the vLLM bridge knows (tllm_core/vllm_bridge/sites.py and its CONTRACT.md):
#   per decoder layer (``layer`` set), one row per token, editable:
#     "residual"  residual stream after the layer (h + residual)
#     "attn"      the layer's self-attention block output (after o_proj, before the add)
#     "mlp"       the layer's MLP block output (before the add)
#     "router"    the layer's MoE router logits [rows, experts] (fp32, before softmax/top-k);
#                 StepCapture.tap_info says how vLLM's router picks experts from them
#   per step (``layer`` None):
#     "final"     final hidden state (after the final norm), one row per token
#     "logits"    raw logits, one row per sampling row
#     "sampled"   sampled token ids, one per sampling row
LAYER_SITES = ("residual", "attn", "mlp", "router")
STEP_SITES = ("final", "logits", "sampled")


@dataclass(frozen=True)
class TapRequest:
    """One tensor a producer needs the engine bridge to capture each step."""

    site: str
    layer: int | None = None

    def __post_init__(self) -> None:
        if self.site in LAYER_SITES:
            if self.layer is None or self.layer < 0:
                raise ValueError(f"tap site {self.site!r} needs an absolute layer index")
        elif self.site in STEP_SITES:
            if self.layer is not None:
                raise ValueError(f"tap site {self.site!r} takes no layer")
        else:
            raise ValueError(
                f"unknown tap site {self.site!r}; the bridge knows {LAYER_SITES + STEP_SITES}"
            )

    @property
    def key(self) -> str:
        return self.site if self.layer is None else f"{self.site}.{self.layer}"

    @property
    def editable(self) -> bool:
        return self.site in LAYER_SITES


class Producer:
    """Base class of producers (built-in or third-party).

    Subclasses set ``name`` and ``ports`` (the read-port classes they serve) and implement
    :meth:`taps`; override :meth:`read` when a port's data is not simply its first tap.
    """

    name: ClassVar[str] = ""
    ports: ClassVar[tuple[type[ReadPort], ...]] = ()

    def taps(self, port: ReadPort) -> list[TapRequest]:
        """The taps ``port`` (already resolved to absolute layers) needs."""
        raise NotImplementedError

    def read(self, port: ReadPort, step: StepCapture) -> torch.Tensor:
        """The port's data for every row of the step: ``[T, ...]`` for token ports (all
        token rows), ``[S, ...]`` for sample ports (all sampling rows)."""
        return step.tensor(self.taps(port)[0].key)

    def edit_tap(self, port: ReadPort) -> TapRequest:
        """The tap whose tensor an :class:`~tllm_core.ports.Edit` of ``port`` changes."""
        tap = self.taps(port)[0]
        if not tap.editable:
            raise ValueError(
                f"{type(port).__name__} ({port.key}) cannot be edited: its tap {tap.site!r} "
                f"is read-only (editable sites: {', '.join(LAYER_SITES)})"
            )
        return tap
