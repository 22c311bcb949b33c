"""Sparse feature records: the export layout (``docs/export-format.md``, format
``tllm-sae-features``) with per row ``indices`` (int32 ``[rows, top_k]``, ``-1`` unused) and
``values`` (fp16/fp32), written by the export's :class:`RecordWriter`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from consumers.export import format as fmt
from consumers.export.writer import TORCH_DTYPES, OutputLayout, RecordWriter
from tllm_core import as_selector

FORMAT_NAME = "tllm-sae-features"
FORMAT_VERSION = fmt.FORMAT_VERSION  # the export layout's (closed requests in requests.jsonl)
INDICES = "indices"
VALUES = "values"
KEYS = (INDICES, VALUES)
VALUE_DTYPES = ("float16", "float32")
# bytes of the row tensors every shard row carries (row_request, position, token_id: int64;
# is_decode: bool)
ROW_META_BYTES = 8 + 8 + 8 + 1


def tensor_name(key: str) -> str:
    """Shard tensor name of a feature column (the key itself)."""
    return key


def bytes_per_row(top_k: int, value_dtype: str) -> int:
    """Payload bytes of one sparse row (indices + values + row tensors)."""
    return top_k * (4 + TORCH_DTYPES[value_dtype].itemsize) + ROW_META_BYTES


class FeatureWriter(RecordWriter):
    """The feature record of one engine: request table + shards of sparse rows."""

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
        """``layout`` (data parallel): this engine's part folder of the output directory;
        ``describe``: the SAE's description in the manifest."""
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"feature values dtype {value_dtype!r}: allowed {VALUE_DTYPES}")
        self.top_k = top_k
        self.value_dtype = value_dtype
        self._describe = describe
        super().__init__(
            layout or OutputLayout(path, path),
            {INDICES: (top_k, torch.int32), VALUES: (top_k, TORCH_DTYPES[value_dtype])},
            shard_rows,
            overwrite,
            self._sae_fields,
            phase=as_selector(phase, "phase"),
            owner=owner,
            format_name=FORMAT_NAME,
            tensor_name=tensor_name,
        )

    def _sae_fields(self) -> dict[str, Any]:
        return {
            "hidden_size": self.top_k,  # width of each column (the reader's generic field)
            "top_k": self.top_k,
            "dtype": self.value_dtype,
            "keys": list(KEYS),
            "sae": self._describe(),
        }

    def append(
        self,
        requests: list[Any],
        positions: np.ndarray,
        tokens: np.ndarray,
        is_decode: np.ndarray,
        indices: torch.Tensor,
        values: torch.Tensor,
    ) -> int:
        """Append rows; returns the number of shards written by this call."""
        with self.lock:
            index = self.note_tokens(requests, positions, tokens)
            return self.write_rows(
                index, positions, tokens, is_decode, {INDICES: indices, VALUES: values}
            )
