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
    """The features recorded for one request: row ``j`` of ``indices`` / ``values``
    (``[rows, top_k]``, by value, ``-1``/0 in unused slots) belongs to ``positions[j]``."""

    indices: torch.Tensor  # int32 [rows, top_k]
    values: torch.Tensor  # fp16/fp32 [rows, top_k]


class FeatureReader(ExportReader):
    """A feature directory: manifest (``format: tllm-sae-features``), requests, shards."""

    format_name = fw.FORMAT_NAME

    def tensor_name(self, key: str) -> str:
        return fw.tensor_name(key)

    @property
    def top_k(self) -> int:
        return int(self.manifest["top_k"])

    @property
    def sae(self) -> dict[str, Any]:
        """The SAE's description stored by the writer (path, site, architecture, sizes)."""
        return dict(self.manifest.get("sae", {}))

    def _no_rows(self, key: str) -> torch.Tensor:
        dtype = torch.int32 if key == fw.INDICES else getattr(torch, self.dtype)
        return torch.zeros(0, self.top_k, dtype=dtype)

    def _make(self, fields: dict[str, Any], pos: Any, dec: Any, data: dict) -> FeatureRecord:  # type: ignore[override]
        idx, val = data[fw.INDICES], data[fw.VALUES]
        return FeatureRecord(**fields, positions=pos, is_decode=dec, indices=idx, values=val)


def read_features(path: str | os.PathLike, verify: bool = False) -> Iterator[FeatureRecord]:
    """Yield one :class:`FeatureRecord` per (request, sample) of the feature directory
    ``path``, reading one shard at a time (the parts of a data-parallel run, ``dp{rank}``,
    part by part). ``verify=True`` checks shard sha256 sums."""
    return iter(open_export(path, verify=verify, reader=FeatureReader))
