"""Unit tests of the ``export`` consumer and its reader (no vLLM: synthetic engine steps)."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from consumers.export import ExportReader, read_export
from consumers.export import format as fmt
from consumers.export.consumer import ExportConfig, ExportConsumer
from consumers.export.reader import ExportFormatError
from tllm_core.api.consumer import ConsumerContext, ModelInfo
from tllm_core.api.counters import Counters
from tllm_core.api.ports import Phase, resolve_layer
from tllm_core.api.rows import RequestInfo, RowInfo
from tllm_core.api.step import StepCapture
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.bus import Bus
from tllm_core.runtime.reads import build_bundle, plan_reads
from tllm_core.runtime.settings import RuntimeSettings

REPO = Path(__file__).resolve().parents[1]
H = 8
NUM_LAYERS = 4


# -- helpers ---------------------------------------------------------------------------------
def model_info(hidden: int = H, device: str = "cpu") -> ModelInfo:
    def no_head(_h):
        raise RuntimeError("no head in unit tests")

    return ModelInfo(
        hidden_size=hidden,
        num_layers=NUM_LAYERS,
        vocab_size=128,
        dtype=torch.float32,
        device=torch.device(device),
        lm_head=no_head,
        lm_head_weight=None,
    )


def context(hidden: int = H, device: str = "cpu") -> ConsumerContext:
    return ConsumerContext(
        model=model_info(hidden, device),
        resolve_layer=lambda i: resolve_layer(i, NUM_LAYERS),
        parse_port=Registry().parse_port,
    )


def make_export(out, hidden: int = H, device: str = "cpu", **cfg) -> ExportConsumer:
    return ExportConsumer(ExportConfig(out=str(out), **cfg), context(hidden, device))


def key_id(key: str) -> int:
    return 9 if key == "final" else int(key.split(".")[1])


def hidden_value(key: str, req: int, pos: int, hidden: int = H) -> torch.Tensor:
    """Deterministic, exactly representable in float32 (and recognisable)."""
    return key_id(key) * 100000.0 + req * 1000.0 + pos + torch.arange(hidden) * 0.25


def token_at(req: int, pos: int) -> int:
    return (req * 37 + pos * 11) % 97 + 3


class FakeEngine:
    """A tiny continuous-batching scheduler producing StepCaptures like the vLLM bridge."""

    def __init__(self, prompt_lens, max_new, keys, chunk: int = 1000, hidden: int = H):
        self.keys = keys
        self.chunk = chunk
        self.hidden = hidden
        self.step_no = 0
        self.state = []
        for i, (n, m) in enumerate(zip(prompt_lens, max_new, strict=True)):
            info = RequestInfo(
                engine_id=f"{i}-0-x",
                request_id=f"req{i}",
                prompt_index=i,
                sample_index=0,
                num_prompt_tokens=n,
                prompt_token_ids=tuple(token_at(i, p) for p in range(n)),  # as the runners
            )
            self.state.append(
                {
                    "i": i,
                    "info": info,
                    "tokens": [token_at(i, p) for p in range(n)],
                    "computed": 0,
                    "gen": 0,
                    "max_new": m,
                }
            )
        self.active = list(self.state)

    def preempt(self, i: int) -> None:
        self.state[i]["computed"] = 0

    def step(self) -> tuple[StepCapture, list[RequestInfo]]:
        self.step_no += 1
        req_list, pos_list, last_rows, kept = [], [], [], []
        sched = []
        for st in self.active:
            k = min(self.chunk, len(st["tokens"]) - st["computed"])
            pos = list(range(st["computed"], st["computed"] + k))
            req_list += [st["info"]] * k
            pos_list += pos
            last_rows.append(len(pos_list) - 1)
            kept.append(st["computed"] + k >= len(st["tokens"]))
            sched.append((st, k))
        positions = np.array(pos_list, np.int64)
        n_prompt = np.array([r.num_prompt_tokens for r in req_list], np.int64)
        seen = np.array([r.max_position_seen for r in req_list], np.int64)
        token_ids = torch.tensor(
            [
                self.state[r.prompt_index]["tokens"][p]
                for r, p in zip(req_list, pos_list, strict=True)
            ],
            dtype=torch.int64,
        )
        rows = RowInfo(
            row=np.arange(len(pos_list), dtype=np.int64),
            requests=req_list,
            position=positions,
            is_decode=positions >= n_prompt,
            recomputed=positions <= seen,
            token_ids=token_ids,
        )
        hidden = {
            key: torch.stack(
                [
                    hidden_value(key, r.prompt_index, p, self.hidden)
                    for r, p in zip(req_list, pos_list, strict=True)
                ]
            )
            for key in self.keys
        }
        sampled = []
        finished = []
        for (st, k), keep in zip(sched, kept, strict=True):
            st["computed"] += k
            if keep:
                tok = token_at(st["i"], len(st["tokens"]))
                sampled.append(tok)
                st["tokens"].append(tok)
                st["gen"] += 1
                if st["gen"] >= st["max_new"]:
                    finished.append(st["info"])
            else:
                sampled.append(-1)
        step = StepCapture(
            step=self.step_no,
            rows=rows,
            sample_token_row=np.array(last_rows, np.int64),
            sample_kept=np.array(kept),
            tensors={
                **{_tap_key(k): v for k, v in hidden.items()},
                "logits": torch.zeros(len(last_rows), 4),
                "sampled": torch.tensor(sampled, dtype=torch.int64),
            },
        )
        self.active = [st for st in self.active if st["info"] not in finished]
        return step, finished


PRODUCERS = Registry().producer_for


def _tap_key(key: str) -> str:
    """The bridge's tap key of a residual-stream bundle key (``layer.3`` -> ``residual.3``)."""
    return "residual." + key.split(".")[1] if key.startswith("layer.") else key


def run_engine(
    consumer,
    engine: FakeEngine,
    deliver,
    preempt_at: dict[int, int] | None = None,
    max_steps: int | None = None,
    bus: Bus | None = None,
) -> None:
    """Drive ``consumer`` like Runtime.end_step / finish_requests do (through ``bus`` when
    given: finish notices then reach the consumer after its queued bundles)."""
    plan = plan_reads(consumer.reads(), lambda i: resolve_layer(i, NUM_LAYERS), PRODUCERS)
    steps = 0
    while engine.active and (max_steps is None or steps < max_steps):
        if preempt_at and steps in preempt_at:
            engine.preempt(preempt_at[steps])
        step, finished = engine.step()
        steps += 1
        bundle = build_bundle(plan, step)
        if bundle is not None:
            deliver(bundle)
        for i, req in enumerate(step.rows.requests):
            req.max_position_seen = max(req.max_position_seen, int(step.rows.position[i]))
        for req in finished:
            if bus is None:
                consumer.on_request_finished(req)
            else:
                bus.finished(consumer, req)


def expected_positions(st, phase: str) -> list[int]:
    fed = range(len(st["tokens"]) - 1)  # the last sampled token is never fed
    n = st["info"].num_prompt_tokens
    if phase == "prefill":
        return [p for p in fed if p < n]
    if phase == "decode":
        return [p for p in fed if p >= n]
    return list(fed)


def check_records(records, engine: FakeEngine, keys, phase: str = "all", dtype=torch.float32):
    records = sorted(records, key=lambda r: r.prompt_index)
    assert [r.request_id for r in records] == [st["info"].request_id for st in engine.state]
    for rec, st in zip(records, engine.state, strict=True):
        assert rec.token_ids.tolist() == st["tokens"]
        assert rec.num_prompt_tokens == st["info"].num_prompt_tokens
        assert rec.sample_index == 0 and rec.finished
        want = expected_positions(st, phase)
        assert rec.positions.tolist() == want
        assert rec.is_decode.tolist() == [p >= rec.num_prompt_tokens for p in want]
        assert sorted(rec.hidden) == sorted(keys)
        for key in keys:
            h = rec.hidden[key]
            assert h.dtype == dtype and h.shape == (len(want), H)
            exp = (
                torch.stack([hidden_value(key, st["i"], p) for p in want])
                if want
                else torch.zeros(0, H)
            )
            torch.testing.assert_close(h, exp.to(dtype), rtol=0, atol=0)


def check_directory(out: Path) -> dict:
    """The crash-safety invariant: the manifest lists exactly the complete shard files."""
    manifest = json.loads((out / fmt.MANIFEST).read_text())
    listed = [s["file"] for s in manifest["shards"]]
    on_disk = sorted(p.name for p in out.iterdir() if fmt.SHARD_PATTERN.match(p.name))
    assert listed == on_disk[: len(listed)]
    for s in manifest["shards"]:
        digest, size = fmt.sha256_file(str(out / s["file"]))
        assert (digest, size) == (s["sha256"], s["bytes"])
        t = load_file(str(out / s["file"]))
        assert t["position"].shape[0] == s["rows"]
    assert manifest["num_rows"] == sum(s["rows"] for s in manifest["shards"])
    return manifest


# -- round trips -------------------------------------------------------------------------------
def test_round_trip_background_bus(tmp_path):
    out = tmp_path / "exp"
    c = make_export(out, layers=[1, -1, "final"], shard_rows=7)
    keys = ["layer.1", "layer.3", "final"]
    assert c.keys == keys
    engine = FakeEngine([5, 9, 3], [4, 6, 1], keys, chunk=4)
    bus = Bus(Counters(), RuntimeSettings(queue_size=2))
    run_engine(c, engine, lambda b: bus.publish(c, b), bus=bus)
    bus.flush()
    c.close()
    bus.close()
    assert not bus.errors
    manifest = check_directory(out)
    assert manifest["complete"] and manifest["keys"] == keys and manifest["hidden_size"] == H
    assert manifest["dtype"] == "float32" and manifest["version"] == fmt.FORMAT_VERSION
    total = sum(len(st["tokens"]) - 1 for st in engine.state)
    snap = c.counters.snapshot()
    assert snap["rows_exported"] == total == manifest["num_rows"]
    assert snap["shards_written"] == math.ceil(total / 7) == len(manifest["shards"])
    assert snap["requests_seen"] == 3
    assert snap["bytes_written"] == sum(s["bytes"] for s in manifest["shards"])
    check_records(list(read_export(out, verify=True)), engine, keys)
    res = c.result()
    assert res["rows"] == total and res["complete"] and res["out"] == str(out)
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())


@pytest.mark.parametrize("phase", ["prefill", "decode", "all"])
def test_phase_selects_rows_but_tokens_stay_complete(tmp_path, phase):
    out = tmp_path / phase
    c = make_export(out, layers=["final"], phase=phase, shard_rows=4)
    engine = FakeEngine([6, 2, 4], [3, 5, 1], ["final"], chunk=3)
    run_engine(c, engine, c.on_bundle)
    c.close()
    check_directory(out)
    check_records(read_export(out), engine, ["final"], phase=phase)


def test_a_decode_export_captures_no_prompt_rows(tmp_path):
    c = make_export(tmp_path / "d", layers=[0], phase="decode")
    hs = [p for p in c.reads() if hasattr(p, "layer")]
    # The prompt's ids come with the request (RequestInfo.prompt_token_ids): only decode
    # rows are cut into the bundle.
    assert hs and all(p.phase is Phase.DECODE for p in hs)
    assert any(type(p).__name__ == "SampledTokens" for p in c.reads())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_storage_dtype(tmp_path, dtype):
    out = tmp_path / dtype
    c = make_export(out, layers=[2], dtype=dtype, shard_rows=5)
    engine = FakeEngine([4, 3], [2, 2], ["layer.2"])
    run_engine(c, engine, c.on_bundle)
    c.close()
    recs = sorted(read_export(out), key=lambda r: r.prompt_index)
    want = getattr(torch, dtype)
    for rec, st in zip(recs, engine.state, strict=True):
        h = rec.hidden["layer.2"]
        assert h.dtype == want
        exp = torch.stack([hidden_value("layer.2", st["i"], p) for p in rec.positions.tolist()])
        torch.testing.assert_close(h, exp.to(want), rtol=0, atol=0)
    shard = load_file(str(out / fmt.shard_name(0)))
    assert shard["hidden.layer.2"].dtype == want


def test_recomputed_rows_are_skipped(tmp_path):
    out = tmp_path / "pre"
    c = make_export(out, layers=[0, "final"], shard_rows=6)
    engine = FakeEngine([5, 4], [6, 6], ["layer.0", "final"])
    # Preempt request 0 after three decode steps: its whole sequence is prefilled again.
    run_engine(c, engine, c.on_bundle, preempt_at={4: 0})
    c.close()
    snap = c.counters.snapshot()
    assert snap["rows_skipped_recomputed"] > 0
    total = sum(len(st["tokens"]) - 1 for st in engine.state)
    assert snap["rows_exported"] == total
    check_directory(out)
    check_records(read_export(out), engine, ["layer.0", "final"])


def test_many_samples_and_rows_of_one_request_across_shards(tmp_path):
    out = tmp_path / "n"
    c = make_export(out, layers=["final"], shard_rows=3)
    engine = FakeEngine([7, 7], [8, 8], ["final"])
    for st in engine.state[1:]:
        st["info"].request_id = "req0"
        st["info"].sample_index = 1
        st["info"].prompt_index = 1
    run_engine(c, engine, c.on_bundle)
    c.close()
    recs = sorted(read_export(out), key=lambda r: r.sample_index)
    assert [(r.request_id, r.sample_index) for r in recs] == [("req0", 0), ("req0", 1)]
    assert [r.token_ids.tolist() for r in recs] == [st["tokens"] for st in engine.state]


# -- bounded memory ------------------------------------------------------------------------------
def test_buffer_never_exceeds_one_shard(tmp_path):
    out = tmp_path / "b"
    c = make_export(out, layers=[1, "final"], shard_rows=5)
    engine = FakeEngine([23, 11, 2], [4, 9, 3], ["layer.1", "final"])
    plan = plan_reads(c.reads(), lambda i: resolve_layer(i, NUM_LAYERS), PRODUCERS)
    while engine.active:
        step, finished = engine.step()
        b = build_bundle(plan, step)
        if b is not None:
            c.on_bundle(b)
        assert c.writer.buffered < 5 and c.writer.capacity <= 5
        for i, req in enumerate(step.rows.requests):
            req.max_position_seen = max(req.max_position_seen, int(step.rows.position[i]))
        for r in finished:
            c.on_request_finished(r)
    c.close()
    snap = c.counters.snapshot()
    assert snap["buffer_rows_max"] <= 5
    manifest = check_directory(out)
    assert all(s["rows"] == 5 for s in manifest["shards"][:-1])
    assert 1 <= manifest["shards"][-1]["rows"] <= 5
    check_records(read_export(out), engine, ["layer.1", "final"])


def test_shard_bytes_sets_rows_per_shard(tmp_path):
    c = make_export(tmp_path / "sb", layers=[0, "final"], shard_bytes=3 * 2 * H * 4)
    assert c.shard_rows == 3
    c2 = make_export(tmp_path / "sb2", layers=[0], dtype="float16", shard_bytes=10 * H * 2 + 1)
    assert c2.shard_rows == 10
    with pytest.raises(ValueError, match="smaller than one row"):
        make_export(tmp_path / "sb3", layers=[0], shard_bytes=H * 4 - 1)


# -- crash safety ------------------------------------------------------------------------------
def test_interrupted_run_holds_only_complete_shards(tmp_path):
    out = tmp_path / "crash"
    c = make_export(out, layers=["final"], shard_rows=4)
    engine = FakeEngine([9, 6, 5], [10, 10, 10], ["final"], chunk=4)
    run_engine(c, engine, c.on_bundle, max_steps=6)  # no close(): the process "dies" here
    assert c.writer.buffered > 0
    # Leftovers of a write that was cut short.
    (out / "shard-00099.safetensors.tmp").write_bytes(b"garbage")
    (out / "manifest.json.tmp").write_text("{not json")
    manifest = check_directory(out)
    assert not manifest["complete"]
    n_rows = manifest["num_rows"]
    assert n_rows == c.counters.get("rows_exported") > 0
    recs = list(read_export(out, verify=True))
    assert sum(len(r.positions) for r in recs) == n_rows
    for rec in recs:
        st = engine.state[rec.prompt_index]
        assert rec.token_ids.tolist() == st["tokens"][: len(rec.token_ids)]
        assert all(p < len(rec.token_ids) for p in rec.positions.tolist())
        exp = [hidden_value("final", st["i"], p) for p in rec.positions.tolist()]
        if exp:
            torch.testing.assert_close(rec.hidden["final"], torch.stack(exp), rtol=0, atol=0)


def test_failure_during_shard_write(tmp_path, monkeypatch):
    out = tmp_path / "fail"
    c = make_export(out, layers=["final"], shard_rows=3)
    real_replace = os.replace
    calls = {"n": 0}

    def flaky_replace(src, dst):
        if str(dst).endswith(".safetensors"):
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError("disk gone")
        return real_replace(src, dst)

    monkeypatch.setattr("consumers.export.writer.os.replace", flaky_replace)
    engine = FakeEngine([4, 4, 4], [5, 5, 5], ["final"])
    with pytest.raises(OSError, match="disk gone"):
        run_engine(c, engine, c.on_bundle)
    assert not (out / "shard-00002.safetensors.tmp").exists()  # removed after the failure
    assert not (out / "shard-00002.safetensors").exists()
    manifest = check_directory(out)
    assert [s["file"] for s in manifest["shards"]] == [fmt.shard_name(0), fmt.shard_name(1)]
    recs = list(read_export(out))
    assert sum(len(r.positions) for r in recs) == 6
    snap = c.counters.snapshot()  # the shards on disk, written in the call that failed too
    assert (snap.get("shards_written"), snap.get("rows_exported")) == (2, 6), snap


_KILL_SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np, torch
    from consumers.export.consumer import ExportConfig, ExportConsumer
    from tllm_core.api.bundles import Bundle
    from tllm_core.api.consumer import ConsumerContext, ModelInfo
    from tllm_core.api.ports import resolve_layer
    from tllm_core.api.rows import RequestInfo, RowInfo
    H = 512
    info = ModelInfo(H, 4, 128, torch.float32, torch.device("cpu"), None, None)
    ctx = ConsumerContext(info, lambda i: resolve_layer(i, 4))
    c = ExportConsumer(ExportConfig(out=sys.argv[1], layers=["final"], shard_rows=96), ctx)
    r = 0
    while True:
        req = RequestInfo(f"e{r}", f"r{r}", r, 0, 40)
        pos = np.arange(40, dtype=np.int64)
        rows = RowInfo(pos.copy(), [req] * 40, pos, np.zeros(40, bool), np.zeros(40, bool),
                       torch.from_numpy((pos * 7 + r) % 50))
        h = r * 1000.0 + torch.from_numpy(pos).float()[:, None] + torch.arange(H) * 0.25
        c.on_bundle(Bundle(step=r, rows=rows, hidden={"final": h}))
        r += 1
        if r == 8:
            print("ready", flush=True)
    """
)


def test_sigkill_mid_run_leaves_consistent_directory(tmp_path):
    out = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_SCRIPT, str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == b"ready", proc.stderr.read().decode()
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    manifest = check_directory(out)
    assert len(manifest["shards"]) >= 3
    reader = ExportReader(out, verify=True)
    seen = 0
    for rec in reader:
        r = int(rec.request_id[1:])
        pos = rec.positions
        exp = r * 1000.0 + pos.float()[:, None] + torch.arange(512) * 0.25
        torch.testing.assert_close(rec.hidden["final"], exp, rtol=0, atol=0)
        assert rec.token_ids[pos].tolist() == ((pos * 7 + r) % 50).tolist()
        seen += len(pos)
    assert seen == manifest["num_rows"]


# -- reader ------------------------------------------------------------------------------------
def test_reader_streams_shard_by_shard(tmp_path, monkeypatch):
    out = tmp_path / "lazy"
    c = make_export(out, layers=["final"], shard_rows=2)
    engine = FakeEngine([2, 3, 3], [1, 8, 8], ["final"])  # req0 finishes at once
    run_engine(c, engine, c.on_bundle)
    c.close()
    reader = ExportReader(out)
    loaded = []
    real = ExportReader.load_shard

    def spy(self, i, keys=None):
        loaded.append(i)
        return real(self, i, keys)

    monkeypatch.setattr(ExportReader, "load_shard", spy)
    it = iter(reader)
    first = next(it)
    assert first.request_id == "req0"
    assert len(loaded) < len(reader.shards)
    rest = list(it)
    assert len(rest) == 2 and sorted(loaded) == list(range(len(reader.shards)))


def test_reader_errors(tmp_path):
    with pytest.raises(ExportFormatError, match="manifest"):
        read_export(tmp_path)
    out = tmp_path / "e"
    c = make_export(out, layers=["final"], shard_rows=2)
    run_engine(c, FakeEngine([3], [2], ["final"]), c.on_bundle)
    c.close()
    (out / fmt.shard_name(0)).write_bytes(b"corrupt")
    with pytest.raises(ExportFormatError, match="sha256"):
        list(read_export(out, verify=True))
    os.remove(out / fmt.shard_name(0))
    with pytest.raises(ExportFormatError, match="missing"):
        list(read_export(out))


# -- settings and dry build ------------------------------------------------------------------------
def test_dry_build_close_writes_nothing(tmp_path):
    out = tmp_path / "new" / "deeper"
    c = make_export(out, device="meta")
    assert c.keys == ["layer.3", "final"]  # default layers [-1, "final"]
    c.close()
    c.close()
    assert not (tmp_path / "new").exists()
    assert c.result()["shards"] == 0


def test_out_under_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        make_export(f / "sub" / "dir")
    with pytest.raises(ValueError, match="not a directory"):
        make_export(f)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_parent(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="cannot write to it"):
            make_export(ro / "x")
    finally:
        ro.chmod(0o700)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_out_where_nothing_can_be_made_is_refused_before_generation(tmp_path):
    """Permission bits do not tell for root or a pseudo file system: the check makes a folder
    there and removes it, and leaves nothing behind when it can."""
    bad = r"cannot create out='/proc/nope' in '/proc': (\w+Error|this process cannot write)"
    with pytest.raises(ValueError, match=bad):
        make_export("/proc/nope")
    make_export(tmp_path / "new").close()
    assert os.listdir(tmp_path) == []
    # Another engine's check (data parallel: each checks the same out at once) is not a file
    # of this folder: it stays empty to the others.
    from consumers.export.writer import PROBE_PREFIX, check_output_dir

    (tmp_path / f"{PROBE_PREFIX}x1y2").touch()
    assert check_output_dir(str(tmp_path), overwrite=False) == str(tmp_path)


def test_non_empty_dir_needs_overwrite(tmp_path):
    out = tmp_path / "old"
    c = make_export(out, layers=["final"], shard_rows=2)
    run_engine(c, FakeEngine([3, 3], [3, 3], ["final"]), c.on_bundle)
    c.close()
    (out / "notes.txt").write_text("keep me")
    (out / ".tmpK2wYzx").write_bytes(b"\0" * 64)  # safetensors' own, left by a killed write
    old_shards = len(json.loads((out / fmt.MANIFEST).read_text())["shards"])
    assert old_shards > 1
    with pytest.raises(ValueError, match="not empty.*overwrite=true .tllm export: --overwrite"):
        make_export(out, layers=["final"])
    c2 = make_export(out, layers=["final"], shard_rows=100, overwrite=True)
    c2.close()  # unused: old export untouched
    assert (out / fmt.shard_name(1)).exists()
    run_engine(c2, FakeEngine([2], [2], ["final"]), c2.on_bundle)
    c2.close()
    names = sorted(p.name for p in out.iterdir())
    assert names == [fmt.MANIFEST, "notes.txt", fmt.REQUESTS_FILE, fmt.shard_name(0)]
    assert len(list(read_export(out))) == 1


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        make_export(tmp_path / "a", layers=[NUM_LAYERS])
    with pytest.raises(ValidationError, match="not both"):
        ExportConfig(out=str(tmp_path), shard_rows=3, shard_bytes=1000)
    with pytest.raises(ValidationError):
        ExportConfig(out=str(tmp_path), layers=[])
    with pytest.raises(ValidationError):
        ExportConfig(out=str(tmp_path), layers=["last"])
    with pytest.raises(ValidationError):
        ExportConfig(out=str(tmp_path), phase="decoded")
    with pytest.raises(ValidationError):
        ExportConfig(out=str(tmp_path), dtype="int8")
    with pytest.raises(ValidationError):
        ExportConfig(out=str(tmp_path), shard_row=3)  # typo: extra fields are errors
    with pytest.raises(ValidationError):
        ExportConfig(out=" ")
    with pytest.raises(ValidationError):
        ExportConfig()
    with pytest.raises(ValueError, match=r"layers entry 'bogus\.1'.*attn\.\{i\}"):
        make_export(tmp_path / "p", layers=["bogus.1"])
    # Duplicates after resolution collapse to one key.
    c = make_export(tmp_path / "dup", layers=[-1, NUM_LAYERS - 1, "final", "final"])
    assert c.keys == ["layer.3", "final"]


# -- honest records: complete only when nothing was lost ---------------------------------------
def _finish_rest(c, engine, cut_short: bool) -> list[str]:
    """What ``RunnerHooks.finish_all`` does after an interrupted batch: the requests still
    running get their finish notice, marked ``cut_short`` when they were aborted."""
    ids = []
    for st in engine.active:
        st["info"].cut_short = cut_short
        c.on_request_finished(st["info"])
        ids.append(st["info"].request_id)
    return ids


def test_cut_short_requests_make_the_export_incomplete(tmp_path):
    from consumers.export import IncompleteExportWarning

    out = tmp_path / "cut"
    c = make_export(out, layers=["final"], shard_rows=5)
    engine = FakeEngine([4, 4, 4], [1, 20, 20], ["final"], chunk=4)
    run_engine(c, engine, c.on_bundle, max_steps=4)  # request 0 finished on its own
    cut = _finish_rest(c, engine, cut_short=True)  # aborted (Ctrl-C): 1 and 2
    assert cut == ["req1", "req2"]
    c.close()
    manifest = check_directory(out)
    assert manifest["complete"] is False and c.result()["complete"] is False
    assert manifest["losses"] == {
        "requests_unfinished": 2,
        "positions_missing": 0,
        "bundles_dropped": 0,
    }
    table = fmt.request_table(str(out), manifest)
    assert {r["request_id"]: r["finished"] for r in table} == {
        "req0": True,
        "req1": False,
        "req2": False,
    }
    assert c.counters.get("requests_cut_short") == 2
    with pytest.warns(IncompleteExportWarning, match="requests_unfinished: 2"):
        recs = {r.request_id: r for r in read_export(out, verify=True)}
    assert recs["req0"].finished and not recs["req1"].finished


def test_a_batch_that_ran_to_its_end_is_complete(tmp_path, recwarn):
    out = tmp_path / "whole"
    c = make_export(out, layers=["final"], shard_rows=5)
    engine = FakeEngine([4, 4], [2, 3], ["final"], chunk=4)
    run_engine(c, engine, c.on_bundle)
    c.close()
    manifest = check_directory(out)
    assert manifest["complete"] is True and not any(manifest["losses"].values())
    table = fmt.request_table(str(out), manifest)
    assert all(r["finished"] and r["positions_missing"] == 0 for r in table)
    list(read_export(out))
    assert not recwarn.list  # a complete export reads without a warning


def test_dropped_bundles_make_the_export_incomplete(tmp_path):
    import threading

    out = tmp_path / "drop"
    c = make_export(out, layers=["final"], shard_rows=5)
    engine = FakeEngine([4, 4], [6, 6], ["final"], chunk=4)
    bus = Bus(Counters(), RuntimeSettings(queue_size=1, overflow="drop"))
    gate = threading.Event()
    take = c.on_bundle

    def slow(bundle):  # the consumer falls behind: the queue fills and bundles are dropped
        gate.wait(10)
        take(bundle)

    c.on_bundle = slow
    run_engine(c, engine, lambda b: bus.publish(c, b), bus=bus)
    gate.set()
    assert bus.flush(10)
    c.close()
    bus.close()
    dropped = bus.counters.get("bundles_dropped.export")
    assert dropped > 0
    manifest = check_directory(out)
    assert manifest["complete"] is False
    assert manifest["losses"]["bundles_dropped"] == dropped
    assert all(r["bundles_dropped"] > 0 for r in fmt.request_table(str(out), manifest))


def test_missing_prompt_positions_make_the_export_incomplete(tmp_path):
    """Prefix caching: the cached prompt positions are never computed, so no rows exist for
    them (their token ids come with the request); the manifest says how many are missing."""
    out = tmp_path / "cached"
    c = make_export(out, layers=["final"], shard_rows=5)
    engine = FakeEngine([8], [2], ["final"], chunk=4)
    first = [True]

    def deliver(bundle):
        if first[0]:  # the first prompt chunk came from the prefix cache
            first[0] = False
            return
        c.on_bundle(bundle)

    run_engine(c, engine, deliver)
    c.close()
    manifest = check_directory(out)
    assert manifest["complete"] is False
    assert manifest["losses"] == {
        "requests_unfinished": 0,
        "positions_missing": 4,
        "bundles_dropped": 0,
    }
    (entry,) = fmt.request_table(str(out), manifest)
    assert entry["finished"] is True
    assert entry["token_ids"][:4] == [token_at(0, p) for p in range(4)]
    assert entry["positions_missing"] == 4


# -- bounded state: a long-running server --------------------------------------------------------
def test_finished_requests_leave_memory_and_the_manifest(tmp_path):
    """Each manifest rewrite carries only the requests still running; finished ones are
    appended once to requests.jsonl, so memory and bytes written per shard stay flat however
    many requests were served (not every token id ever seen, rewritten per shard)."""
    out = tmp_path / "serve"
    c = make_export(out, layers=["final"], shard_rows=4)
    manifest_sizes = []
    real = c.writer.write_manifest

    def measured():  # the manifest less its shard list (one entry per shard, by design)
        real()
        m = json.loads((out / fmt.MANIFEST).read_text())
        manifest_sizes.append(len(json.dumps({**m, "shards": None})))

    c.writer.write_manifest = measured
    for wave in range(40):  # one request at a time, as a server answering short requests
        engine = FakeEngine([3], [2], ["final"])
        engine.state[0]["info"].engine_id = f"{wave}-0-x"
        engine.state[0]["info"].request_id = f"w{wave}"
        run_engine(c, engine, c.on_bundle)
        assert c.result()["requests_open"] == 0
    assert c.result()["requests"] == 40 and manifest_sizes
    half = len(manifest_sizes) // 2  # flat: the later manifests are no larger (but digits)
    assert max(manifest_sizes[half:]) <= max(manifest_sizes[:half]) + 8
    c.close()
    lines = (out / fmt.REQUESTS_FILE).read_text().splitlines()
    assert len(lines) == 40
    recs = {r.request_id: r for r in read_export(out, verify=True)}
    assert sorted(recs) == sorted(f"w{i}" for i in range(40))
    assert all(r.finished and len(r.positions) == 4 for r in recs.values())


def test_reader_uses_only_the_requests_file_lines_its_manifest_names(tmp_path):
    """A crash after a request was closed but before the next manifest: the later lines
    (and a torn last line) are not read; a file shorter than the manifest says is an error."""
    out = tmp_path / "torn"
    c = make_export(out, layers=["final"], shard_rows=4)
    run_engine(c, FakeEngine([3, 3], [2, 2], ["final"]), c.on_bundle)
    c.close()
    manifest = json.loads((out / fmt.MANIFEST).read_text())
    assert manifest["requests_closed"] == 2 and manifest["requests"] == []
    with open(out / fmt.REQUESTS_FILE, "a") as f:
        f.write('{"index": 2, "torn')
    assert len(ExportReader(out)) == 2
    (out / fmt.REQUESTS_FILE).write_text((out / fmt.REQUESTS_FILE).read_text().split("\n")[0])
    with pytest.raises(ExportFormatError, match="holds 1 requests, the manifest says 2"):
        ExportReader(out)


def test_reader_reads_version_1_manifests(tmp_path):
    """Version 1 kept the whole request table in the manifest (no index field)."""
    out = tmp_path / "v1"
    c = make_export(out, layers=["final"], shard_rows=4)
    run_engine(c, FakeEngine([3, 3], [2, 2], ["final"]), c.on_bundle)
    c.close()
    m = json.loads((out / fmt.MANIFEST).read_text())
    table = fmt.request_table(str(out), m)
    for e in table:
        del e["index"]
    m.update(version=1, requests=table)
    del m["requests_closed"], m["requests_file"]
    (out / fmt.MANIFEST).write_text(json.dumps(m))
    (out / fmt.REQUESTS_FILE).unlink()
    assert sorted(r.request_id for r in read_export(out)) == ["req0", "req1"]


# -- token bookkeeping: one split of a bundle into request runs, a cheap one-row run ----------
def _count_calls(monkeypatch, owner, name: str) -> list:
    """Record the calls of ``owner.name`` (still calling it); a name ``owner`` lacks is set
    anyway, so a path that is gone counts 0 instead of erroring."""
    calls: list = []
    real = getattr(owner, name, None)

    def spy(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(owner, name, spy, raising=False)
    return calls


def test_one_row_runs_take_the_one_row_path_with_the_same_tokens(tmp_path, monkeypatch):
    """Decode: each request adds one row per step. Those runs take the one-row path (no numpy
    fancy indexing), and leave the same table as multi-row runs of the same ids."""
    from consumers.export.requests import RequestTokens

    def table_after(batches):
        c = make_export(tmp_path / f"t{len(batches)}", layers=["final"], shard_rows=4)
        for reqs, pos, ids in batches:
            c._note(reqs, np.array(pos, np.int64), np.array(ids, np.int64))
        return {
            e: (r.tokens[: r.length].tolist(), r.fed[: r.length].tolist(), r.length)
            for e, r in c.writer.table._open.items()
        }

    a, b = (RequestInfo(f"{i}-x", f"r{i}", i, 0, 3, prompt_token_ids=(7, 8, 9)) for i in (0, 1))
    # Past the first allocation (3 + 16 slots): the one-row path grows the arrays too.
    decode = [([a, b], [p, p + 1], [p, 100 + p]) for p in range(3, 30)]
    batched = [
        (
            [a] * 27 + [b] * 27,
            list(range(3, 30)) + list(range(4, 31)),
            list(range(3, 30)) + [100 + p for p in range(3, 30)],
        )
    ]
    one = _count_calls(monkeypatch, RequestTokens, "put_one")
    assert table_after(decode) == table_after(batched)
    assert len(one) == 2 * 27  # every one-row run, and only those


def test_a_bundle_is_split_into_request_runs_once(tmp_path, monkeypatch):
    """One walk over a bundle's rows finds its request runs: token ids and the rows returned
    to asking requests both use it (the sampled rows are their own split)."""
    import consumers.export.writer as writer_mod
    import tllm_core.api.rows as rows_mod

    c = make_export(tmp_path / "runs", layers=["final"], shard_rows=4)
    engine = FakeEngine([3, 4], [2, 2], ["final"])
    plan = plan_reads(c.reads(), lambda i: resolve_layer(i, NUM_LAYERS), PRODUCERS)
    bundle = build_bundle(plan, engine.step()[0])
    bundle.sampled_rows = None  # the token rows only
    splits = _count_calls(monkeypatch, rows_mod, "request_runs")
    monkeypatch.setattr(writer_mod, "request_runs", rows_mod.request_runs)
    c.on_bundle(bundle)
    assert len(splits) == 1
    assert c.writer.table.seen == 2  # both requests' ids were noted


def test_a_bundle_without_a_port_or_of_the_wrong_width_fails_naming_it(tmp_path):
    """A tap the step did not write leaves its port out of the bundle (see StaleTapError):
    the consumer says which, and writes nothing of that bundle."""
    from tllm_core.api.bundles import Bundle

    c = make_export(tmp_path / "out", layers=[1])
    (key,) = c.keys
    r = RequestInfo(
        engine_id="0-a",
        request_id="0",
        prompt_index=0,
        sample_index=0,
        num_prompt_tokens=2,
        extra_args={},
    )
    rows = RowInfo(
        row=np.arange(2),
        requests=[r, r],
        position=np.array([0, 1]),
        is_decode=np.zeros(2, np.bool_),
        recomputed=np.zeros(2, np.bool_),
        token_ids=torch.tensor([5, 6]),
    )
    with pytest.raises(ValueError, match=rf"export: bundle lacks '{key}' \(has \[\]\)"):
        c.on_bundle(Bundle(step=0, rows=rows, hidden={}))
    c.on_bundle(Bundle(step=0, rows=rows, hidden={key: torch.zeros(2, H)}))
    with pytest.raises(
        ValueError, match=rf"export: '{key}' has shape \(2, {H + 1}\), expected \(2, {H}\)"
    ):
        c.on_bundle(Bundle(step=1, rows=rows, hidden={key: torch.zeros(2, H + 1)}))
    c.close()


def _rewrite_shard(path: Path, change) -> None:
    from safetensors.torch import save_file

    t = load_file(str(path))
    change(t)
    save_file(t, str(path))


def _rewrite_manifest(out: Path, change) -> None:
    m = json.loads((out / fmt.MANIFEST).read_text())
    (out / fmt.MANIFEST).write_text(json.dumps(change(m)))


def _rewrite_requests(out: Path, change) -> None:
    path = out / fmt.REQUESTS_FILE
    path.write_text("\n".join(change(path.read_text().splitlines())) + "\n")


_DAMAGE = {
    # file cut by a full disk or a copy stopped half way; a file of another program
    "truncated shard": (
        lambda o: (o / fmt.shard_name(1)).write_bytes((o / fmt.shard_name(1)).read_bytes()[:100]),
        r"shard-00001\.safetensors' cannot be read",
    ),
    "empty shard": (
        lambda o: (o / fmt.shard_name(0)).write_bytes(b""),
        r"shard-00000\.safetensors' cannot be read",
    ),
    "shard without a column": (
        lambda o: _rewrite_shard(o / fmt.shard_name(0), lambda t: t.pop("hidden.final")),
        r"shard-00000\.safetensors' cannot be read.*hidden\.final",
    ),
    "shard of another dtype": (
        lambda o: _rewrite_shard(
            o / fmt.shard_name(0), lambda t: t.update({"hidden.final": t["hidden.final"].half()})
        ),
        r"shard-00000\.safetensors'.*'final' is torch\.float16.*torch\.float32",
    ),
    "shard of another width": (
        lambda o: _rewrite_shard(
            o / fmt.shard_name(0),
            lambda t: t.update({"hidden.final": t["hidden.final"].repeat(1, 2)}),
        ),
        r"shard-00000\.safetensors'.*'final'.*shape \(4, 16\).*width 8",
    ),
    "shard with a short column": (
        lambda o: _rewrite_shard(
            o / fmt.shard_name(0), lambda t: t.update({"hidden.final": t["hidden.final"][:2]})
        ),
        r"shard-00000\.safetensors' has 2 rows, the manifest: 4",
    ),
    "manifest dtype differs": (
        lambda o: _rewrite_manifest(o, lambda m: {**m, "dtype": "float16"}),
        r"'final' is torch\.float32.*the manifest says torch\.float16",
    ),
    "manifest without keys": (
        lambda o: _rewrite_manifest(o, lambda m: {k: v for k, v in m.items() if k != "keys"}),
        r"manifest\.json' lacks a field or has a bad one: KeyError\('keys'\)",
    ),
    "manifest with an unknown dtype": (
        lambda o: _rewrite_manifest(o, lambda m: {**m, "dtype": "float7"}),
        r"manifest\.json' lacks a field or has a bad one.*float7",
    ),
    "manifest that is a list": (
        lambda o: (o / fmt.MANIFEST).write_text("[]"),
        r"manifest\.json' is not a tllm-export manifest",
    ),
    "manifest of a newer version": (
        lambda o: _rewrite_manifest(o, lambda m: {**m, "version": 3}),
        r"manifest\.json' has format version 3; this reader reads versions 1 to 2",
    ),
    "request entry without token ids": (
        lambda o: (o / fmt.REQUESTS_FILE).write_text(
            "".join(
                json.dumps({k: v for k, v in json.loads(line).items() if k != "token_ids"}) + "\n"
                for line in (o / fmt.REQUESTS_FILE).read_text().splitlines()
            )
        ),
        r"request \d has a bad entry: KeyError\('token_ids'\)",
    ),
    "requests file line not JSON": (
        lambda o: _rewrite_requests(o, lambda lines: [lines[0], "{torn"]),
        r"requests\.jsonl' line 2: not valid JSON",
    ),
    "request entry without an index": (
        lambda o: _rewrite_requests(o, lambda lines: [json.dumps({"finished": True}), *lines[1:]]),
        r"requests\.jsonl' line 1: not a request entry \(a JSON object with a whole-number "
        r"\"index\"\)",
    ),
    "manifest without its requests": (
        lambda o: _rewrite_manifest(o, lambda m: {k: v for k, v in m.items() if k != "requests"}),
        r"manifest\.json' lacks a field or has a bad one: KeyError\('requests'\)",
    ),
    "requests file missing": (
        lambda o: (o / fmt.REQUESTS_FILE).unlink(),
        r"requests\.jsonl' cannot be read \(No such file or directory\); the manifest lists 2",
    ),
    "position past the token ids": (
        lambda o: _rewrite_shard(
            o / fmt.shard_name(0), lambda t: t["position"].__setitem__(0, 10**6)
        ),
        r"request \d has rows at positions \d+\.\.1000000, outside its \d+ token ids",
    ),
}


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_a_damaged_export_is_an_error_naming_the_file(tmp_path, damage):
    """A shard cut short, of the wrong dtype or width, a manifest lacking fields: an
    ExportFormatError naming the file and what is wrong, not a safetensors/torch/KeyError
    traceback (nor, for a dtype or width mismatch, records read silently)."""
    out = tmp_path / "e"
    c = make_export(out, layers=["final"], shard_rows=4)
    run_engine(c, FakeEngine([5, 3], [4, 4], ["final"]), c.on_bundle)
    c.close()
    assert len(list(read_export(out))) == 2  # undamaged, it reads
    change, message = _DAMAGE[damage]
    change(out)
    with pytest.raises(ExportFormatError, match=message):
        list(read_export(out))


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_exports_writing_one_folder_at_once_the_second_is_refused(tmp_path, overwrite):
    """Two runs (or an export and an sae consumer) given one out, both built while it was
    empty: the second's first write is refused naming the folder, and nothing of the first
    is removed or mixed (with overwrite it removed the first's files, and both wrote
    shard-00000...). Once the first is closed, the folder is free again."""
    out = tmp_path / "shared"
    first = make_export(out, layers=["final"], shard_rows=4, overwrite=overwrite)
    second = make_export(out, layers=["final"], shard_rows=4, overwrite=overwrite)
    engine = FakeEngine([6, 6], [6, 6], ["final"])
    run_engine(first, engine, first.on_bundle, max_steps=2)
    with pytest.raises(OSError, match=r"is being written by another export.*nothing was written"):
        run_engine(second, FakeEngine([9], [3], ["final"]), second.on_bundle)
    run_engine(first, engine, first.on_bundle)
    first.close()
    check_records(read_export(out, verify=True), engine, ["final"])
    third = make_export(out, layers=["final"], shard_rows=4, overwrite=True)
    engine = FakeEngine([3], [2], ["final"])
    run_engine(third, engine, third.on_bundle)
    third.close()
    check_records(read_export(out, verify=True), engine, ["final"])


@pytest.mark.parametrize("first, second", [((0, 1), (0, 2)), ((0, 2), (0, 1))])
def test_overwrite_removes_no_export_of_another_layout_being_written(tmp_path, first, second):
    """A plain export running in out and a data-parallel one started there with overwrite
    (or the reverse): the second is refused before it removes anything of the first."""
    from types import SimpleNamespace

    from consumers.export.writer import RecordWriter, output_layout

    def writer(rank_size):
        meta = {"hidden_size": 8, "num_layers": 1, "dtype": "float32"}
        meta.update(keys=["final"], phase="all")
        layout = output_layout(str(tmp_path / "acts"), True, *rank_size)
        return RecordWriter(layout, {"final": (8, torch.float32)}, 4, lambda: meta)

    def write(w, i):
        req = [SimpleNamespace(engine_id=f"e{i}", request_id=str(i), prompt_index=i,
                               sample_index=0, num_prompt_tokens=4, prompt_token_ids=None,
                               cut_short=False, window=lambda o: None)] * 4  # fmt: skip
        pos = np.arange(4)
        idx = w.note_tokens(req, pos, pos + 100)
        w.write_rows(idx, pos, pos + 100, np.zeros(4, bool), {"final": torch.randn(4, 8)})

    a = writer(first)
    write(a, 0)  # a shard written, the folder locked
    b = writer(second)
    with pytest.raises(Exception, match="being written by another export"):
        write(b, 1)
    write(a, 2)
    a.close()
    assert len(list(read_export(a.path, verify=True))) == 2


def test_a_file_system_without_locks_still_exports(tmp_path, monkeypatch, caplog):
    """flock refused by the file system (ENOLCK on some network file systems): the export is
    written as before, without the one-writer lock."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "nfs"
    c = make_export(out, layers=["final"], shard_rows=4)
    engine = FakeEngine([5, 3], [4, 4], ["final"])
    with caplog.at_level(logging.WARNING, logger="tllm"):
        run_engine(c, engine, c.on_bundle)
    c.close()
    check_records(read_export(out, verify=True), engine, ["final"])
    assert "cannot be locked (No locks available)" in caplog.text  # said, once
    assert caplog.text.count("cannot be locked") == 1


def test_shards_are_as_readable_as_their_folder(tmp_path):
    """safetensors writes 0600 files: in a folder colleagues may read (a shared project dir,
    0775), the manifest and request file were readable and the shards not."""
    out = tmp_path / "shared"
    out.mkdir()
    out.chmod(0o775)
    c = make_export(out, layers=["final"], shard_rows=4)
    run_engine(c, FakeEngine([5, 3], [4, 4], ["final"]), c.on_bundle)
    c.close()
    shards = sorted(out.glob("shard-*.safetensors"))
    assert len(shards) > 1
    assert {oct(p.stat().st_mode & 0o777) for p in shards} == {oct(0o664)}


def test_verify_hashes_each_shard_once(tmp_path, monkeypatch):
    """read_export(verify=True) opens each shard twice (its request rows, then its data): it
    hashed the whole file both times, reading every byte of a large export twice more."""
    out = tmp_path / "v"
    c = make_export(out, layers=["final"], shard_rows=4)
    engine = FakeEngine([5, 3], [4, 4], ["final"])
    run_engine(c, engine, c.on_bundle)
    c.close()
    hashed = []
    real = fmt.sha256_file
    monkeypatch.setattr(fmt, "sha256_file", lambda p, *a: hashed.append(p) or real(p, *a))
    reader = ExportReader(out, verify=True)
    check_records(list(reader), engine, ["final"])
    assert sorted(hashed) == sorted(str(out / s["file"]) for s in reader.shards)


def test_a_position_written_twice_keeps_its_first_row(tmp_path):
    """Rows of one position in two shards (out of order, the second a recomputation): the
    record has each position once, in order, with the row written first."""
    from consumers.sae.features import FeatureWriter, read_features

    out = tmp_path / "dup"
    w = FeatureWriter(str(out), 1, "float32", 2, False, lambda: {})
    r = RequestInfo("0-x", "0", 0, 0, 2)
    for pos, val in (([2, 0], [20.0, 0.0]), ([1, 2], [10.0, 99.0]), ([3], [30.0])):
        n = len(pos)
        p = np.array(pos)
        w.append(
            [r] * n,
            p,
            p + 5,
            p >= 2,
            torch.zeros(n, 1, dtype=torch.int32),
            torch.tensor(val)[:, None],
        )
    w.finished(r)
    w.close()
    (rec,) = read_features(out)
    assert rec.positions.tolist() == [0, 1, 2, 3]
    assert rec.values[:, 0].tolist() == [0.0, 10.0, 20.0, 30.0]
    assert rec.is_decode.tolist() == [False, False, True, True]


def test_the_reader_expands_home_like_the_writer(tmp_path, monkeypatch):
    """out='~/acts' is written to $HOME/acts; read_export('~/acts') must find it there (it
    looked for a folder literally named '~')."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    c = make_export("~/acts", layers=["final"], shard_rows=4)
    engine = FakeEngine([5, 3], [4, 4], ["final"])
    run_engine(c, engine, c.on_bundle)
    c.close()
    assert (tmp_path / "acts" / fmt.MANIFEST).is_file()
    check_records(read_export("~/acts"), engine, ["final"])
    assert len(ExportReader("~/acts")) == 2


def test_a_path_that_is_no_directory_is_named_as_such(tmp_path):
    from consumers.export import read_export

    (tmp_path / "f").write_text("x")
    for path, said in [
        (tmp_path / "nope", "does not exist"),
        (tmp_path / "f", "is a file"),
        (tmp_path, "holds no manifest.json"),
    ]:
        with pytest.raises(ExportFormatError, match=said):
            list(read_export(path))
