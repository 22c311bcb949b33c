"""``export`` under data parallel (no vLLM): each engine writes its own part folder of one
``out`` directory, and the reader merges the parts (docs/scaling.md, docs/export-format.md)."""

from __future__ import annotations

import json
import shutil

import pytest
from test_export_unit import (
    NUM_LAYERS,
    FakeEngine,
    check_directory,
    check_records,
    model_info,
    run_engine,
)

from consumers.export import DataParallelExport, ExportReader, open_export, read_export
from consumers.export import format as fmt
from consumers.export.consumer import ExportConfig, ExportConsumer
from consumers.export.reader import ExportFormatError
from tllm_core.api.consumer import ConsumerContext
from tllm_core.api.ports import resolve_layer
from tllm_core.plugins.registry import Registry

KEYS = ["layer.1", "final"]


def dp_export(out, rank: int, size: int, **cfg) -> ExportConsumer:
    ctx = ConsumerContext(
        model=model_info(),
        resolve_layer=lambda i: resolve_layer(i, NUM_LAYERS),
        parse_port=Registry().parse_port,
        data_parallel_rank=rank,
        data_parallel_size=size,
    )
    return ExportConsumer(ExportConfig(out=str(out), layers=[1, "final"], **cfg), ctx)


def engine_of_rank(rank: int, prompt_lens, max_new) -> FakeEngine:
    """A fake engine whose requests carry ids unique across the data-parallel engines."""
    engine = FakeEngine(prompt_lens, max_new, KEYS, chunk=3)
    for st in engine.state:
        st["info"].request_id = f"dp{rank}-req{st['i']}"
        st["info"].engine_id = f"dp{rank}-req{st['i']}-x"
    return engine


def run_ranks(out, size: int, work, **cfg) -> list[FakeEngine]:
    """One export consumer per data-parallel rank on the same ``out``; built first (as the
    engines build theirs at start), then run."""
    consumers = [dp_export(out, r, size, shard_rows=5, **cfg) for r in range(size)]
    engines = []
    for rank, (c, (lens, new)) in enumerate(zip(consumers, work, strict=True)):
        engine = engine_of_rank(rank, lens, new)
        run_engine(c, engine, c.on_bundle)
        c.close()
        engines.append(engine)
    return engines


def test_each_rank_writes_its_part_and_the_reader_merges_them(tmp_path):
    out = tmp_path / "exp"
    engines = run_ranks(out, 2, [([5, 3], [4, 2]), ([6, 2, 4], [1, 3, 5])])

    assert not (out / fmt.MANIFEST).exists()
    assert sorted(p.name for p in out.iterdir()) == ["dp0", "dp1"]
    for rank in (0, 1):
        manifest = check_directory(out / fmt.part_name(rank))
        assert manifest["data_parallel"] == {"rank": rank, "size": 2}
        assert manifest["complete"]

    export = open_export(out, verify=True)
    assert isinstance(export, DataParallelExport)
    assert export.keys == KEYS and export.complete and export.data_parallel_size == 2
    assert len(export) == 5
    assert export.num_rows == sum(len(st["tokens"]) - 1 for e in engines for st in e.state)

    records = list(read_export(out, verify=True))
    assert len({r.request_id for r in records}) == 5
    for rank, engine in enumerate(engines):
        mine = [r for r in records if r.data_parallel_rank == rank]
        check_records(mine, engine, KEYS)  # ids, tokens, positions, hidden states exact
    assert [r.request_id for r in export.records()][:2] == ["dp0-req0", "dp1-req0"]

    with pytest.raises(ExportFormatError, match=r"data-parallel export \(dp0, dp1\).*read_export"):
        ExportReader(out)


def test_a_rank_without_requests_writes_nothing(tmp_path):
    out = tmp_path / "exp"
    c0 = dp_export(out, 0, 2)
    c1 = dp_export(out, 1, 2)
    engine = engine_of_rank(1, [4], [3])
    run_engine(c1, engine, c1.on_bundle)
    c0.close()
    c1.close()
    assert sorted(p.name for p in out.iterdir()) == ["dp1"]
    check_records(list(read_export(out)), engine, KEYS)


def test_output_checks_and_stale_parts(tmp_path):
    out = tmp_path / "exp"
    run_ranks(out, 2, [([3], [2]), ([4], [2])])
    # Without overwrite an engine refuses its non-empty part.
    with pytest.raises(ValueError, match=r"dp1'? is not empty"):
        dp_export(out, 1, 2)
    # A plain export refuses an ``out`` holding parts.
    with pytest.raises(ValueError, match=r"is not empty \(dp0, dp1\)"):
        dp_export(out, 0, 1)

    # Parts of exports with different sizes are not merged.
    shutil.copytree(out / "dp1", out / "dp2")
    m = json.loads((out / "dp2" / fmt.MANIFEST).read_text())
    m["data_parallel"] = {"rank": 2, "size": 3}
    (out / "dp2" / fmt.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ExportFormatError, match=r"different data-parallel sizes \[2, 3\]"):
        open_export(out)
    # ... and a part of a rank this export does not have counts as content of ``out``.
    with pytest.raises(ValueError, match=r"exp'? is not empty \(dp2\)"):
        dp_export(out, 0, 2)
    m["data_parallel"] = {"rank": 1, "size": 3}
    (out / "dp2" / fmt.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ExportFormatError, match="not the part of data-parallel rank 2"):
        open_export(out)

    # overwrite=true: a DP = 2 export over that (plus a stray plain manifest and a user file)
    # removes the stale part and the top-level export files, keeps other files.
    (out / fmt.MANIFEST).write_text("{}")
    (out / "notes.txt").write_text("mine")
    engines = run_ranks(out, 2, [([2], [2]), ([5], [1])], overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["dp0", "dp1", "notes.txt"]
    records = list(read_export(out))
    assert sorted(r.request_id for r in records) == ["dp0-req0", "dp1-req0"]
    check_records([r for r in records if r.data_parallel_rank == 1], engines[1], KEYS)

    # A plain export with overwrite=true removes the parts of an earlier data-parallel one.
    c = dp_export(out, 0, 1, overwrite=True)
    engine = engine_of_rank(0, [3], [2])
    run_engine(c, engine, c.on_bundle)
    c.close()
    assert sorted(p.name for p in out.iterdir()) == [
        fmt.MANIFEST,
        "notes.txt",
        fmt.REQUESTS_FILE,
        "shard-00000.safetensors",
    ]
    assert isinstance(open_export(out), ExportReader)
    check_records(list(read_export(out)), engine, KEYS)


def test_bad_rank_is_refused(tmp_path):
    with pytest.raises(ValueError, match="data-parallel rank 2 of size 2 is invalid"):
        dp_export(tmp_path / "x", 2, 2)


def test_sae_feature_records_of_two_ranks_are_merged(tmp_path):
    import numpy as np
    import torch

    from consumers.export.writer import output_layout
    from consumers.sae import read_features
    from consumers.sae.features import FeatureWriter
    from tllm_core.api.rows import RequestInfo

    out = tmp_path / "feat"
    layouts = [output_layout(str(out), False, r, 2) for r in (0, 1)]  # both built before writing
    for rank, layout in enumerate(layouts):
        w = FeatureWriter(layout.path, 2, "float32", 4, False, lambda: {"site": "1"}, layout)
        info = RequestInfo(
            engine_id=f"r{rank}-x", request_id=f"r{rank}", prompt_index=0, sample_index=0,
            num_prompt_tokens=3,
        )  # fmt: skip
        idx = torch.tensor([[rank, 5], [7, rank]], dtype=torch.int32)
        w.append([info, info], np.array([0, 1]), np.array([10, 11]), np.array([False] * 2),
                 idx, torch.ones(2, 2))  # fmt: skip
        w.finished(info)
        w.close()
    assert sorted(p.name for p in out.iterdir()) == ["dp0", "dp1"]
    recs = {r.request_id: r for r in read_features(out, verify=True)}
    assert sorted(recs) == ["r0", "r1"]
    for rank in (0, 1):
        rec = recs[f"r{rank}"]
        assert rec.data_parallel_rank == rank
        assert rec.indices.tolist() == [[rank, 5], [7, rank]]


def test_parts_that_disagree_on_their_columns_are_not_merged(tmp_path):
    """A part left by an export of other layers (or dtype) is named, not merged."""
    out = tmp_path / "exp"
    run_ranks(out, 2, [([3], [2]), ([4], [2])])
    m = json.loads((out / "dp1" / fmt.MANIFEST).read_text())
    (out / "dp1" / fmt.MANIFEST).write_text(json.dumps({**m, "keys": ["final"]}))
    with pytest.raises(ExportFormatError, match=r"parts of .* disagree on keys: .*'final'\]"):
        open_export(out)
