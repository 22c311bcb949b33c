"""``steer`` consumer: add, ablate or clamp vectors in the residual stream. Names import on
first use (PEP 562): ``tllm --help`` loads this package and imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_getattr

if TYPE_CHECKING:
    from consumers.steer.vectors import check_vector, load_vector

__all__ = ["check_vector", "load_vector"]

__getattr__ = lazy_getattr(__name__, dict.fromkeys(__all__, "consumers.steer.vectors"))
