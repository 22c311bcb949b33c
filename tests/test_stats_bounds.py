"""stats keeps per-request figures for a bounded number of requests (issue 26: a server's
/tllm/counters grew with every request ever served)."""

from __future__ import annotations

import json

import numpy as np
import torch

from consumers.stats import StatsConfig, StatsConsumer
from tllm_core import Bundle, ConsumerContext, ModelInfo
from tllm_core.api.ports import resolve_layer
from tllm_core.api.rows import RequestInfo, RowInfo

H = 8


def _consumer(**cfg) -> StatsConsumer:
    model = ModelInfo(H, 4, 10, torch.float32, torch.device("cpu"), lambda h: h, None)
    ctx = ConsumerContext(model, lambda i: resolve_layer(i, 4))
    return StatsConsumer(StatsConfig(layers=[0], **cfg), ctx)


def _bundle(step: int, req: RequestInfo) -> Bundle:
    rows = RowInfo(
        np.arange(1), [req], np.array([5]), np.ones(1, bool), np.zeros(1, bool), torch.zeros(1)
    )
    return Bundle(step, rows, {"layer.0": torch.ones(1, H)})


def test_result_keeps_the_newest_requests_only():
    c = _consumer(max_requests=10)
    for i in range(500):
        req = RequestInfo(f"r{i}-abcdefgh", f"r{i}", i, 0, 3)
        c.on_bundle(_bundle(i, req))
        c.on_bundle(_bundle(i, req))  # a second row of the same request: no new entry
    res = c.result()
    assert sorted(res) == sorted(f"r{i}/0" for i in range(490, 500))
    assert res["r499/0"]["layer.0"]["rows"] == 2
    assert c.counters.get("requests_dropped") == 490 and c.counters.get("rows.layer.0") == 1000
    assert len(json.dumps(res)) < 2000  # flat, whatever the number of requests served


def test_unbounded_when_asked():
    c = _consumer(max_requests=None)
    for i in range(50):
        c.on_bundle(_bundle(i, RequestInfo(f"r{i}-abcdefgh", f"r{i}", i, 0, 3)))
    assert len(c.result()) == 50 and c.counters.get("requests_dropped") == 0
