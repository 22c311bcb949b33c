"""Writes fail honestly (issue 46, item 3): a failed write in ``export`` or ``sae`` (ENOSPC,
EIO, a permission lost mid-run) names the file, leaves a manifest that says ``complete:
false`` with the cause (or says that nothing on disk is an export), ``requests.jsonl`` never
lists a request whose rows were not written, and ``read_export`` says why. The failures are
made by patching the writes (no root-only mounts)."""

from __future__ import annotations

import contextlib
import errno
import json
import os

import numpy as np
import pytest
import torch
from test_export_unit import FakeEngine, make_export, run_engine

from consumers.export import format as fmt
from consumers.export import read_export
from consumers.export import report as export_report
from consumers.export import writer as writer_mod
from consumers.export.reader import IncompleteExportWarning
from consumers.export.writer import ExportWriteError
from consumers.sae.features import FeatureWriter, read_features
from tllm_core.api.rows import RequestInfo

ENOSPC = OSError(errno.ENOSPC, "No space left on device")
EIO = OSError(errno.EIO, "Input/output error")


def req(i: int) -> RequestInfo:
    return RequestInfo(f"{i}-x", str(i), i, 0, 2)


def _append(w: FeatureWriter, r: RequestInfo, positions: list[int]) -> None:
    n = len(positions)
    w.append(
        [r] * n,
        np.array(positions),
        np.array(positions) + 10,
        np.array(positions) >= 2,
        torch.zeros(n, 2, dtype=torch.int32),
        torch.ones(n, 2),
    )


def _fail_shards_from(monkeypatch, n: int, error: OSError) -> None:
    """Shard writes after the ``n``-th raise ``error`` (as the disk filling would)."""
    save = writer_mod.save_file
    count = [0]

    def failing_save(tensors, path, metadata=None):
        count[0] += 1
        if count[0] > n:
            raise error
        save(tensors, path, metadata=metadata)

    monkeypatch.setattr(writer_mod, "save_file", failing_save)


def _manifest(out) -> dict:
    return json.loads((out / fmt.MANIFEST).read_text())


def _jsonl(out) -> list[dict]:
    path = out / fmt.REQUESTS_FILE
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("error", [ENOSPC, EIO], ids=["ENOSPC", "EIO"])
def test_the_last_shard_failing_leaves_a_manifest_with_the_cause(tmp_path, monkeypatch, error):
    out = tmp_path / "feat"
    w = FeatureWriter(str(out), 2, "float32", 4, False, lambda: {})
    a, b, c = req(0), req(1), req(2)
    _append(w, a, [0, 1, 2, 3])  # a full shard: written
    w.finished(a)
    _append(w, c, [0, 1, 2, 3])  # shard 1; its manifest vouches for a's line
    _append(w, b, [0, 1])
    w.finished(b)  # its rows are still buffered
    _fail_shards_from(monkeypatch, 0, error)
    with pytest.raises(ExportWriteError) as e:
        w.close()
    shard = str(out / fmt.shard_name(2))
    assert shard in str(e.value) and error.strerror in str(e.value)
    m = _manifest(out)
    assert m["complete"] is False and shard in m["error"] and error.strerror in m["error"]
    assert m["losses"]["rows_unwritten"] == 2
    # requests.jsonl lists only the request whose rows were written; b stays in the manifest.
    assert [r["request_id"] for r in _jsonl(out)] == ["0"]
    assert m["requests_closed"] == 1
    assert [r["request_id"] for r in m["requests"]] == ["2", "1"]  # by index: c came first
    assert not [p for p in os.listdir(out) if p.endswith(fmt.TMP_SUFFIX)]
    with pytest.warns(IncompleteExportWarning, match="a write failed: writing .*shard-00002"):
        recs = list(read_features(out))
    assert sorted(r.request_id for r in recs) == ["0", "1", "2"]


def test_no_byte_written_says_nothing_on_disk_is_an_export(tmp_path, monkeypatch):
    out = tmp_path / "feat"
    w = FeatureWriter(str(out), 2, "float32", 4, False, lambda: {})
    _append(w, req(0), [0, 1])
    w.finished(req(0))
    _fail_shards_from(monkeypatch, 0, ENOSPC)

    def no_json(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fmt, "write_json_atomic", no_json)
    with pytest.raises(ExportWriteError, match="nothing in .* is an export") as e:
        w.close()
    assert str(out / fmt.shard_name(0)) in str(e.value)
    assert not (out / fmt.MANIFEST).exists() and _jsonl(out) == []


def test_a_permission_lost_mid_run_is_named_and_later_rows_are_counted(tmp_path, monkeypatch):
    out = tmp_path / "feat"
    w = FeatureWriter(str(out), 2, "float32", 2, False, lambda: {})
    _append(w, req(0), [0, 1])  # shard 0
    _fail_shards_from(monkeypatch, 0, OSError(errno.EACCES, "Permission denied"))
    with pytest.raises(ExportWriteError, match="Permission denied"):
        _append(w, req(1), [0, 1])
    _append(w, req(1), [2, 3])  # no second error: dropped and counted
    w.finished(req(1))
    w.close()  # the manifest: complete false, the first cause
    m = _manifest(out)
    assert m["complete"] is False and "Permission denied" in m["error"]
    assert m["losses"]["rows_unwritten"] == 4 and m["num_rows"] == 2


def test_export_consumer_reports_the_failed_file(tmp_path, monkeypatch):
    out = tmp_path / "exp"
    c = make_export(out, layers=[0], shard_rows=3)
    eng = FakeEngine([4, 3], [2, 2], ["layer.0"])
    _fail_shards_from(monkeypatch, 1, ENOSPC)
    errors = []

    def deliver(bundle):
        try:
            c.on_bundle(bundle)
        except ExportWriteError as e:
            errors.append(str(e))

    run_engine(c, eng, deliver)
    c.close()
    assert len(errors) == 1 and str(out / fmt.shard_name(1)) in errors[0]
    res = c.result()
    assert res["complete"] is False and "No space left" in res["error"]
    m = _manifest(out)
    assert m["complete"] is False and m["num_rows"] == 3 and m["losses"]["rows_unwritten"] > 0
    # Every request in requests.jsonl has all its rows in the written shard.
    assert {r["request_id"] for r in _jsonl(out)} <= {"req0"}
    with pytest.warns(IncompleteExportWarning, match="a write failed: writing .*No space left"):
        list(read_export(out))
    (said,) = export_report.warnings({}, res)  # the run's summary
    assert said.endswith("(the manifest says complete: false)"), said


def test_export_that_left_no_manifest_does_not_point_to_one(tmp_path, monkeypatch):
    out = tmp_path / "exp"
    c = make_export(out, layers=[0], shard_rows=3)
    eng = FakeEngine([4, 3], [2, 2], ["layer.0"])
    _fail_shards_from(monkeypatch, 0, ENOSPC)

    def no_json(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fmt, "write_json_atomic", no_json)
    run_engine(c, eng, lambda b: _deliver(c, b))
    with contextlib.suppress(ExportWriteError):
        c.close()
    res = c.result()
    assert res["manifest"] is False and not (out / fmt.MANIFEST).exists()
    (said,) = export_report.warnings({}, res)
    assert said.endswith("(no manifest: nothing in the folder is an export)"), said


def _deliver(c, bundle) -> None:
    with contextlib.suppress(ExportWriteError):
        c.on_bundle(bundle)


def test_requests_jsonl_waits_for_the_shard_of_its_rows(tmp_path):
    out = tmp_path / "feat"
    w = FeatureWriter(str(out), 2, "float32", 4, False, lambda: {})
    _append(w, req(0), [0, 1, 2, 3])  # shard 0, manifest
    _append(w, req(1), [0, 1])  # buffered
    w.finished(req(1))
    assert _jsonl(out) == []  # its rows are not on disk yet
    w.close()
    assert [r["request_id"] for r in _jsonl(out)] == ["1"]


# -- a fault that stops the engine: the front end marks the export (tllm_run_failed) ----------
CAUSE = "vLLM's engine core (pid 4242) died (killed by SIGKILL); the engine is stopped"


def _features(out, finish: bool = False) -> None:
    """A feature record of one full shard, its writer then lost with its process (a kill):
    the manifest says complete: false without a cause."""
    w = FeatureWriter(str(out), 2, "float32", 4, False, lambda: {})
    _append(w, req(0), [0, 1, 2, 3])
    if finish:
        w.finished(req(0))
        w.close()


def test_a_run_failure_marks_this_runs_manifests_with_the_cause(tmp_path):
    import time

    since = time.time()
    _features(tmp_path / "feat")
    assert fmt.RUN_ERROR not in _manifest(tmp_path / "feat")
    for rank in (0, 1):  # a data-parallel record: each part's manifest
        _features(tmp_path / "dp" / fmt.part_name(rank))
    marked = fmt.mark_run_failed(str(tmp_path / "feat"), CAUSE, since)
    marked += fmt.mark_run_failed(str(tmp_path / "dp"), CAUSE, since)
    assert len(marked) == 3
    for out in (tmp_path / "feat", tmp_path / "dp" / "dp0", tmp_path / "dp" / "dp1"):
        m = _manifest(out)
        assert m["complete"] is False and m[fmt.RUN_ERROR] == CAUSE
    with pytest.warns(IncompleteExportWarning, match=r"stopped by a fault: .*pid 4242.*SIGKILL"):
        recs = list(read_features(tmp_path / "feat"))
    assert [r.request_id for r in recs] == ["0"] and not recs[0].finished


def test_a_run_failure_leaves_an_earlier_export_alone(tmp_path):
    import time

    _features(tmp_path / "feat", finish=True)  # an earlier run's complete record
    before = _manifest(tmp_path / "feat")
    assert before["complete"] is True
    # This run (overwrite) died before its first write: the manifest is the earlier one's.
    assert fmt.mark_run_failed(str(tmp_path / "feat"), CAUSE, time.time() + 1) == []
    assert _manifest(tmp_path / "feat") == before
    assert fmt.mark_run_failed(str(tmp_path / "missing"), CAUSE, 0.0) == []


def test_tllmllm_tells_the_plugins_once_after_a_fault(tmp_path, caplog):
    """``TllmLLM`` after a fault (its engine processes gone): the plugins' ``tllm_run_failed``
    with the run's consumers and the cause; a failing hook is named, the others still run."""
    import time

    from tllm_core import hookimpl
    from tllm_core.app.engine import TllmLLM, validate_consumers
    from tllm_core.vllm_bridge.engine_watch import Death, EngineDiedError

    since = time.time()
    out = tmp_path / "acts"
    _features(out)  # the engine's export, as a kill left it
    checked = validate_consumers([{"name": "export", "config": {"out": str(out)}}])

    class Broken:
        @hookimpl
        def tllm_run_failed(self, consumers, cause, started_at):
            raise RuntimeError("broken plugin")

    checked.registry.register(Broken(), "broken")
    llm = TllmLLM.__new__(TllmLLM)  # the state a started engine has; no vLLM here
    llm._checked, llm._started_at, llm._failure_told = checked, since, False
    llm._died = EngineDiedError(Death("vLLM's engine core", 4242, "killed by SIGKILL"))
    llm._tell_run_failed()
    assert _manifest(out)[fmt.RUN_ERROR] == CAUSE
    assert "'broken'" in caplog.text and "broken plugin" in caplog.text
    (out / fmt.MANIFEST).unlink()
    llm._tell_run_failed()  # once only
    assert not (out / fmt.MANIFEST).exists()
