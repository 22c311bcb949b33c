"""``steer`` consumer: add or ablate fixed vectors in the residual stream.

The names are imported on first use (PEP 562): ``tllm --help`` loads this package for the
``tllm steer`` command and imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_getattr

if TYPE_CHECKING:
    from consumers.steer.vectors import check_vector, load_vector

__all__ = ["check_vector", "load_vector"]

__getattr__ = lazy_getattr(__name__, dict.fromkeys(__all__, "consumers.steer.vectors"))
