"""What ESamp's jobs share: config, distiller, counters, layer keys, the row gathers, and the
groups (a prompt's requests, or the whole batch) with their distiller slots."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from algorithms.esamp.slots import SlotDistiller
from tllm_core import Counters
from tllm_core import host_to_device as host_to

if TYPE_CHECKING:  # these need pydantic, which the GPU image lacks (gpu_smoke.py)
    from algorithms.esamp.config import ESampConfig
    from algorithms.esamp.guide_workspace import GuideWorkspace
    from tllm_core import RequestInfo, RowInfo

_BATCH_KEY = "__batch__"
WAIT_S = 60.0  # the longest a group keeps its slot for a sibling not seen yet
_EARLY = 1024  # keys remembered with finishes for a group not (or no longer) there


@dataclass
class Group:
    live: set[str] = field(default_factory=set)  # engine ids of its unfinished requests
    slot: int | None = None
    serial: int = -1  # creation order; stable id for loss bookkeeping (slots are reused)
    age: int = 0  # train steps submitted
    warmed: bool = False  # warm start done (or not needed)
    size: int | None = None  # its requests (its prompt's samples), where known
    done: int = 0  # its requests finished, seen or not
    idle_since: float = 0.0  # monotonic time its seen requests had all finished


# admit(row, request, group) -> whether the row, its group tracked, may take a slot.
Admit = Callable[[int, "RequestInfo", Group], bool]


class Groups:
    """The live groups by key and by slot; one whose seen requests finished waits (``idle``)
    WAIT_S at most for its other samples, yielding its slot at the cap."""

    def __init__(
        self, distiller: SlotDistiller, counters: Counters, scope: str, max_groups: int | None
    ):
        self.distiller, self.counters = distiller, counters
        self.scope, self.max_groups = scope, max_groups
        self.by_key: dict[str, Group] = {}
        self.by_slot: dict[int, Group] = {}
        self.idle: dict[str, Group] = {}  # oldest first
        self.early: OrderedDict[str, int] = OrderedDict()  # key -> finishes before its group
        self.freed: list[int] = []
        self._serials = 0

    def key(self, req: RequestInfo) -> str:
        return req.group_key if self.scope == "group" else _BATCH_KEY

    def ensure_slot(self, g: Group) -> int | None:
        """The group's slot, allocated on first use; None at the cap or a full fixed capacity."""
        if g.slot is None:
            d, cap = self.distiller, self.max_groups
            while self.idle and d.num_live >= min(cap or d.capacity, d.capacity):
                self._free(next(iter(self.idle)))  # a group waiting for a sibling yields first
            if (cap and d.num_live >= cap) or (not d.growable and d.num_live >= d.capacity):
                return None
            g.slot = d.alloc()
            g.serial, g.age = self._serials, 0
            self._serials += 1
            self.by_slot[g.slot] = g
            self.counters.add("groups_created")
            self.counters.set("groups_alive", d.num_live)
        return g.slot

    def claim(
        self, requests: list[RequestInfo], rows: Iterable[int], admit: Admit | None = None
    ) -> tuple[list[int], list[int], int]:
        """Track each row's group; rows ``admit`` takes get its slot: (rows, slots, capped)."""
        sel: list[int] = []
        slots: list[int] = []
        capped, now = 0, time.monotonic()
        while self.idle and now - next(iter(self.idle.values())).idle_since > WAIT_S:
            self._free(next(iter(self.idle)))
        for i in rows:
            req = requests[i]
            key = self.key(req)
            g = self.by_key.get(key) or self._new(key, req)
            self.idle.pop(key, None)
            g.live.add(req.engine_id)
            if admit is not None and not admit(i, req, g):
                continue
            slot = self.ensure_slot(g)
            if slot is None:
                capped += 1
                continue
            sel.append(i)
            slots.append(slot)
        return sel, slots, capped

    def finish(self, request: RequestInfo) -> None:
        """A request finished: its group is freed when it was the group's last."""
        key = self.key(request)
        g = self.by_key.get(key)
        if g is None or request.engine_id not in g.live:  # no row of it seen
            self.counters.add("finished_unseen")
        g = g or self._new(key, request)  # slotless: freed below, its count kept in early
        g.live.discard(request.engine_id)
        g.done += 1
        if g.live:
            return
        if g.size is not None and g.done < g.size and g.slot is not None:  # wait for a sibling
            if key not in self.idle:  # an unseen sibling's finish keeps the wait's start
                g.idle_since, self.idle[key] = time.monotonic(), g
        else:
            self._free(key)

    def _new(self, key: str, req: RequestInfo) -> Group:
        size = req.group_size if self.scope == "group" else None
        g = self.by_key[key] = Group(size=size, done=self.early.pop(key, 0))
        return g

    def _free(self, key: str) -> None:
        g = self.by_key.pop(key)
        self.idle.pop(key, None)
        if g.size is not None and g.done < g.size:  # a later sibling's group takes the count
            self.early[key] = g.done
            if len(self.early) > _EARLY:
                self.early.popitem(last=False)
        if g.slot is not None:
            del self.by_slot[g.slot]
            self.distiller.free(g.slot)
            self.counters.add("groups_freed")
            self.counters.set("groups_alive", self.distiller.num_live)
            self.freed.append(g.serial)


@dataclass
class Shared:
    cfg: ESampConfig
    distiller: SlotDistiller
    counters: Counters
    src_key: str  # the source layer's port key (the distiller's input)
    tgt_key: str  # the target layer's port key (what it predicts)
    on_cuda: bool  # read back only at a blocking flush (on CUDA every read is a host sync)
    # 0 .. cuda_rows_per_step - 1 on the device (CUDA workspace): see row_index.
    arange: torch.Tensor | None = None


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
    """``t[idx]`` (into ``ws``'s ``part`` if given); ``t`` itself when ``sel`` is every row."""
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
