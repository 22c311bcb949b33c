"""``export`` consumer: hidden states to sharded safetensors, and the reader for them. Names
import on first use (PEP 562): ``tllm --help`` loads this package and imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tllm_core.lazy import lazy_exports

if TYPE_CHECKING:
    from consumers.export.reader import (
        DataParallelExport,
        ExportReader,
        ExportRecord,
        IncompleteExportWarning,
        open_export,
        read_export,
    )

__all__, __getattr__ = lazy_exports(__name__, __file__)
