"""Shard writer of the export layout: each shard, then the manifest, written to ``.tmp``,
fsynced and renamed, so the directory only ever names complete shards. After a failed write
(:class:`ExportWriteError`) later rows are dropped and the manifest says why."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import torch
from safetensors.torch import save_file

from consumers.export import format as fmt
from consumers.export.requests import RequestTable
from tllm_core import Phase, request_runs

log = logging.getLogger("tllm")

# First buffer allocation (rows); the buffer doubles up to the shard size as rows arrive.
_INITIAL_ROWS = 256


class ExportWriteError(OSError):
    """Writing an export (or feature record) file failed; the message names the file."""


def _cause(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# The write check's file (unnamed where the file system can: O_TMPFILE); the folder checks
# of other engines, which may run meanwhile, do not count it.
PROBE_PREFIX = ".tllm-check-"


def _writable(folder: str) -> str | None:
    """Why nothing can be made in ``folder``, or None: a file made there and gone again
    (permission bits do not tell for root, a read-only mount or a pseudo file system)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return "this process cannot write to it"
    try:
        with tempfile.TemporaryFile(prefix=PROBE_PREFIX, dir=folder):
            pass
    except OSError as e:
        return _cause(e)
    return None


def _listed(names: Iterable[str]) -> list[str]:
    """A folder's names but a write check's file."""
    return sorted(n for n in names if not n.startswith(PROBE_PREFIX))


def check_output_dir(out: str, overwrite: bool, parts_below: int = 0) -> str:
    """``out``'s absolute path, checked leaving nothing behind (``ValueError`` naming it);
    part folders ``dp{r}`` with ``r < parts_below`` do not count (each engine checks its own)."""
    path = os.path.abspath(os.path.expanduser(str(out)))
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"export: out={out!r} exists and is not a directory")
    if os.path.isdir(path):
        if why := _writable(path):
            raise ValueError(f"export: out={out!r} is a directory tllm cannot write to: {why}")
        with os.scandir(path) as it:
            entries = _listed(e.name for e in it if not _part_below(e.name, parts_below))
        if entries and not overwrite:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise ValueError(
                f"export: out={out!r} is not empty ({shown}); choose an empty or new directory, "
                f"or set overwrite=true (tllm export: --overwrite) to replace the export files in it"
            )
        return path
    # Does not exist yet: the nearest existing ancestor must be a writable directory.
    parent = os.path.dirname(path)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(
            f"export: cannot create out={out!r}: {parent!r} exists and is not a directory"
        )
    if why := _writable(parent):
        raise ValueError(f"export: cannot create out={out!r} in {parent!r}: {why}")
    return path


def _part_below(name: str, size: int) -> bool:
    rank = fmt.part_rank(name)
    return rank is not None and rank < size


def remove_export_files(path: str) -> None:
    """Remove the export files in ``path``, manifest first (it never claims removed shards);
    other files stay, and one another engine removes meanwhile is fine."""
    for name in sorted(os.listdir(path), key=lambda n: (n != fmt.MANIFEST, n)):
        if fmt.is_export_file(name):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, name))
    fmt.fsync_dir(path)


@dataclass(frozen=True)
class OutputLayout:
    """Where one engine writes: ``root`` itself, or under data parallel ``root/dp{dp_rank}``."""

    root: str
    path: str
    dp_rank: int = 0
    dp_size: int = 1
    overwrite: bool = False

    def clean_root(self) -> None:
        """With ``overwrite``, before the first write: remove what an earlier export left in
        ``root`` that this one does not replace (every engine does it, tolerating the others)."""
        if not self.overwrite or not os.path.isdir(self.root):
            return
        if self.dp_size > 1:
            _refuse_if_written(self.root)  # a plain export running there
            remove_export_files(self.root)
        keep = self.dp_size if self.dp_size > 1 else 0
        with os.scandir(self.root) as it:
            parts = [e for e in it if e.is_dir() and fmt.part_rank(e.name) is not None]
        for part in [e.path for e in parts if not _part_below(e.name, keep)]:
            _refuse_if_written(part)  # another data-parallel export running there
            with contextlib.suppress(FileNotFoundError):  # another engine removed it
                remove_export_files(part)
            with contextlib.suppress(OSError):  # removed already, or holds other files
                os.rmdir(part)


def _refuse_if_written(folder: str) -> None:
    """Overwrite removes no export being written (its writer holds the folder's flock)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # gone meanwhile
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(
            f"export: {folder!r} is being written by another export, which overwrite does not "
            f"remove: give each its own out"
        ) from None
    except OSError:  # a file system without flock: as the writer, unlocked
        pass
    finally:
        os.close(fd)  # and with it the lock


def output_layout(out: str, overwrite: bool, dp_rank: int = 0, dp_size: int = 1) -> OutputLayout:
    """Check ``out`` (and this engine's part folder in it) as :func:`check_output_dir`."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"export: data-parallel rank {dp_rank} of size {dp_size} is invalid")
    root = path = check_output_dir(out, overwrite, parts_below=dp_size if dp_size > 1 else 0)
    if dp_size > 1:
        path = check_output_dir(os.path.join(root, fmt.part_name(dp_rank)), overwrite)
    return OutputLayout(root, path, dp_rank, dp_size, overwrite)


class RecordWriter:
    """One engine's record in the export layout (``export``, ``sae`` features), thread-safe.
    ``columns``: each key's ``(width, dtype)``; ``fields``: the format's own manifest fields;
    ``phase``/``owner``: the rows recorded and the consumer whose request windows narrow them."""

    def __init__(
        self,
        layout: OutputLayout,
        columns: dict[str, tuple[int, torch.dtype]],
        shard_rows: int,
        fields: Callable[[], dict[str, Any]],
        *,
        phase: Any = Phase.ALL,
        owner: Any = None,
        format_name: str = fmt.FORMAT_NAME,
        tensor_name: Callable[[str], str] = fmt.hidden_tensor_name,
    ):
        self.layout = layout
        self.path = layout.path
        self.columns = columns
        self.shard_rows = shard_rows
        self._fields = fields
        self.format_name = format_name
        self.tensor_name = tensor_name
        self.lock = threading.RLock()
        self.used = False
        self.closed = False  # after the last data
        self.complete = False  # closed, and nothing was lost
        self.shards: list[dict[str, Any]] = []
        # The first failed write ("writing FILE: cause"); from then on rows are dropped.
        self.error: str | None = None
        self.rows_unwritten = 0
        self.rows_written = 0
        self.buffer_rows_max = 0
        self.seconds_writing = 0.0
        self._prepared = False
        self._lock: int | None = None  # the folder's descriptor, flock-ed while writing
        self._wrote_manifest = False
        self.capacity = self.buffered = 0  # rows allocated, rows held
        self._hidden: dict[str, torch.Tensor] = {}
        self._meta: dict[str, np.ndarray] = {}
        self.table = RequestTable(self, phase, owner)

    def _ensure_capacity(self, rows: int) -> None:
        if rows <= self.capacity:
            return
        cap = max(rows, min(self.shard_rows, max(_INITIAL_ROWS, 2 * self.capacity)))
        n = self.buffered
        hidden = {k: torch.empty(cap, w, dtype=dt) for k, (w, dt) in self.columns.items()}
        meta = {
            k: np.empty(cap, np.bool_ if k == fmt.IS_DECODE else np.int64) for k in fmt.ROW_TENSORS
        }
        if n:
            for old, new in ((self._hidden, hidden), (self._meta, meta)):
                for k, buf in new.items():
                    buf[:n] = old[k][:n]
        self._hidden, self._meta, self.capacity = hidden, meta, cap

    def note_tokens(
        self,
        requests: list[Any],
        positions: np.ndarray,
        tokens: np.ndarray,
        runs: Iterable[tuple[Any, int, int]] | None = None,
    ) -> np.ndarray:
        """Token ids fed (or sampled) at ``positions``; returns each row's request index."""
        index = np.empty(len(requests), np.int64)
        with self.lock:
            for info, start, stop in request_runs(requests) if runs is None else runs:
                req = self.table.get(info)
                if stop - start == 1:
                    req.put_one(int(positions[start]), int(tokens[start]))
                else:
                    req.put(positions[start:stop], tokens[start:stop])
                index[start:stop] = req.index
        return index

    def write_rows(
        self,
        row_request: np.ndarray,
        positions: np.ndarray,
        tokens: np.ndarray,
        is_decode: np.ndarray,
        columns: dict[str, torch.Tensor],
    ) -> None:
        """Append rows (``columns[key]``: ``[R, width]``), writing each shard as it fills."""
        meta = dict(zip(fmt.ROW_TENSORS, (row_request, positions, tokens, is_decode), strict=True))
        total = len(positions)
        with self.lock:
            self.used, self.closed = True, False
            if self.error is not None:
                self.rows_unwritten += total
                return
            start = 0
            while start < total:
                take = min(total - start, self.shard_rows - self.buffered)
                self._ensure_capacity(self.buffered + take)
                a, b = self.buffered, self.buffered + take
                for key in self.columns:
                    self._hidden[key][a:b] = columns[key][start : start + take]
                for k in fmt.ROW_TENSORS:
                    self._meta[k][a:b] = meta[k][start : start + take]
                self.buffered = b
                self.buffer_rows_max = max(self.buffer_rows_max, self.buffered)
                start += take
                if self.buffered >= self.shard_rows:
                    try:
                        self.write_shard()
                    except ExportWriteError:
                        self.rows_unwritten += total - start  # this call's rows not yet buffered
                        raise

    def finished(self, request: Any) -> None:
        with self.lock:
            self.table.finish(request)

    def dropped(self, requests: list[Any]) -> None:
        with self.lock:
            self.table.drop(requests)

    def prepare(self) -> None:
        """Create the directory and flock it until close (another writer's shards would mix
        with these); at the first write, with ``overwrite``, remove old export files."""
        if self._lock is not None:
            return
        if not self._prepared:
            self.layout.clean_root()
            os.makedirs(self.path, exist_ok=True)
        self._lock = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._unlock()
            raise ValueError(
                f"export: {self.path!r} is being written by another export (another run or "
                f"consumer, or an engine of this process not closed): give each its own out"
            ) from None
        except OSError as e:  # a file system without flock (some network ones): write unlocked
            log.warning(
                "export: %r cannot be locked (%s): written without the one-writer lock; give "
                "no other export this out",
                self.path,
                e.strerror or e,
            )
        if self._prepared:
            return
        names = _listed(os.listdir(self.path))
        if names and not self.layout.overwrite:
            self._unlock()
            raise ValueError(
                f"export: {self.path!r} became non-empty before the first write ({names[:5]}); "
                f"refusing to mix exports (set overwrite=true, tllm export: --overwrite, to replace)"
            )
        remove_export_files(self.path)
        self._prepared = True

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None

    def write_shard(self) -> None:
        """Write the buffered rows as the next shard and rewrite the manifest."""
        n = self.buffered
        if n == 0:
            return
        if self.error is not None:
            self.rows_unwritten += n
            self.buffered = 0
            return
        index = len(self.shards)
        name = fmt.shard_name(index)
        final = os.path.join(self.path, name)
        t = time.perf_counter()
        try:
            self.prepare()
            tensors = {self.tensor_name(k): self._hidden[k][:n] for k in self.columns}
            tensors |= {k: torch.from_numpy(self._meta[k][:n]) for k in fmt.ROW_TENSORS}
            tmp, version = final + fmt.TMP_SUFFIX, str(fmt.FORMAT_VERSION)
            meta = {"format": self.format_name, "version": version, "shard_index": str(index)}
            save_file(tensors, tmp, metadata={**meta, "rows": str(n)})
            # safetensors makes it 0600: readable like its folder instead (a shared project dir)
            os.chmod(tmp, os.stat(self.path).st_mode & 0o666)
            digest, size = fmt.sha256_file(tmp)
            fmt.fsync(tmp)
            os.replace(tmp, final)
            fmt.fsync_dir(self.path)
        except Exception as e:  # noqa: BLE001 - safetensors' own error class carries ENOSPC too
            self._fail(final, e, n)
        self.shards.append({"file": name, "rows": n, "bytes": size, "sha256": digest})
        self.rows_written += n
        self.buffered = 0
        self.write_manifest()
        self.seconds_writing += time.perf_counter() - t

    def _fail(self, path: str, e: BaseException, rows: int) -> NoReturn:
        """Drop the buffered ``rows``, leave a manifest saying why if one can be written."""
        self.error = f"writing {path}: {_cause(e)}"
        self.rows_unwritten += rows
        self.buffered = 0
        if self._lock is None:  # the folder is not ours (another writer's, or none): touch nothing
            raise ExportWriteError(f"export: {self.error}; nothing was written") from e
        with contextlib.suppress(OSError):
            os.remove(path + fmt.TMP_SUFFIX)
        mpath = os.path.join(self.path, fmt.MANIFEST)
        if path != mpath:
            with contextlib.suppress(ExportWriteError):  # no manifest: the error below says so
                self.write_manifest()
        elif os.path.isfile(mpath):
            raise ExportWriteError(
                f"export: {self.error}; {mpath!r} is an earlier manifest (the rows since are "
                "not written)"
            ) from e
        if not os.path.isfile(mpath):
            raise ExportWriteError(
                f"export: {self.error}; no manifest could be written, so nothing in "
                f"{self.path!r} is an export"
            ) from e
        raise ExportWriteError(
            f"export: {self.error}; {rows} row(s) and every later one are not written; "
            f"{mpath!r} says complete: false with this cause"
        ) from e

    @property
    def has_manifest(self) -> bool:
        """Whether the folder holds a manifest this writer wrote (a failed write may leave none)."""
        return self._wrote_manifest and os.path.isfile(os.path.join(self.path, fmt.MANIFEST))

    def write_manifest(self) -> None:
        mpath = os.path.join(self.path, fmt.MANIFEST)
        try:
            self.prepare()
            fmt.write_json_atomic(mpath, self._manifest())
            self._wrote_manifest = True
        except Exception as e:  # noqa: BLE001 - as write_shard
            with contextlib.suppress(OSError):
                os.remove(mpath + fmt.TMP_SUFFIX)
            if self.error is not None:  # the cause is the first failure; this one follows
                raise ExportWriteError(f"export: writing {mpath}: {_cause(e)}") from e
            self._fail(mpath, e, 0)

    def _manifest(self) -> dict[str, Any]:
        table = self.table.manifest_fields()
        if self.error is not None:  # after a failed write: the cause, and the rows it cost
            table["losses"]["rows_unwritten"] = self.rows_unwritten
        self.complete = self.closed and not any(table["losses"].values()) and self.error is None
        layout, part = self.layout, {}
        if layout.dp_size > 1:
            part = {"data_parallel": {"rank": layout.dp_rank, "size": layout.dp_size}}
        return {
            **part,
            "format": self.format_name,
            "version": fmt.FORMAT_VERSION,
            "complete": self.complete,
            **self._fields(),
            "shard_rows": self.shard_rows,
            "num_rows": self.rows_written,
            "shards": [dict(s) for s in self.shards],
            **table,
            **({} if self.error is None else {"error": self.error}),
        }

    def close(self) -> None:
        """Write buffered rows and the final manifest (if ever used)."""
        with self.lock:
            if not self.used:
                return
            self.closed = True
            try:
                if self.buffered:
                    self.write_shard()  # rewrites the manifest too
                else:
                    self.write_manifest()
            finally:  # a failed write (ExportWriteError) still lets go of the files
                if self.buffered == 0:  # drop the (empty) buffers
                    self._hidden, self._meta, self.capacity = {}, {}, 0
                self.table.release()
                self._unlock()
