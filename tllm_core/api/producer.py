"""The producer plugin interface: the engine taps a port needs, read into its step tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from tllm_core.api.architectures import STEP_SITES, identifier
from tllm_core.api.ports import ReadPort
from tllm_core.api.step import StepCapture


@dataclass(frozen=True)
class TapRequest:
    """A tensor the bridge captures each step: ``site`` at decoder layer ``layer`` (editable),
    or a per-step site (:data:`STEP_SITES`: no layer, read-only)."""

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
    served) and implement :meth:`taps` (docs/ports.md, "Add a port")."""

    name: ClassVar[str] = ""
    ports: ClassVar[tuple[type[ReadPort], ...]] = ()

    def taps(self, port: ReadPort) -> list[TapRequest]:
        """The taps ``port`` (already resolved to absolute layers) needs."""
        raise NotImplementedError

    def read(self, port: ReadPort, step: StepCapture) -> torch.Tensor:
        """The port's data for every token row (``[T, ...]``) or sampling row (``[S, ...]``)."""
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
    """A producer of ``LayerPort`` s: one tap, site ``port.prefix`` at the port's layer."""

    def taps(self, port: ReadPort) -> list[TapRequest]:
        return [TapRequest(port.prefix, int(port.layer))]  # type: ignore[attr-defined]
