"""``export``: captured hidden states and token ids to sharded safetensors, on the background
thread; layout: ``docs/export-format.md``; reader: :func:`consumers.export.read_export`."""

from __future__ import annotations

import threading
import time
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, field_validator, model_validator

from consumers.export import report
from consumers.export.format import Folder
from consumers.export.requests import rows_to_write, sampled_tokens
from consumers.export.writer import RecordWriter, output_layout
from tllm_core import (
    Bundle,
    CaptureWindow,
    Consumer,
    ConsumerConfig,
    ConsumerContext,
    Delivery,
    Phase,
    PlannedRequest,
    ReadPort,
    RequestInfo,
    RequestRows,
    RequestSettings,
    SampledTokens,
    TokenPort,
    WindowSetting,
    array_json_bytes,
    as_selector,
    parse_port_name,
    window_rows,
)

DEFAULT_SHARD_BYTES = 256 * 1024 * 1024


class ExportConfig(ConsumerConfig):
    out: Folder | None = Field(
        ...,
        description="Output directory (created on the first write; must be new or empty "
        "unless overwrite=true); null: write no files, only return each asking request's rows "
        "with its completion (tllm_results=export).",
    )
    layers: list[int | str] = Field(
        default_factory=lambda: [-1, "final"],
        min_length=1,
        description="Token ports to export: decoder-layer indices (residual stream after the "
        "layer; negative counts from the end), 'final' (after the final norm), 'attn.{i}' "
        "(self-attention output of layer i) or 'mlp.{i}' (MLP output of layer i).",
    )
    phase: CaptureWindow = Field(
        "all",
        description="Rows to export: 'prefill' (prompt rows), 'decode' (generated-token rows), "
        "'all', or a capture window such as 'last_prompt', 'prompt[-4:]', 'generated[0:16]', "
        "'all[::4]' (docs/ports.md#capture-windows).",
    )

    shard_rows: int | None = Field(
        None, ge=1, description="Rows per shard (at most one shard is buffered in memory)."
    )
    shard_bytes: int | None = Field(
        None,
        ge=1,
        description="Target hidden-state bytes per shard, used when shard_rows is not given "
        f"(default {DEFAULT_SHARD_BYTES // (1024 * 1024)} MiB).",
    )
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32", description="Storage dtype of the hidden states."
    )
    overwrite: bool = Field(
        False,
        description="Allow a non-empty 'out': its export files (manifest, shards, .tmp) are "
        "removed at the first write; other files are left alone.",
    )

    @field_validator("layers")
    @classmethod
    def _port_names(cls, v: list[int | str]) -> list[int | str]:
        # Syntax only: which prefixes exist is known where the registry is (the consumer).
        for item in v:
            parse_port_name(item, what="layers entry")
        return v

    @model_validator(mode="after")
    def _one_shard_size(self) -> ExportConfig:
        if self.shard_rows is not None and self.shard_bytes is not None:
            raise ValueError(
                f"give shard_rows ({self.shard_rows}) or shard_bytes ({self.shard_bytes}), not both"
            )
        return self


class ExportRequest(RequestSettings):
    window: WindowSetting = Field(
        None, description="Rows of this request to export, within the config's 'phase'."
    )


class ExportConsumer(Consumer):
    name = "export"
    proof_counter = "rows_exported"
    description = (
        "Export hidden states (chosen layers and/or final) with token ids and positions to "
        "sharded safetensors files plus a JSON manifest."
    )
    Config = ExportConfig
    Request = ExportRequest
    # Sampled tokens complete the token ids: a request's window narrows the rows only.
    request_window_rows = frozenset({"token"})
    delivery = Delivery.BACKGROUND

    config: ExportConfig

    def __init__(self, config: ExportConfig, context: ConsumerContext):
        super().__init__(config, context)
        self.hidden_size = int(context.model.hidden_size)
        self.phase = as_selector(config.phase, "export: phase")
        ports: dict[str, TokenPort] = {}  # by key, in the config's order, each once
        for spec in config.layers:
            try:
                port = context.parse_port(str(spec), self.phase).resolve(context.resolve_layer)
            except ValueError as e:
                raise ValueError(f"export: layers entry {spec!r}: {e}") from None
            ports.setdefault(port.key, port)
        self._ports, self.keys = list(ports.values()), list(ports)
        self.dtype = getattr(torch, config.dtype)
        self._lock = threading.Lock()
        self._returned = RequestRows(context.max_result_bytes, "export")
        self.writer: RecordWriter | None = None
        self.shard_rows = 0
        if config.out is None:  # returns rows only
            return
        layout = output_layout(
            config.out, config.overwrite, context.data_parallel_rank, context.data_parallel_size
        )
        row_bytes = self.hidden_size * self.dtype.itemsize * len(self.keys)
        target = config.shard_bytes if config.shard_bytes is not None else DEFAULT_SHARD_BYTES
        self.shard_rows = int(config.shard_rows or target // row_bytes)  # shard_rows >= 1
        if self.shard_rows < 1:
            raise ValueError(
                f"export: shard_bytes={target} is smaller than one row "
                f"({row_bytes} bytes: {len(self.keys)} key(s) x hidden size {self.hidden_size} x "
                f"{self.dtype.itemsize} bytes); use at least {row_bytes}"
            )
        # Each key's column is fixed by its first rows (_take_rows).
        self.writer = RecordWriter(
            layout, {}, self.shard_rows, self._manifest_fields, phase=self.phase, owner=self
        )

    def reads(self) -> list[ReadPort]:
        # The prompt's token ids come with each request: only the rows to write are captured.
        return [*self._ports, SampledTokens(Phase.ALL)]

    def on_bundle(self, bundle: Bundle) -> None:
        t = time.perf_counter()
        with self._lock:
            if self.writer is not None:
                self.writer.used, self.writer.closed = True, False
            self._take_rows(bundle)
            if (sampled := sampled_tokens(bundle)) is not None:
                self._note(*sampled)
        self.counters.add("seconds_taking", time.perf_counter() - t)

    def _note(
        self, requests: list[RequestInfo], pos: np.ndarray, ids: np.ndarray, runs: Any = None
    ) -> Any:
        """Token ids into the request table; each row's request index (None: no files)."""
        if self.writer is None:
            return None
        seen = self.writer.table.seen
        index = self.writer.note_tokens(requests, pos, ids, runs)
        if self.writer.table.seen != seen:
            self.counters.add("requests_seen", self.writer.table.seen - seen)
        return index

    def _take_rows(self, bundle: Bundle) -> None:
        rows = bundle.rows
        n = len(rows)
        if n == 0:
            return
        for key in self.keys:  # checked before anything is noted: a bad bundle writes nothing
            t = bundle.hidden.get(key)
            if t is None:  # a tap the step did not write (see StaleTapError)
                raise ValueError(f"export: bundle lacks {key!r} (has {sorted(bundle.hidden)})")
            width = int(t.shape[-1])
            if self.writer is not None:  # width: hidden size, or (router ports) experts or top-k
                dtype = self.dtype if t.is_floating_point() else torch.int64
                width = self.writer.columns.setdefault(key, (width, dtype))[0]
            if t.shape != (n, width):
                raise ValueError(
                    f"export: {key!r} has shape {tuple(t.shape)}, expected ({n}, {width})"
                )
        tokens = rows.token_ids.detach().to("cpu", torch.int64).numpy()
        positions = np.asarray(rows.position, np.int64)
        keep = rows_to_write(rows, self.phase, self.counters)
        runs = list(rows.runs())  # one split for the returned rows and the token ids
        for info, start, stop in runs:
            if info.wants_result(self.name):
                sel = np.nonzero(keep[start:stop])[0] + start
                self._return_rows(info, bundle, sel, positions, tokens)
        row_request = self._note(rows.requests, positions, tokens, runs)
        if row_request is None or not keep.any():
            return
        idx = np.nonzero(keep)[0]
        tidx = torch.from_numpy(idx)
        hidden = {
            k: (bundle.hidden[k] if idx.size == n else bundle.hidden[k].index_select(0, tidx))
            for k in self.keys
        }
        decode = np.asarray(rows.is_decode, np.bool_)[idx]
        before = len(self.writer.shards)
        try:
            self.writer.write_rows(row_request[idx], positions[idx], tokens[idx], decode, hidden)
        finally:  # a failed write still counts the shards it wrote before
            self._sync_counters(before)

    def _return_rows(
        self, info: RequestInfo, bundle: Bundle, sel: np.ndarray, pos: np.ndarray, ids: np.ndarray
    ) -> None:
        if sel.size == 0:
            return
        at = torch.from_numpy(sel)
        hidden = {}
        for k in self.keys:
            t = bundle.hidden[k].index_select(0, at.to(bundle.hidden[k].device))
            hidden[k] = t.to("cpu", self.dtype if t.is_floating_point() else torch.int64, copy=True)
        self._returned.add(info.engine_id, positions=pos[sel], token_ids=ids[sel], **hidden)
        self.counters.add("rows_returned", int(sel.size))

    def _sync_counters(self, shards_before: int) -> None:
        new = self.writer.shards[shards_before:]
        if new:
            self.counters.add("shards_written", len(new))
            self.counters.add("rows_exported", sum(s["rows"] for s in new))
            self.counters.add("bytes_written", sum(s["bytes"] for s in new))
        self.counters.max("buffer_rows_max", self.writer.buffer_rows_max)
        self.counters.set("seconds_writing", self.writer.seconds_writing)

    def on_request_finished(self, request: RequestInfo) -> None:
        with self._lock:
            if self.writer is not None:
                self.writer.finished(request)
        if request.cut_short:
            self.counters.add("requests_cut_short")

    def on_bundle_dropped(self, step: int, requests: list[RequestInfo]) -> None:
        with self._lock:
            if self.writer is not None:
                self.writer.dropped(requests)  # the bus counts it (bundles_dropped.export)
            for r in requests:  # the bus answers with an error: stop copying rows for it
                if r.wants_result(self.name):
                    self._returned.lose(r.engine_id)

    def request_result(self, request: RequestInfo) -> dict[str, Any]:
        """``positions``, ``token_ids`` and one ``[rows, width]`` array per key of ``request``."""
        with self._lock:
            none = np.zeros(0, np.int64)
            return self._returned.take(request.engine_id, {"positions": none, "token_ids": none})

    @classmethod
    def result_bytes(cls, config: ExportConfig, request: PlannedRequest) -> int | None:
        itemsize = getattr(torch, config.dtype).itemsize
        keys = len(dict.fromkeys(str(k) for k in config.layers))
        rows = window_rows("export", as_selector(config.phase, "export: phase"), request)
        hidden = array_json_bytes(rows * request.hidden_size, itemsize)
        return keys * hidden + 2 * array_json_bytes(rows, 8)

    def _manifest_fields(self) -> dict[str, Any]:
        # "columns": the keys whose rows are not hidden_size wide in dtype (router ports).
        other = {
            k: {"width": int(w), "dtype": str(d).removeprefix("torch.")}
            for k, (w, d) in self.writer.columns.items()
            if (w, d) != (self.hidden_size, self.dtype)
        }
        return {
            "hidden_size": self.hidden_size,
            "num_layers": int(self.context.model.num_layers),
            "dtype": self.config.dtype,
            "keys": list(self.keys),
            **({"columns": other} if other else {}),
            "phase": self.config.phase,
        }

    def close(self) -> None:
        # Unused (e.g. the front end's dry build): write nothing, create nothing.
        with self._lock:
            if self.writer is not None and self.writer.used:
                before = len(self.writer.shards)
                try:
                    self.writer.close()
                finally:  # a failed write still counts what was written
                    self._sync_counters(before)

    def result(self) -> dict[str, Any]:
        with self._lock:
            w = self.writer
            if w is None:
                return {"out": None, "keys": list(self.keys), "complete": True}
            return {
                "out": w.path,
                "shards": len(w.shards),
                "rows": w.rows_written,
                "rows_buffered": w.buffered,
                "requests": w.table.seen,
                "requests_open": w.table.open_count,
                "keys": list(self.keys),
                "complete": w.complete,
                **({"error": w.error, "manifest": w.has_manifest} if w.error else {}),
            }

    summary = staticmethod(report.summary)
    summary_warnings = staticmethod(report.warnings)
    report_plots = staticmethod(report.plots)
