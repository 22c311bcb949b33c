"""Sparse feature records on disk: the export layout with ``indices``/``values`` columns.

Same directory layout as ``export`` (``manifest.json`` + atomic ``shard-NNNNN.safetensors``,
see ``docs/export-format.md``), written by the same :class:`ShardWriter`. A shard holds
per row ``indices`` (int32 ``[rows, top_k]``, ``-1`` in unused slots), ``values``
(fp16 or fp32 ``[rows, top_k]``) and the export's row tensors (``row_request``,
``position``, ``token_id``, ``is_decode``). The manifest's ``format`` is
``tllm-sae-features``; it carries the export's request table plus the SAE's description.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from consumers.export import format as fmt
from consumers.export.requests import RequestTable
from consumers.export.tokens import completeness
from consumers.export.writer import TORCH_DTYPES, OutputLayout, ShardWriter
from tllm_core import as_selector, request_runs

FORMAT_NAME = "tllm-sae-features"
FORMAT_VERSION = 2  # as the export format's (closed requests in requests.jsonl)
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
    return top_k * (4 + torch.empty((), dtype=TORCH_DTYPES[value_dtype]).element_size()) + (
        ROW_META_BYTES
    )


class FeatureWriter:
    """Request table + shard writer for sparse feature rows (thread-safe)."""

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
        ``phase``: the rows recorded (a selected prompt position without a row is missing);
        ``owner``: the consumer whose per-request windows narrow them."""
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"feature values dtype {value_dtype!r}: allowed {VALUE_DTYPES}")
        self.path = path
        self.top_k = top_k
        self.value_dtype = value_dtype
        self._describe = describe
        self.layout = layout
        self._lock = threading.Lock()
        self.used = False
        self.closed = False  # closed after the last data
        self.complete = False  # ... and nothing was lost (see completeness)
        self.shards = ShardWriter(
            path,
            list(KEYS),
            top_k,
            value_dtype,
            shard_rows,
            overwrite,
            self._manifest,
            columns={INDICES: (top_k, torch.int32), VALUES: (top_k, TORCH_DTYPES[value_dtype])},
            tensor_name=tensor_name,
            format_name=FORMAT_NAME,
            before_first_write=None if layout is None else layout.clean_root,
        )
        self.table = RequestTable(
            path,
            self.shards.prepare,
            lambda: self.shards.error,
            as_selector(phase, "phase"),
            owner,
        )

    def note_tokens(self, requests: list[Any], positions: np.ndarray, tokens: np.ndarray) -> None:
        """Record token ids at positions (rows of one request are contiguous)."""
        with self._lock:
            self._note(requests, positions, tokens)

    def _note(self, requests: list[Any], positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        n = len(requests)
        index = [0] * n
        pos, tok = positions.tolist(), tokens.tolist()  # Python ints: cheap per-row access
        for info, start, stop in request_runs(requests):
            req = self.table.get(info)
            if stop - start == 1:  # a decode row
                req.put_one(pos[start], tok[start])
                index[start] = req.index
            else:
                req.put(positions[start:stop], tokens[start:stop])
                index[start:stop] = [req.index] * (stop - start)
        return np.asarray(index, np.int64)

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
        with self._lock:
            self.used = True
            self.closed = False
            row_request = self._note(requests, positions, tokens)
            meta = {
                fmt.ROW_REQUEST: row_request,
                fmt.POSITION: positions,
                fmt.TOKEN_ID: tokens,
                fmt.IS_DECODE: is_decode,
            }
            before = len(self.shards.shards)
            self.shards.append({INDICES: indices, VALUES: values}, meta)
            return len(self.shards.shards) - before

    def finished(self, request: Any) -> None:
        """A request's finish notice (``request.cut_short``: it did not run to its end)."""
        with self._lock:
            self.table.finish(request)

    def dropped(self, requests: list[Any]) -> None:
        """A bundle holding rows or tokens of ``requests`` was dropped."""
        with self._lock:
            self.table.drop(requests)

    def _manifest(self) -> dict[str, Any]:
        table = self.table.manifest_fields()
        self.complete = completeness(self.closed, table["losses"]) and self.shards.error is None
        w = self.shards
        part = {}
        if self.layout is not None and self.layout.dp_size > 1:
            part = {"data_parallel": {"rank": self.layout.dp_rank, "size": self.layout.dp_size}}
        return {
            **part,
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "complete": self.complete,
            "hidden_size": self.top_k,  # width of each column (the reader's generic field)
            "top_k": self.top_k,
            "dtype": self.value_dtype,
            "keys": list(KEYS),
            "sae": self._describe(),
            "shard_rows": w.shard_rows,
            "num_rows": w.rows_written,
            "shards": [dict(s) for s in w.shards],
            **table,
        }

    def close(self) -> int:
        """Write buffered rows and the final manifest (nothing when never used)."""
        with self._lock:
            if not self.used:
                return 0
            before = len(self.shards.shards)
            self.closed = True
            try:
                if self.shards.buffered:
                    self.shards.write_shard()
                else:
                    self.shards.write_manifest()
            finally:  # a failed write (ExportWriteError) still lets go of the files
                self.shards.release()
                self.table.release()
            return len(self.shards.shards) - before
