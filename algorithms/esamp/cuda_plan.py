"""The CUDA distiller's row plan: where each row of a step goes in the packed buffers
(``T = capacity x graph rows`` rows, read by a *layout* as ``G`` groups of ``M`` rows, one
graph per layout), computed on the host and sent as one int64 vector per batch of groups:
``pos [T]`` and ``dest [T]`` (``T``: the trash row), ``group_slot [C]`` (-1: padding),
``submitted [C]``, ``ring_row [1]``, then the packed rows' mask as ``T`` bytes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from algorithms.esamp.packing import Packing


@dataclass(frozen=True)
class Layout:
    groups: int  # G
    rows: int  # M


def layouts(capacity: int, graph_rows: int) -> list[Layout]:
    """Every layout: groups of ``graph_rows`` rows, twice as many, ..., one group of all."""
    total = capacity * graph_rows
    out, m = [], graph_rows
    while m < total:
        out.append(Layout(total // m, m))
        m *= 2
    out.append(Layout(1, total))
    return out


@dataclass
class Batch:
    layout: Layout
    groups: np.ndarray  # indices into the step's packed groups (make_packing order)


def split(counts: np.ndarray, options: list[Layout]) -> list[Batch]:
    """Batches of the step's groups that each fit one layout (usually one batch)."""
    order = np.argsort(-counts, kind="stable")
    batches, i = [], 0
    while i < len(order):
        largest = counts[order[i]]
        fits = [lay for lay in options if lay.rows >= largest]
        if not fits:
            raise ValueError(
                f"a group has {largest} rows, more than the {options[-1].rows} packed rows "
                "(cuda_capacity x cuda_graph_max_rows)"
            )
        rest = len(order) - i
        # The shortest groups that hold every remaining group, else the layout with the most
        # groups of this size (then another batch).
        lay = next((x for x in fits if x.groups >= rest), fits[0])
        take = min(rest, lay.groups)
        batches.append(Batch(lay, np.sort(order[i : i + take])))
        i += take
    return batches


def fill_plan(
    out: np.ndarray,
    batch: Batch,
    pk: Packing,
    submitted: np.ndarray,
    total: int,
    capacity: int,
    ring_row: int,
) -> None:
    """Write one batch's plan vector into ``out`` (a view of pinned host memory);
    ``submitted``: the updates submitted for each of ``pk``'s slots."""
    row_group, row_pos = pk.row_group, pk.row_pos
    g_of = np.full(len(pk.slots), -1, dtype=np.int64)
    g_of[batch.groups] = np.arange(len(batch.groups))
    n = len(row_group)
    pos, dest = out[:total], out[total : 2 * total]
    pos.fill(total)
    dest.fill(total)
    mine = g_of[row_group] >= 0
    pos[:n][mine] = g_of[row_group[mine]] * batch.layout.rows + row_pos[mine]
    dest[:n][mine] = np.flatnonzero(mine)
    gs = out[2 * total : 2 * total + capacity]
    sub = out[2 * total + capacity : 2 * total + 2 * capacity]
    gs.fill(-1)
    sub.fill(0)
    k = len(batch.groups)
    gs[:k] = pk.slots[batch.groups]
    sub[:k] = submitted[batch.groups]
    out[2 * total + 2 * capacity] = ring_row
    mask = out[2 * total + 2 * capacity + 1 :].view(np.uint8)[:total]
    mask.fill(0)
    mask[pos[:n][mine]] = 1


def plan_size(total: int, capacity: int) -> int:
    return 2 * total + 2 * capacity + 1 + -(-total // 8)


def plan_mask(plan: torch.Tensor, total: int, capacity: int) -> torch.Tensor:
    """The packed rows' mask ``[T]`` (bool) in a plan vector (a view: no copy)."""
    start = 8 * (2 * total + 2 * capacity + 1)
    return plan.view(torch.uint8)[start : start + total].view(torch.bool)
