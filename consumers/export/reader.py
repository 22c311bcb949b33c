"""Read an ``export`` directory back: one record per (request, sample), one listed shard at a
time; a data-parallel export (part folders ``dp{rank}``) is merged (:class:`DataParallelExport`)."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from consumers.export import format as fmt


class ExportFormatError(ValueError):
    """The directory is not a readable export (missing/corrupt manifest or shard)."""


class IncompleteExportWarning(UserWarning):
    """The export (or feature record) says ``complete: false``: interrupted, still being
    written, or it lost data (see the manifest's ``losses``)."""


def incomplete_message(path: str, manifest: dict[str, Any]) -> str:
    """Why the export at ``path`` is not complete, from its manifest."""
    losses = manifest.get("losses")
    lost = [f"{k}: {v}" for k, v in losses.items() if v] if isinstance(losses, dict) else []
    why = ", ".join(lost) or "it was interrupted or is still being written"
    if manifest.get("error"):
        why = f"a write failed: {manifest['error']}; {why}"
    if manifest.get(fmt.RUN_ERROR):
        why = f"the run was stopped by a fault: {manifest[fmt.RUN_ERROR]}; {why}"
    return (
        f"{path!r} is not a complete record (complete: false; {why}); records may be "
        f"truncated or lack positions; each request's 'finished' says whether it ran to its end"
    )


@dataclass
class RequestRecord:
    """What every record on the export layout holds: ids, the token sequence (prompt then
    generated) and the rows' positions (indices into ``token_ids``)."""

    request_id: str
    prompt_index: int
    sample_index: int
    num_prompt_tokens: int
    token_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [P]
    is_decode: torch.Tensor  # bool [P]
    finished: bool = field(default=True, kw_only=True)
    engine_id: str = field(default="", kw_only=True)
    data_parallel_rank: int = field(default=0, kw_only=True)

    @property
    def prompt_token_ids(self) -> torch.Tensor:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def generated_token_ids(self) -> torch.Tensor:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class ExportRecord(RequestRecord):
    """Everything exported for one request (one sample): row ``j`` of each ``hidden[key]``
    (``"layer.{i}"``, ``"final"``, ...) is the state after feeding ``token_ids[positions[j]]``."""

    hidden: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> [P, H]


class ExportReader:
    """An export directory: manifest, request table and shards (other formats subclass it)."""

    format_name = fmt.FORMAT_NAME
    format_version = fmt.FORMAT_VERSION
    tensor_name = staticmethod(fmt.hidden_tensor_name)  # shard tensor name of a manifest key

    def __init__(self, path: str | os.PathLike, verify: bool = False):
        self.path = os.path.expanduser(os.fspath(path))
        mpath = os.path.join(self.path, fmt.MANIFEST)
        if not os.path.isfile(mpath):
            if os.path.exists(self.path) and not os.path.isdir(self.path):
                raise ExportFormatError(f"{self.path!r} is a file: an export is a directory")
            if not os.path.exists(self.path):
                raise ExportFormatError(
                    f"{self.path!r} does not exist: not an export, or its run completed no "
                    "shard yet (the directory is made with the first)"
                )
            if parts := [os.path.basename(p) for _, p in fmt.export_parts(self.path)]:
                raise ExportFormatError(
                    f"{self.path!r} holds the parts of a data-parallel export ({', '.join(parts)}), "
                    f"not one manifest: read it with read_export() or open_export()"
                )
            raise ExportFormatError(
                f"{self.path!r} holds no {fmt.MANIFEST}: not an export directory, or no shard "
                f"was completed yet"
            )
        try:
            with open(mpath, encoding="utf-8") as f:
                self.manifest: dict[str, Any] = json.load(f)
        except json.JSONDecodeError as e:
            raise ExportFormatError(f"{mpath!r} is not valid JSON: {e}") from None
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != self.format_name:
            raise ExportFormatError(f"{mpath!r} is not a {self.format_name} manifest")
        version = self.manifest.get("version")
        if version not in range(1, self.format_version + 1):
            raise ExportFormatError(
                f"{mpath!r} has format version {version!r}; this reader reads versions 1 to "
                f"{self.format_version}"
            )
        try:  # a manifest cut by hand or by another writer: name the file, not a KeyError
            self.keys: list[str] = list(self.manifest["keys"])
            self.hidden_size: int = int(self.manifest["hidden_size"])
            self.dtype: str = self.manifest["dtype"]
            self.shards: list[dict[str, Any]] = list(self.manifest["shards"])
            self.num_rows: int = sum(int(s["rows"]) for s in self.shards)
            self._columns = {k: self._no_rows(k) for k in self.keys}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ExportFormatError(f"{mpath!r} lacks a field or has a bad one: {e!r}") from None
        try:
            self.requests: list[dict[str, Any]] = fmt.request_table(self.path, self.manifest)
        except (OSError, ValueError) as e:  # the requests file's errors name it (and the line)
            raise ExportFormatError(f"{self.path!r}: cannot read its request table: {e}") from None
        except (LookupError, TypeError) as e:  # the manifest's part of the table
            raise ExportFormatError(f"{mpath!r} lacks a field or has a bad one: {e!r}") from None
        self.complete: bool = bool(self.manifest.get("complete", False))
        self.verify = verify
        self._unverified = set(range(len(self.shards))) if verify else set()  # hashed once each
        if not self.complete:
            warnings.warn(
                incomplete_message(self.path, self.manifest), IncompleteExportWarning, stacklevel=2
            )

    def __len__(self) -> int:
        return len(self.requests)

    def _check(self, i: int) -> str:
        s, p = self.shards[i], os.path.join(self.path, self.shards[i]["file"])
        if not os.path.isfile(p):
            raise ExportFormatError(f"shard {p!r} listed in the manifest is missing")
        if i in self._unverified and fmt.sha256_file(p) != (s["sha256"], s["bytes"]):
            raise ExportFormatError(f"shard {p!r} fails its sha256 check")
        self._unverified.discard(i)
        return p

    def _tensors(self, i: int, names: list[str]) -> dict[str, torch.Tensor]:
        p = self._check(i)
        try:
            with safe_open(p, framework="pt") as f:
                return {name: f.get_tensor(name) for name in names}
        except (SafetensorError, OSError) as e:
            raise ExportFormatError(f"shard {p!r} cannot be read (cut short?): {e}") from None

    def load_shard(self, i: int, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Tensors of shard ``i``: row tensors plus ``hidden.{key}`` for ``keys`` (default all)."""
        keys = keys or self.keys
        out = self._tensors(i, list(fmt.ROW_TENSORS) + [self.tensor_name(k) for k in keys])
        rows, name = int(self.shards[i]["rows"]), os.path.join(self.path, self.shards[i]["file"])
        for t in out.values():
            if t.shape[0] != rows:
                raise ExportFormatError(f"shard {name!r} has {len(t)} rows, the manifest: {rows}")
        for k in keys:
            t, want = out[self.tensor_name(k)], self._columns[k]
            if t.dtype != want.dtype or t.shape[1:] != want.shape[1:]:
                raise ExportFormatError(
                    f"shard {name!r}: {k!r} is {t.dtype} of shape {tuple(t.shape)}, the manifest "
                    f"says {want.dtype} rows of width {want.shape[1]}"
                )
        return out

    def _record(self, r: int, pieces: list[dict[str, torch.Tensor]]) -> Any:
        """Request ``r``'s record from its shard pieces, by position (a repeated one: first row)."""
        if pieces:
            pos = torch.cat([p[fmt.POSITION] for p in pieces])
            pos, order = torch.sort(pos, stable=True)
            keep = torch.cat([torch.ones_like(pos[:1], dtype=torch.bool), pos[1:] != pos[:-1]])
            pos, order = pos[keep], order[keep]
            dec = torch.cat([p[fmt.IS_DECODE] for p in pieces])[order]
            data = {k: torch.cat([p[k] for p in pieces])[order] for k in self.keys}
        else:
            pos, dec = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool)
            data = {k: self._no_rows(k) for k in self.keys}
        meta = self.requests[r]
        try:
            fields = {
                "request_id": meta["request_id"],
                "prompt_index": int(meta["prompt_index"]),
                "sample_index": int(meta["sample_index"]),
                "num_prompt_tokens": int(meta["num_prompt_tokens"]),
                "token_ids": torch.tensor(meta["token_ids"], dtype=torch.int64),
                "finished": bool(meta.get("finished", False)),
                "engine_id": meta.get("engine_id", ""),
            }
        except (KeyError, TypeError, ValueError) as e:
            raise ExportFormatError(f"{self.path!r}: request {r} has a bad entry: {e!r}") from None
        if len(pos) and not 0 <= int(pos[0]) <= int(pos[-1]) < len(fields["token_ids"]):
            raise ExportFormatError(
                f"{self.path!r}: request {r} has rows at positions {int(pos[0])}..{int(pos[-1])}, "
                f"outside its {len(fields['token_ids'])} token ids"
            )
        return self._make(fields, pos, dec, data)

    def _no_rows(self, key: str) -> torch.Tensor:
        c = self.manifest.get("columns", {}).get(key, {})
        dtype = getattr(torch, c.get("dtype", self.dtype))
        return torch.zeros(0, c.get("width", self.hidden_size), dtype=dtype)

    def _make(self, fields: dict[str, Any], pos: Any, dec: Any, data: dict) -> ExportRecord:
        return ExportRecord(**fields, positions=pos, is_decode=dec, hidden=data)

    def __iter__(self) -> Iterator[ExportRecord]:
        """Records in the order their last shard is read; requests without rows come last."""
        n_req = len(self.requests)
        last = [-1] * n_req
        for i in range(len(self.shards)):
            row_request = self._tensors(i, [fmt.ROW_REQUEST])[fmt.ROW_REQUEST]
            for r in torch.unique(row_request).tolist():
                if not 0 <= r < n_req:
                    raise ExportFormatError(
                        f"shard {self.shards[i]['file']!r} refers to request {r}, the table has {n_req}"
                    )
                last[r] = i
        closing: dict[int, list[int]] = {}
        for r, i in enumerate(last):
            closing.setdefault(i, []).append(r)
        pending: dict[int, list[dict[str, torch.Tensor]]] = {}
        for i in range(len(self.shards)):
            t = self.load_shard(i)
            rr = t[fmt.ROW_REQUEST]
            order = torch.argsort(rr, stable=True)
            uniq, counts = torch.unique_consecutive(rr[order], return_counts=True)
            start = 0
            for r, c in zip(uniq.tolist(), counts.tolist(), strict=True):
                sel = order[start : start + c]
                start += c
                piece = {k: t[self.tensor_name(k)][sel] for k in self.keys}
                piece |= {n: t[n][sel] for n in (fmt.POSITION, fmt.IS_DECODE)}
                pending.setdefault(r, []).append(piece)
            del t
            for r in closing.get(i, []):
                yield self._record(r, pending.pop(r, []))
        for r in closing.get(-1, []):
            yield self._record(r, [])

    def records(self) -> list[ExportRecord]:
        """All records, sorted by (prompt_index, sample_index, request_id); loads everything."""
        return sorted(self, key=lambda x: (x.prompt_index, x.sample_index, x.request_id))


class DataParallelExport:
    """An export written by data-parallel engines, one part folder ``dp{rank}`` each: iterating
    yields each part's records in rank order (``data_parallel_rank`` names the engine)."""

    def __init__(self, path: str | os.PathLike, parts: list[tuple[int, ExportReader]]):
        self.path = os.path.expanduser(os.fspath(path))
        if not parts:
            raise ExportFormatError(f"{self.path!r} holds no data-parallel part")
        self.parts = sorted(parts, key=lambda p: p[0])
        sizes = set()
        for rank, part in self.parts:
            dp = part.manifest.get("data_parallel")
            if not isinstance(dp, dict) or (dp.get("rank"), type(dp.get("size"))) != (rank, int):
                raise ExportFormatError(
                    f"{part.path!r} is not the part of data-parallel rank {rank} (its manifest "
                    f"says data_parallel={dp!r})"
                )
            sizes.add(dp["size"])
        first = self.parts[0][1]
        for what in ("keys", "hidden_size", "dtype"):
            if len(values := {repr(getattr(p, what)) for _, p in self.parts}) > 1:
                raise ExportFormatError(f"the parts of {self.path!r} disagree on {what}: {values}")
        ranks = [r for r, _ in self.parts]
        if len(sizes) > 1 or max(ranks) >= min(sizes):
            raise ExportFormatError(
                f"the parts of {self.path!r} ({', '.join(fmt.part_name(r) for r in ranks)}) come "
                f"from exports with different data-parallel sizes {sorted(sizes)}: remove the "
                f"stale parts, or export again with overwrite=true"
            )
        self.data_parallel_size: int = sizes.pop()
        self.keys, self.hidden_size, self.dtype = first.keys, first.hidden_size, first.dtype
        self.complete: bool = all(p.complete for _, p in self.parts)

    @property
    def num_rows(self) -> int:
        return sum(p.num_rows for _, p in self.parts)

    def __len__(self) -> int:
        return sum(len(p) for _, p in self.parts)

    def __iter__(self) -> Iterator[Any]:
        for rank, part in self.parts:
            for record in part:
                record.data_parallel_rank = rank
                yield record

    records = ExportReader.records


def open_export(
    path: str | os.PathLike, verify: bool = False, reader: type[ExportReader] = ExportReader
) -> ExportReader | DataParallelExport:
    """The export at ``path``, a data-parallel one's parts merged; ``reader`` reads one part."""
    root = os.path.expanduser(os.fspath(path))
    if not os.path.isfile(os.path.join(root, fmt.MANIFEST)) and (parts := fmt.export_parts(root)):
        return DataParallelExport(root, [(r, reader(p, verify=verify)) for r, p in parts])
    return reader(root, verify=verify)


def read_export(path: str | os.PathLike, verify: bool = False) -> Iterator[ExportRecord]:
    """Yield one :class:`ExportRecord` per (request, sample) of the export at ``path``, one
    shard at a time; ``verify=True`` checks each shard's sha256 against the manifest first."""
    return iter(open_export(path, verify=verify))
