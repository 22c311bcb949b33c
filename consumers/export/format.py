"""On-disk layout of an ``export`` directory (``docs/export-format.md``) for writer and reader.
Data parallel: each engine writes a complete export into the part folder ``dp{rank}``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from typing import Annotated, Any

from pydantic import AfterValidator

FORMAT_NAME = "tllm-export"
# 2: closed requests in REQUESTS_FILE (1: the whole request table in the manifest).
FORMAT_VERSION = 2

MANIFEST = "manifest.json"
REQUESTS_FILE = "requests.jsonl"
TMP_SUFFIX = ".tmp"
# safetensors' own temporary file in the folder, left there when a write is killed.
SAFETENSORS_TMP = re.compile(r"^\.tmp[A-Za-z0-9_]{6}$")
SHARD_PATTERN = re.compile(r"^shard-(\d{5,})\.safetensors$")

# Tensors of every shard (besides ``hidden.{key}``), all with one entry per row.
ROW_REQUEST = "row_request"  # int64: index into the manifest's request table
POSITION = "position"  # int64: token position within the request's sequence
TOKEN_ID = "token_id"  # int64: token fed at that position
IS_DECODE = "is_decode"  # bool: position >= num_prompt_tokens
ROW_TENSORS = (ROW_REQUEST, POSITION, TOKEN_ID, IS_DECODE)


def _a_path(path: str) -> str:
    if not path.strip():
        raise ValueError("must be a path, got an empty string")
    return path


#: A folder a config names (export's and sae's ``out``, sae's SAE ``path``): not empty.
Folder = Annotated[str, AfterValidator(_a_path)]


def part_name(rank: int) -> str:
    """Folder of data-parallel engine ``rank`` inside the output directory."""
    return f"dp{rank}"


def part_rank(name: str) -> int | None:
    """The rank of a part folder name (``"dp3"`` -> 3), else None."""
    m = re.match(r"^dp(\d+)$", name)
    return None if m is None else int(m.group(1))


def export_parts(path: str | os.PathLike) -> list[tuple[int, str]]:
    """``(rank, folder)`` of the data-parallel parts in ``path`` holding a manifest, by rank."""
    root = os.fspath(path)
    if not os.path.isdir(root):
        return []
    found = [(part_rank(n), os.path.join(root, n)) for n in os.listdir(root)]
    return sorted((r, p) for r, p in found if r is not None and os.path.isfile(f"{p}/{MANIFEST}"))


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def hidden_tensor_name(key: str) -> str:
    return f"hidden.{key}"


def is_export_file(name: str) -> bool:
    """Files this format owns in a directory (removed by ``overwrite``)."""
    return (
        name in (MANIFEST, REQUESTS_FILE)
        or SHARD_PATTERN.match(name) is not None
        or (name.endswith(TMP_SUFFIX) and (name.startswith("shard-") or name.startswith(MANIFEST)))
        or SAFETENSORS_TMP.match(name) is not None
    )


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable (where directories can be opened)."""
    with contextlib.suppress(OSError):
        fsync(path)


def sha256_file(path: str, chunk: int = 1 << 20) -> tuple[str, int]:
    """(hex digest, size in bytes) of a file, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
            size += len(b)
    return h.hexdigest(), size


# Manifest field: the fault that stopped the run that wrote the export (mark_run_failed).
RUN_ERROR = "run_error"


def mark_run_failed(out: str, cause: str, since: float) -> list[str]:
    """After a fault stopped the engine: mark each manifest at ``out`` (and its part folders)
    written since ``since`` (``time.time()``) ``complete: false`` with the cause; returns them."""
    root = os.path.abspath(os.path.expanduser(out))
    marked = []
    for folder in [root, *(p for _, p in export_parts(root))]:
        path = os.path.join(folder, MANIFEST)
        try:
            if os.stat(path).st_mtime < since:
                continue
            with open(path, encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, ValueError):  # none, or not one of ours: nothing to mark
            continue
        if not isinstance(manifest, dict):  # not one of ours either
            continue
        write_json_atomic(path, {**manifest, "complete": False, RUN_ERROR: cause})
        marked.append(path)
    return marked


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = path + TMP_SUFFIX
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def request_table(path: str, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The export's request table: the requests file's first ``requests_closed`` lines plus the
    manifest's ``requests``, by index; ``ValueError`` naming the file (and line) when damaged."""
    inline = list(manifest["requests"])
    n = int(manifest.get("requests_closed", 0))
    if n == 0:
        return inline
    name = manifest.get("requests_file", REQUESTS_FILE)
    file, closed = os.path.join(path, name), []
    try:
        with open(file, "rb") as f:  # bytes: a line not UTF-8 is an error naming its number
            for number, line in enumerate(f, 1):
                if len(closed) == n:
                    break  # later lines: requests closed after this manifest was written
                closed.append(_request_entry(line, file, number))
    except OSError as e:
        raise ValueError(
            f"{file!r} cannot be read ({e.strerror}); the manifest lists {n} requests in it"
        ) from None
    if len(closed) < n:
        raise ValueError(f"{name!r} holds {len(closed)} requests, the manifest says {n}")
    table = sorted(closed + inline, key=lambda e: e["index"])
    if [e["index"] for e in table] != list(range(len(table))):
        raise ValueError(f"the request table of {path!r} has gaps or duplicate indices")
    return table


def _request_entry(line: bytes, file: str, number: int) -> dict[str, Any]:
    try:
        entry = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{file!r} line {number}: not valid JSON ({e})") from None
    if not isinstance(entry, dict) or type(entry.get("index")) is not int:
        raise ValueError(
            f'{file!r} line {number}: not a request entry (a JSON object with a whole-number "index")'
        )
    return entry
