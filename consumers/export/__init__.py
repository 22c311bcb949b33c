"""``export`` consumer: hidden states to sharded safetensors, and the reader for them."""

from consumers.export.reader import ExportReader, ExportRecord, read_export

__all__ = ["ExportReader", "ExportRecord", "read_export"]
