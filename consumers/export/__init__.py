"""``export`` consumer: hidden states to sharded safetensors, and the reader for them."""

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
