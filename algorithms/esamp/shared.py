"""What every job of the ESamp consumer shares: its config, distiller, counters and layer
keys, and the row gathers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from algorithms.esamp.slots import SlotDistiller
from tllm_core import Counters

if TYPE_CHECKING:  # both need pydantic, which the GPU image lacks (gpu_smoke.py)
    from algorithms.esamp.config import ESampConfig
    from algorithms.esamp.guide_workspace import GuideWorkspace
    from tllm_core import RowInfo
from tllm_core import host_to_device as host_to


@dataclass
class Shared:
    cfg: ESampConfig
    distiller: SlotDistiller
    counters: Counters
    src_key: str  # the source layer's port key (the distiller's input)
    tgt_key: str  # the target layer's port key (what it predicts)
    # Device counters and losses are read back only at a blocking flush: on CUDA every
    # read is a host sync.
    on_cuda: bool
    # 0 .. cuda_rows_per_step - 1 on the device (the CUDA guidance workspace's): the row
    # index of a step that takes every row in order is a view of it (see row_index).
    arange: torch.Tensor | None = None

    def rows_kw(self, rows: object) -> dict:
        """The keyword naming the rows (:func:`rows_id`) for a distiller that takes it."""
        return {"rows_id": rows} if self.distiller.takes_rows_id else {}

    def predict(self, slots: torch.Tensor, x: torch.Tensor, rows: object = None) -> torch.Tensor:
        """The distiller's prediction of rows named ``rows`` (:func:`rows_id`)."""
        return self.distiller.predict(slots, x, **self.rows_kw(rows))


def rows_id(step: int, rows: RowInfo, sel: list[int]) -> tuple[int, bytes]:
    """A name for the step's rows ``sel``, the same in a guide view and the step's bundle."""
    return step, rows.row[sel].tobytes()


def select_rows(
    t: torch.Tensor,
    sel: list[int],
    idx: torch.Tensor,
    ws: GuideWorkspace | None = None,
    part: str = "",
) -> torch.Tensor:
    """``t[idx]`` (into the workspace's ``part`` when given), or ``t`` itself when ``sel`` is
    every row in order."""
    if len(sel) == t.shape[0] and sel[-1] == len(sel) - 1:
        return t
    if ws is None or t.dtype != ws.parts[part].dtype:
        return t[idx]
    return torch.index_select(t, 0, idx, out=ws.take(part, idx.numel()))


def row_index(
    sel: list[int], device: torch.device, arange: torch.Tensor | None = None
) -> torch.Tensor:
    """Row indices on ``device``; every row in order is a view of ``arange`` where it fits."""
    ascending = sel and sel[0] == 0 and sel[-1] == len(sel) - 1  # sel is range(len(sel))
    if ascending and arange is not None and len(sel) <= arange.numel():
        return arange[: len(sel)]
    return host_to(torch.tensor(sel, dtype=torch.long), device)
