"""Read sparse feature records written by the ``sae`` consumer (one per request/sample)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from consumers.export.reader import ExportReader, RequestRecord, open_export
from consumers.sae import features_writer as fw


@dataclass
class FeatureRecord(RequestRecord):
    """The features recorded for one request (one sample of one prompt).

    ``token_ids``: the full sequence (prompt, then generated tokens). Row ``j`` of
    ``indices`` / ``values`` (``[rows, top_k]``, sorted by value, index ``-1`` and value 0 in
    unused slots) belongs to ``positions[j]``: the SAE's features of the activation after
    feeding ``token_ids[positions[j]]``.
    """

    indices: torch.Tensor  # int32 [rows, top_k]
    values: torch.Tensor  # fp16/fp32 [rows, top_k]
    finished: bool = True
    engine_id: str = ""
    data_parallel_rank: int = 0  # the engine that served the request (data parallel)


class FeatureReader(ExportReader):
    """A feature directory: manifest (``format: tllm-sae-features``), requests, shards."""

    format_name = fw.FORMAT_NAME
    format_version = fw.FORMAT_VERSION

    def tensor_name(self, key: str) -> str:
        return fw.tensor_name(key)

    @property
    def top_k(self) -> int:
        return int(self.manifest["top_k"])

    @property
    def sae(self) -> dict[str, Any]:
        """The SAE's description stored by the writer (path, site, architecture, sizes)."""
        return dict(self.manifest.get("sae", {}))

    def _record(self, r: int, pieces: list[dict[str, torch.Tensor]]) -> FeatureRecord:  # type: ignore[override]
        meta = self.requests[r]
        k = self.top_k
        if pieces:
            pos, dec, data = self._merge_rows(pieces, (fw.INDICES, fw.VALUES))
            idx, val = data[fw.INDICES], data[fw.VALUES]
        else:
            pos = torch.zeros(0, dtype=torch.int64)
            dec = torch.zeros(0, dtype=torch.bool)
            idx = torch.zeros(0, k, dtype=torch.int32)
            val = torch.zeros(0, k, dtype=getattr(torch, self.dtype))
        return FeatureRecord(
            **self._request_fields(meta), positions=pos, is_decode=dec, indices=idx, values=val
        )


def read_features(path: str | os.PathLike, verify: bool = False) -> Iterator[FeatureRecord]:
    """Yield one :class:`FeatureRecord` per (request, sample) of the feature directory
    ``path``, reading one shard at a time (the parts of a data-parallel run, ``dp{rank}``,
    part by part). ``verify=True`` checks shard sha256 sums."""
    return iter(open_export(path, verify=verify, reader=FeatureReader))
