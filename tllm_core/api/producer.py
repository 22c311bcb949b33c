"""The producer plugin interface: which engine taps a port needs and how to read them into one
tensor for the whole step. Producers register through the ``tllm_producers`` hook."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from tllm_core.api.architectures import STEP_SITES, identifier
from tllm_core.api.ports import ReadPort
from tllm_core.api.step import StepCapture


@dataclass(frozen=True)
class TapRequest:
    """One tensor a producer needs the engine bridge to capture each step: a site of the
    registered architectures at decoder layer ``layer`` (editable), or a per-step site
    (:data:`STEP_SITES`, no layer, read-only). Only its form is checked here."""

    site: str
    layer: int | None = None

    def __post_init__(self) -> None:
        identifier(self.site, "tap site")
        if self.site in STEP_SITES:
            if self.layer is not None:
                raise ValueError(f"tap site {self.site!r} takes no layer")
        elif self.layer is None or self.layer < 0:
            raise ValueError(f"tap site {self.site!r} needs an absolute layer index")

    @property
    def key(self) -> str:
        return self.site if self.layer is None else f"{self.site}.{self.layer}"

    @property
    def editable(self) -> bool:
        return self.layer is not None


class Producer:
    """Base class of producers: subclasses set ``name`` and ``ports`` (the read-port classes
    they serve) and implement :meth:`taps`; override :meth:`read` when a port's data is not
    simply its first tap."""

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
        """The tap whose tensor an :class:`~tllm_core.api.ports.Edit` of ``port`` changes."""
        tap = self.taps(port)[0]
        if not tap.editable:
            raise ValueError(
                f"{type(port).__name__} ({port.key}) cannot be edited: its tap {tap.site!r} "
                f"is read-only (per-step sites {', '.join(STEP_SITES)} cannot be edited)"
            )
        return tap


class LayerProducer(Producer):
    """A producer of :class:`~tllm_core.api.ports.LayerPort` s whose tap site is the port's
    ``prefix``: one tap at the port's layer (``attn.{i}`` reads site ``attn`` at layer ``i``).
    Subclasses set ``name`` and ``ports``."""

    def taps(self, port: ReadPort) -> list[TapRequest]:
        return [TapRequest(port.prefix, int(port.layer))]  # type: ignore[attr-defined]
