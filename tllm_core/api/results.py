"""Per-request results returned with a completion (docs/serving.md#results-with-the-completion)."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from tllm_core.api.request_settings import RESULTS_KEY, consumer_names

# What an array becomes in JSON: its dtype, shape and little-endian bytes in base64.
ARRAY_FIELDS = frozenset({"dtype", "shape", "b64"})
# The dtypes an array keeps (others are cast to float32 or int64).
KEPT_DTYPES = ("float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool")


@dataclass(frozen=True)
class PlannedRequest:
    """What the server's front end knows of a request before it runs, to bound its results."""

    prompt_tokens: int
    max_tokens: int
    hidden_size: int
    extra_args: dict[str, Any] = field(default_factory=dict)


def asked_results(extra_args: Mapping[str, Any] | None, where: str = "extra_args") -> list[str]:
    """The consumers whose results a request asks for (``tllm_results``), in order."""
    return consumer_names(extra_args, RESULTS_KEY, where)


def merge_taken(
    answers: Iterable[Any], into: dict[str, dict[str, dict[str, Any]]] | None = None
) -> dict[str, dict[str, dict[str, Any]]]:
    """Ranks' ``tllm_take_results`` answers merged: caller id -> sample -> consumer -> result."""
    out = {} if into is None else into
    for answer in answers:
        for rid, per in (answer or {}).items():
            for sample, values in per.items():
                out.setdefault(rid, {}).setdefault(str(sample), {}).update(values)
    return out


def with_missing(names: list[str], values: Mapping[str, Any], wait_s: float) -> dict[str, Any]:
    """The results of consumers ``names`` from ``values``, an error for each one missing."""
    late = f"no result within {wait_s:g} s (setting results_wait_s)"
    return {n: values[n] if n in values else {"error": f"{n}: {late}"} for n in names}


def encode_array(a: Any) -> dict[str, Any]:
    """A tensor or array as JSON: ``{"dtype", "shape", "b64"}`` (little-endian bytes)."""
    if hasattr(a, "detach"):  # a torch tensor, without importing torch here
        t = a.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()  # NumPy has no bfloat16
        a = t.numpy()
    arr = np.asarray(a)
    if arr.dtype.name not in KEPT_DTYPES:
        arr = arr.astype(np.float32 if arr.dtype.kind == "f" else np.int64)
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return {
        "dtype": arr.dtype.name,
        "shape": list(arr.shape),
        "b64": base64.b64encode(arr.tobytes()).decode("ascii"),
    }


def encode(value: Any) -> Any:
    """``value`` made JSON-able: tensors and arrays at any depth by :func:`encode_array`,
    NumPy scalars as Python numbers."""
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) or hasattr(value, "detach"):
        return encode_array(value)
    return value


# How strict JSON carries the floats it has no numbers for: json_safe writes, decode reads.
NON_FINITE = MappingProxyType({"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf})


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as the strings of :data:`NON_FINITE` (strict JSON has
    no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def decode_results(value: Any) -> Any:
    """The inverse of :func:`encode`: each encoded array becomes a writable NumPy array, and
    the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` the floats they stand for."""
    if isinstance(value, str) and value in NON_FINITE:
        return NON_FINITE[value]
    if isinstance(value, Mapping):
        if set(value) == ARRAY_FIELDS:
            raw = base64.b64decode(value["b64"])
            dtype = np.dtype(value["dtype"]).newbyteorder("<")
            return np.frombuffer(raw, dtype=dtype).reshape(value["shape"]).copy()
        return {k: decode_results(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_results(v) for v in value]
    return value


def json_bytes(value: Any) -> int:
    """The size of an encoded value as compact JSON (what the server sends)."""
    return len(json.dumps(value, separators=(",", ":"), allow_nan=True))


def array_json_bytes(num_values: int, itemsize: int) -> int:
    """A bound of :func:`encode_array`'s JSON size for ``num_values`` items of ``itemsize``."""
    return 4 * ((num_values * itemsize + 2) // 3) + 96


class RequestRows:
    """Per-request columns (arrays or tensors) a consumer adds step by step for the results of
    the requests that ask; past ``limit`` bytes (base64) an error, the rows let go at once."""

    def __init__(self, limit: int, what: str):
        self.limit = int(limit)
        self.what = what
        # engine id -> [its columns (None: past the limit, _LOST: dropped), bytes added]
        self._kept: dict[str, list[Any]] = {}

    def add(self, engine_id: str, **columns: Any) -> None:
        kept = self._kept.setdefault(engine_id, [{}, 0])
        if kept[0] is _LOST:
            return
        kept[1] += sum(_nbytes(v) for v in columns.values())
        if kept[0] is not None:
            for k, v in columns.items():
                kept[0].setdefault(k, []).append(v)
            if kept[1] * 4 // 3 > self.limit:
                kept[0] = None

    def lose(self, engine_id: str) -> None:
        """Rows of the request were dropped (a full queue): its result says so."""
        self._kept[engine_id] = [_LOST, 0]

    def take(self, engine_id: str, empty: dict[str, Any]) -> dict[str, Any]:
        """The request's columns (``empty`` when it kept no row), or an error; forgotten."""
        if engine_id not in self._kept:
            return dict(empty)
        columns, size = self._kept.pop(engine_id)
        if columns is _LOST:
            return {"error": rows_dropped(self.what)}
        if columns is None:
            return {
                "error": f"{self.what}: this request's rows hold more than {size} bytes, past "
                f"this engine's limit of {self.limit} (setting max_result_bytes); ask for "
                "fewer rows (a narrower window, fewer layers or tokens)",
                "limit": self.limit,
            }
        return {k: _concat(parts) for k, parts in columns.items()}


_LOST = object()


def rows_dropped(consumer: str) -> str:
    """The result of a request some of whose rows ``consumer`` never saw (a dropped bundle)."""
    return (
        f'{consumer}: rows of this request were dropped (its queue was full with overflow "drop", '
        "or it still lagged when the run closed); its result would have holes"
    )


def _nbytes(v: Any) -> int:
    return int(v.numel() * v.element_size()) if hasattr(v, "element_size") else int(v.nbytes)


def _concat(parts: list[Any]) -> Any:
    if hasattr(parts[0], "detach"):
        import torch

        return torch.cat(parts)
    return np.concatenate(parts)
