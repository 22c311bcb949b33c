"""ESamp's groups and their distiller slots: a group (a prompt's requests, or the whole
batch) gets a slot at its first row that needs one and frees it when its last request
finishes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from algorithms.esamp.slots import SlotDistiller
from tllm_core import Counters

if TYPE_CHECKING:  # rows.py needs pydantic, which the GPU image lacks (gpu_smoke.py)
    from tllm_core import RequestInfo

_BATCH_KEY = "__batch__"


@dataclass
class Group:
    live: set[str] = field(default_factory=set)  # engine ids of its unfinished requests
    slot: int | None = None
    serial: int = -1  # creation order; stable id for loss bookkeeping (slots are reused)
    age: int = 0  # train steps submitted
    warmed: bool = False  # warm start done (or not needed)


# admit(row, request, group) -> whether the row, its group tracked, may take a slot.
Admit = Callable[[int, "RequestInfo", Group], bool]


class Groups:
    """The live groups by key and by slot; counts groups_created / groups_freed /
    groups_alive / finished_unseen where a slot is allocated or freed."""

    def __init__(
        self, distiller: SlotDistiller, counters: Counters, scope: str, max_groups: int | None
    ):
        self.distiller, self.counters = distiller, counters
        self.scope, self.max_groups = scope, max_groups
        self.by_key: dict[str, Group] = {}
        self.by_slot: dict[int, Group] = {}
        self._serials = 0

    def key(self, req: RequestInfo) -> str:
        return req.group_key if self.scope == "group" else _BATCH_KEY

    def ensure_slot(self, g: Group) -> int | None:
        """The group's slot, allocated on first use; None at the cap or a full fixed capacity."""
        if g.slot is None:
            d, cap = self.distiller, self.max_groups
            if (cap is not None and d.num_live >= cap) or (
                not d.growable and d.num_live >= d.capacity
            ):
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
        """Track each row's group and give the rows ``admit`` takes their group's slot.
        Returns (rows kept, their slots, rows refused at the slot cap)."""
        sel: list[int] = []
        slots: list[int] = []
        capped = 0
        for i in rows:
            req = requests[i]
            g = self.by_key.setdefault(self.key(req), Group())
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

    def finish(self, request: RequestInfo) -> int | None:
        """A request finished; returns the serial of its group if freed now, else None."""
        key = self.key(request)
        g = self.by_key.get(key)
        if g is None or request.engine_id not in g.live:
            # Finished before any decode row reached us (e.g. aborted in prefill, max_tokens=1).
            self.counters.add("finished_unseen")
            return None
        g.live.discard(request.engine_id)
        if g.live:
            return None
        del self.by_key[key]
        if g.slot is not None:
            del self.by_slot[g.slot]
            self.distiller.free(g.slot)
            self.counters.add("groups_freed")
            self.counters.set("groups_alive", self.distiller.num_live)
        return g.serial
