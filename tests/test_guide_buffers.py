"""GuideView's writes into preallocated GuideBuffers (``tllm_core/api/candidates.py``):
the fixed-size search and its write, and ``update_all``, give the same logits and counts as
the allocating forms, roll back alike, and refuse buffers that cannot hold the step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tllm_core import GuideBuffers
from tllm_core.api.bundles import GuideView
from tllm_core.api.rows import RequestInfo, RowInfo
from tllm_core.api.workspace import carve_workspace, workspace_bytes

NEG = float("-inf")


def _view(logits: torch.Tensor) -> GuideView:
    r = logits.shape[0]
    rows = RowInfo(
        np.arange(r),
        [RequestInfo(f"e{i}", "r", 0, i, 1) for i in range(r)],
        np.arange(r),
        np.ones(r, bool),
        np.zeros(r, bool),
        torch.zeros(r, dtype=torch.long),
    )
    return GuideView(0, rows, logits, torch.ones(r), np.ones(r, bool), True, {})


def _logits(seed: int, r: int = 5, v: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, v, generator=g)
    x[torch.rand(r, v, generator=g) > 0.3] = NEG
    x[1] = NEG  # a row without candidates
    x[2, 3], x[3, 7] = float("nan"), float("inf")
    return x


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("drop", [False, True])
def test_top_candidates_into_buffers_equal_the_allocating_search_and_write(seed, drop):
    base = _logits(seed)
    b = GuideBuffers(8, 40, "cpu", top_k=6)
    out = {}
    for use in (None, b):
        view = _view(base.clone())
        top = view.top_candidates(6, buffers=use)
        assert (top.buffers is None) == (use is None)
        new = top.logits * 1.5 + 1.0
        rows = torch.tensor([True, True, False, True, True]) if drop else None
        view.update_top_candidates(top, new, drop_rest=rows)
        counts = view.guided_counts()
        view.commit()
        out[use is None] = (view.logits.clone(), counts, top.over_cap.clone())
    (a, ca, oa), (c, cc, oc) = out[True], out[False]
    assert torch.equal(a.nan_to_num(), c.nan_to_num()) and torch.equal(a.isnan(), c.isnan())
    assert ca == cc and torch.equal(oa, oc) and ca[1] > 0
    if drop:
        assert oa.sum() > 0  # candidates past 6 were dropped


def test_buffers_hold_one_write_per_step_and_roll_back():
    base = _logits(7)
    b = GuideBuffers(5, 40, "cpu", top_k=3)
    view = _view(base.clone())
    top = view.top_candidates(3, buffers=b)
    view.update_top_candidates(top, top.logits + 1, drop_rest=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="already hold a write of this step"):
        view.top_candidates(3, buffers=b)  # would overwrite the pending drop's tokens
    view.rollback()
    assert torch.equal(view.logits.nan_to_num(), base.nan_to_num())
    view.top_candidates(3, buffers=b)  # free again after the rollback
    with pytest.raises(ValueError, match="top_k=3 over 40 tokens cannot hold 4"):
        view.top_candidates(4, buffers=b)
    with pytest.raises(ValueError, match="a view of 6 rows needs more than"):
        _view(_logits(1, r=6)).top_candidates(3, buffers=b)


def test_update_all_equals_update_of_every_row_and_keeps_no_undo_copy():
    base = _logits(3)
    new = torch.randn(5, 40)
    new[0, :5] = base[0, :5]  # unchanged entries count nothing
    ref = _view(base.clone())
    ref.update(torch.arange(5), new.clone())
    b = GuideBuffers(8, 40, "cpu", dense=True)
    view = _view(base.clone())
    buf = new.clone()
    view.update_all(buf, b)
    assert view.wrote and view.guided_counts() == ref.guided_counts()
    assert not view._undo  # applied when the guide returns: nothing to undo
    assert torch.equal(view._logits.nan_to_num(), base.nan_to_num())  # not applied yet
    view.commit()
    assert torch.equal(view.logits.nan_to_num(), ref.logits.nan_to_num())
    assert torch.equal(view.logits.isnan(), ref.logits.isnan())
    # Read before the guide returns: applied then, with an undo copy; rollback restores.
    view = _view(base.clone())
    view.update_all(new.clone(), b)
    assert torch.equal(view.logits.nan_to_num(), ref.logits.nan_to_num())
    view.rollback()
    assert torch.equal(view.logits.nan_to_num(), base.nan_to_num())
    # Only the given rows: the others keep their logits bit for bit and count nothing.
    pick = torch.tensor([True, False, True, True, False])
    ref = _view(base.clone())
    ref.update(pick.nonzero().squeeze(1), new[pick].clone())
    view = _view(base.clone())
    view.update_all(new.clone(), b, rows=pick)
    view.commit()
    assert view.guided_counts() == ref.guided_counts()
    assert torch.equal(view.logits.nan_to_num(), ref.logits.nan_to_num())
    with pytest.raises(ValueError, match="dense=True"):
        _view(base.clone()).update_all(new.clone(), GuideBuffers(8, 40, "cpu", top_k=2))
    with pytest.raises(ValueError, match="dtype"):
        _view(base.clone()).update_all(new.double(), b)


def test_buffers_are_one_allocation_of_the_stated_size():
    for top_k, dense in ((None, True), (7, False), (7, True)):
        b = GuideBuffers(6, 50, "cpu", top_k=top_k, dense=dense)
        assert b.flat.numel() == GuideBuffers.nbytes(6, 50, top_k, dense)
        for t in b.parts.values():
            assert t.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
    spec = [("a", (3,), torch.float32), ("b", (2, 2), torch.long)]
    flat, parts = carve_workspace(spec, "cpu")
    assert workspace_bytes(spec) == flat.numel() == 512  # two parts, each 256-aligned
    assert parts["b"].data_ptr() - parts["a"].data_ptr() == 256
    with pytest.raises(ValueError, match="distinct"):
        carve_workspace([("a", (1,), torch.float32)] * 2, "cpu")
