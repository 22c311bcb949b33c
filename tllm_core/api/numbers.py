"""Number types for consumer configs and request settings: values the model's float32 can hold.

A float finite in Python may overflow float32 (``1e39``) and turn the residual stream or
logits into inf/NaN. Use :data:`FiniteF32` for every float field of a ``ConsumerConfig`` or
``RequestSettings`` (``scale: FiniteF32 = 1.0``).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

# Largest finite float32 (numpy.finfo(numpy.float32).max), written out to keep numpy out.
F32_MAX = 3.4028234663852886e38
ERROR_TYPE = "float32_range"
# float32's own shortest spelling of its maximum (rounded up: every value below it fits).
MAX_TEXT = "3.4028235e+38"
MESSAGE = f"must be finite and within float32's range [-{MAX_TEXT}, {MAX_TEXT}]"


def check_f32(value: float) -> float:
    """``value`` if it is finite and fits float32, else a pydantic error naming both."""
    if not (math.isfinite(value) and abs(value) <= F32_MAX):
        raise PydanticCustomError(ERROR_TYPE, MESSAGE)
    return value


FINITE_F32 = AfterValidator(check_f32)
FiniteF32 = Annotated[float, FINITE_F32]


def is_f32_marker(meta: Any) -> bool:
    """Whether a field's metadata item is :data:`FiniteF32`'s check (to describe the field)."""
    return isinstance(meta, AfterValidator) and meta.func is check_f32
