"""A long day in the server (slow): benchmarks/soak.py's checks on the tiny model."""

from __future__ import annotations

import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_soak_mixed_traffic_keeps_every_promise(tiny_model):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent.parent / "benchmarks"))
    from soak import soak

    out = soak(tiny_model, requests=150, concurrency=6, max_tokens=12, enforce_eager=True)
    failed = [k for k, ok in out["checks"].items() if not ok]
    assert not failed, (failed, out)
    assert out["by_kind"]["crash"]["sent"] > 0 and out["by_kind"]["cancel"]["sent"] > 0
    assert {e["consumer"] for e in out["errors"]} == {"crasher"}
