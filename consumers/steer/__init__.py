"""``steer`` consumer: add, ablate or clamp vectors in the residual stream. Names import on
first use (PEP 562): ``tllm --help`` loads this package and imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_exports

if TYPE_CHECKING:
    from consumers.steer.vectors import check_vector, load_vector

__all__, __getattr__ = lazy_exports(__name__, __file__)
