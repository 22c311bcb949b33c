"""Parallel engines without vLLM: thread binding, report merging, follower runtimes, refusals."""

from __future__ import annotations

import pytest
import torch

from tllm_core.api.consumer import ModelInfo
from tllm_core.plugins.registry import Registry
from tllm_core.runtime.reports import merge_reports
from tllm_core.runtime.runtime import Runtime
from tllm_core.runtime.settings import RuntimeSettings
from tllm_core.vllm_bridge.parallel import ParallelInfo, check_layout, cpu_thread_binding
from tllm_core.vllm_bridge.version import UnsupportedEngineError


def test_thread_binding_gives_each_rank_its_own_cores():
    assert cpu_thread_binding(2, {0, 1}) == "0|1"
    assert cpu_thread_binding(2, [3, 1, 2]) == "1,2|3"
    assert cpu_thread_binding(1, {0, 1}) == "0,1"
    with pytest.raises(ValueError, match=r"2 ranks need at least 2 CPU cores.*may use 1 \(\[5\]\)"):
        cpu_thread_binding(2, {5})


def test_pipeline_parallel_is_refused_with_the_measured_reason():
    class PC:
        pipeline_parallel_size = 2
        tensor_parallel_size = 1

    with pytest.raises(UnsupportedEngineError, match="pipeline_parallel_size > 1 .got 2.*fails"):
        check_layout(PC())
    PC.pipeline_parallel_size = 1
    PC.tensor_parallel_size = 2
    check_layout(PC())  # tensor parallel is accepted
    PC.decode_context_parallel_size = 2  # context parallel: refused, as every rank would lead
    with pytest.raises(UnsupportedEngineError, match="decode_context_parallel_size > 1 .got 2"):
        check_layout(PC())


def test_leader_is_tp_rank_zero_of_the_last_stage():
    assert ParallelInfo(tp_rank=0, tp_size=2).leader
    assert not ParallelInfo(tp_rank=1, tp_size=2).leader
    assert not ParallelInfo(tp_rank=0, tp_size=2, pp_rank=0, pp_size=2).leader


def _report(rank: dict, steps: int, rows: int, errors=()) -> dict:
    return {
        "runtime": {"engine_steps": steps, "rows_seen": rows},
        "consumers": {"stats": {"bundles": steps}},
        "results": {"stats": {"rank": rank["dp_rank"]}},
        "errors": list(errors),
        "rank": rank,
    }


def _rank(tp: int, dp: int, tp_size: int = 2, dp_size: int = 1) -> dict:
    info = ParallelInfo(tp_rank=tp, tp_size=tp_size, dp_rank=dp, dp_size=dp_size)
    return info.as_dict()


def test_tensor_parallel_reports_count_the_leader_once_and_keep_every_rank_error():
    err = {"consumer": "(runtime)", "where": "residual.0", "error": "stale"}
    leader = _report(_rank(0, 0), 5, 20)
    follower = _report(_rank(1, 0), 5, 20, [err])
    follower["consumers"] = {}
    merged = merge_reports([follower, leader])
    assert merged["runtime"] == {"engine_steps": 5, "rows_seen": 20}
    assert merged["consumers"] == {"stats": {"bundles": 5}}
    assert merged["errors"] == [{**err, "tp_rank": 1, "dp_rank": 0}]
    assert "ranks" not in merged


def test_data_parallel_reports_are_summed_with_per_rank_figures():
    a = _report(_rank(0, 0, 1, 2), 3, 10)
    b = _report(_rank(0, 1, 1, 2), 4, 7)
    merged = merge_reports([b, a])
    assert merged["runtime"] == {"engine_steps": 7, "rows_seen": 17}
    assert merged["consumers"]["stats"] == {"bundles": 7}
    assert merged["results"]["stats"] == [{"rank": 0}, {"rank": 1}]
    assert [r["runtime"]["engine_steps"] for r in merged["ranks"]] == [3, 4]


def test_single_rank_report_is_unchanged_and_missing_leader_is_an_error():
    plain = {"runtime": {"engine_steps": 1}, "consumers": {}, "results": {}, "errors": []}
    assert merge_reports([plain]) == plain
    with pytest.raises(RuntimeError, match="no leader"):
        merge_reports([_report(_rank(1, 0), 1, 1)])
    with pytest.raises(RuntimeError, match="no worker"):
        merge_reports([None])


def test_follower_runtime_asks_for_the_same_taps_and_keeps_no_consumer():
    info = ModelInfo(8, 4, 10, torch.float32, torch.device("cpu"), lambda h: h, None)
    specs = [
        {"name": "recorder", "config": {"layers": [0, "final"]}},
        {"name": "steer", "config": {"vectors": [{"layer": 1, "vector": [1.0] * 8}]}},
    ]
    settings = RuntimeSettings.model_validate({"consumers": specs})
    leader = Runtime(settings, info, Registry())
    follower = Runtime(settings, info, Registry(), deliver=False)
    assert follower.taps == leader.taps and follower.taps
    assert follower.edit_taps == leader.edit_taps and follower.edit_taps
    assert follower.configured and leader.configured
    assert follower.slots == [] and len(leader.slots) == 2


def test_tllmllm_failing_before_vllm_starts_leaves_no_thread_binding(tiny_model, monkeypatch):
    """TllmLLM binds its ranks' cores for vLLM's start only: a failure before the start (here
    the multi-node leader's store) must not leave the binding for a later engine."""
    import os

    import tllm_core.app.engine as engine

    def no_store(*a, **k):
        raise RuntimeError("before vLLM's start")

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(engine, "leader_store", no_store)
    with pytest.raises(RuntimeError, match="before vLLM's start"):
        engine.TllmLLM(tiny_model, [], tensor_parallel_size=2)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
