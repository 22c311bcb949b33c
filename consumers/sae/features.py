"""Sparse feature records of the ``sae`` consumer: the export layout with per row ``indices``
(int32 ``[rows, top_k]``, ``-1`` unused) and ``values`` (fp16/fp32), for writer and reader."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from consumers.export.reader import ExportReader, RequestRecord, open_export
from consumers.export.writer import OutputLayout, RecordWriter
from tllm_core import as_selector

FORMAT_NAME = "tllm-sae-features"
INDICES = "indices"
VALUES = "values"
KEYS = (INDICES, VALUES)
ROW_META_BYTES = 8 + 8 + 8 + 1  # row_request, position, token_id: int64; is_decode: bool


def bytes_per_row(top_k: int, value_dtype: str) -> int:
    """Payload bytes of one sparse row (indices + values + row tensors)."""
    return top_k * (4 + getattr(torch, value_dtype).itemsize) + ROW_META_BYTES


class FeatureWriter(RecordWriter):
    def __init__(
        self,
        path: str,
        top_k: int,
        value_dtype: str,
        shard_rows: int,
        overwrite: bool,
        describe: Callable[[], dict[str, Any]],
        layout: OutputLayout | None = None,
        phase: Any = "all",
        owner: Any = None,
    ):
        fields = {"hidden_size": top_k, "top_k": top_k, "dtype": value_dtype, "keys": list(KEYS)}
        super().__init__(
            layout or OutputLayout(path, path, overwrite=overwrite),
            {INDICES: (top_k, torch.int32), VALUES: (top_k, getattr(torch, value_dtype))},
            shard_rows,
            lambda: {**fields, "sae": describe()},
            phase=as_selector(phase, "phase"),
            owner=owner,
            format_name=FORMAT_NAME,
            tensor_name=str,  # a column's tensor is named by its key
        )

    def append(
        self,
        requests: list[Any],
        positions: np.ndarray,
        tokens: np.ndarray,
        is_decode: np.ndarray,
        indices: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        with self.lock:
            index = self.note_tokens(requests, positions, tokens)
            self.write_rows(index, positions, tokens, is_decode, {INDICES: indices, VALUES: values})


@dataclass
class FeatureRecord(RequestRecord):
    """The features recorded for one request: row ``j`` of ``indices`` / ``values``
    (``[rows, top_k]``, by value, ``-1``/0 in unused slots) belongs to ``positions[j]``."""

    indices: torch.Tensor  # int32 [rows, top_k]
    values: torch.Tensor  # fp16/fp32 [rows, top_k]


class FeatureReader(ExportReader):
    """A feature directory: manifest (``format: tllm-sae-features``), requests, shards."""

    format_name = FORMAT_NAME
    tensor_name = staticmethod(str)  # a feature column's tensor is named by its key

    @property
    def top_k(self) -> int:
        return int(self.manifest["top_k"])

    @property
    def sae(self) -> dict[str, Any]:
        return dict(self.manifest.get("sae", {}))

    def _no_rows(self, key: str) -> torch.Tensor:
        dtype = torch.int32 if key == INDICES else getattr(torch, self.dtype)
        return torch.zeros(0, self.top_k, dtype=dtype)

    def _make(self, fields: dict[str, Any], pos: Any, dec: Any, data: dict) -> FeatureRecord:  # type: ignore[override]
        idx, val = data[INDICES], data[VALUES]
        return FeatureRecord(**fields, positions=pos, is_decode=dec, indices=idx, values=val)


def read_features(path: str | os.PathLike, verify: bool = False) -> Iterator[FeatureRecord]:
    """:func:`~consumers.export.read_export` for a feature directory."""
    return iter(open_export(path, verify=verify, reader=FeatureReader))
