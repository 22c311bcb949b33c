"""``export`` consumer: hidden states to sharded safetensors, and the reader for them. Names
import on first use (PEP 562): ``tllm --help`` loads this package and imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_getattr

if TYPE_CHECKING:
    from consumers.export.reader import (
        DataParallelExport,
        ExportReader,
        ExportRecord,
        IncompleteExportWarning,
        open_export,
        read_export,
    )

__all__ = [
    "DataParallelExport",
    "ExportReader",
    "ExportRecord",
    "IncompleteExportWarning",
    "open_export",
    "read_export",
]

__getattr__ = lazy_getattr(__name__, dict.fromkeys(__all__, "consumers.export.reader"))
