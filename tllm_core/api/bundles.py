"""Typed bundles handed to consumers, and the sampler's in-step view for guidance."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from tllm_core.api.candidates import (
    NEG_INF,
    Candidates,
    GuideBuffers,
    TopCandidates,
    candidate_entries,
    count_rows,
    part,
    top_candidate_entries,
)
from tllm_core.api.rows import RowInfo


@dataclass
class Bundle:
    """One step's data of a consumer's read ports (docs/ports.md, "Read ports")."""

    step: int
    rows: RowInfo
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)
    sampled_rows: RowInfo | None = None
    per_sample: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def logits(self) -> torch.Tensor | None:
        """Raw logits of ``sampled_rows`` (port ``Logits``), or None."""
        return self.per_sample.get("logits")

    @property
    def sampled_token_ids(self) -> torch.Tensor | None:
        """Sampled token ids of ``sampled_rows`` (port ``SampledTokens``), or None."""
        return self.per_sample.get("sampled")


def not_captured(key: object, captured: Iterable[str]) -> str:
    """Why ``key`` is not in a step's data (a bundle's, a guide view's)."""
    return (
        f"{key!r} is not captured in this step (captured: {sorted(captured)}); declare a read "
        "port with that key in reads() (its phase chooses the steps it is captured in)"
    )


class GuideView:
    """The sampler's view of one step, changed only through ``update*`` (docs/ports.md)."""

    def __init__(
        self,
        step: int,
        rows: RowInfo,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        is_random: np.ndarray,
        filtered: bool,
        hidden: dict[str, torch.Tensor],
        changed: torch.Tensor | None = None,
    ):
        self.step = step
        self.rows = rows
        self._logits = logits
        # Writes applied at commit, or (with an undo copy) when the logits are read first.
        self._drops: list[Callable[[torch.Tensor], None]] = []
        self._busy: set[int] = set()  # ids of GuideBuffers holding this step's writes
        self.temperature = temperature
        self.is_random = is_random
        self.filtered = filtered
        self._hidden = hidden
        if changed is None:  # logits changed per row, counted on the device
            changed = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        else:
            changed.zero_()
        self._changed = changed
        self._candidates: Candidates | None = None
        self._writes = 0  # writes so far (a TopCandidates taken since saw them all)
        self.wrote = False
        # How to restore each write, newest last: a consumer that raises leaves nothing.
        self._undo: list[Callable[[], None]] = []

    @property
    def logits(self) -> torch.Tensor:
        """The step's candidate logits ``[R, V]``, as written so far."""
        if self._drops:
            self._apply_drops(undo=True)
        return self._logits

    def _apply_drops(self, undo: bool) -> None:
        logits = self._logits
        if undo:
            snapshot = logits.clone()
            self._undo.append(lambda: logits.copy_(snapshot))
        for apply in self._drops:
            apply(logits)
        self._drops.clear()

    def _wrote(self, undo: Callable[[], None] | None) -> None:
        if undo is not None:
            self._undo.append(undo)
        self.wrote = True
        self._writes += 1
        self._candidates = None

    def commit(self) -> None:
        """The consumer's guide returned: apply pending writes (no undo needed any more)."""
        if self._drops:
            self._apply_drops(undo=False)
        self._undo.clear()
        self._busy.clear()

    def hidden(self, key: str) -> torch.Tensor:
        """A token port's data at the sampling rows, ``[R, H]``; ``KeyError`` if not read."""
        try:
            return self._hidden[key]
        except KeyError:
            raise KeyError(not_captured(key, self._hidden)) from None

    def candidates(self) -> Candidates:
        """The surviving (row, token) entries (one scan of the logits, cached until a write)."""
        if self._candidates is None:
            rows, toks = candidate_entries(self.logits)
            self._candidates = Candidates(rows, toks, self.logits[rows, toks])
        return self._candidates

    def update_candidates(self, entries: torch.Tensor, new_logits: torch.Tensor) -> None:
        """Set entries ``entries`` of :meth:`candidates` to ``new_logits [len(entries)]``."""
        if entries.numel() == 0:
            return
        cand = self.candidates()
        rows, toks = cand.rows[entries], cand.tokens[entries]
        old = cand.logits[entries]
        new = new_logits.to(self.logits.dtype)
        logits = self.logits  # not self: an undo entry must not keep the view alive
        self._wrote(lambda: logits.index_put_((rows, toks), old))
        logits[rows, toks] = new
        self._changed.index_add_(0, rows, (new != old).long())

    def top_candidates(self, k: int, buffers: GuideBuffers | None = None) -> TopCandidates:
        """Up to ``k`` surviving entries of every row in fixed ``[R, k]`` tensors (no host sync)."""
        if buffers is not None and id(buffers) in self._busy:
            raise ValueError(
                "these GuideBuffers already hold a write of this step; a second search into "
                "them would overwrite it (use other buffers, or none)"
            )
        return top_candidate_entries(self.logits, k, version=self._writes, buffers=buffers)

    def update_top_candidates(
        self, top: TopCandidates, new_logits: torch.Tensor, drop_rest: torch.Tensor | None = None
    ) -> None:
        """Set ``top``'s valid slots to ``new_logits [R, k]`` (``drop_rest`` rows: others -inf)."""
        b = top.buffers  # with buffers every temporary is a row view of them
        if b is not None:
            if id(b) in self._busy:
                raise ValueError("these GuideBuffers already hold a write of this step")
            self._busy.add(id(b))
        logits = self.logits  # not self: an undo entry must not keep the view alive
        r, toks = logits.shape[0], top.tokens
        old = torch.gather(logits, 1, toks, out=part(b, "old", r))  # earlier writes count
        keep = torch.gt(old, NEG_INF, out=part(b, "keep", r)).logical_and_(top.valid)
        new = torch.where(keep, new_logits.to(logits.dtype), old, out=part(b, "new", r))
        self._wrote(lambda: logits.scatter_(1, toks, old))
        logits.scatter_(1, toks, new)
        flag = torch.ne(new, old, out=part(b, "flag", r)).logical_and_(keep)
        count = torch.sum(flag, -1, out=part(b, "count", r))
        self._changed.add_(count)
        if drop_rest is not None:
            # Which candidates drop is known on the device only: applied at commit (or
            # when the logits are next read), so no copy is needed to undo it.
            rows = drop_rest.to(logits.device)
            if top.version == self._writes - 1:  # no write between: its count holds
                torch.logical_not(keep, out=flag).logical_and_(top.valid)
                torch.sum(flag, -1, out=count).add_(top.over_cap)
            else:
                count_rows(torch.gt(logits, NEG_INF, out=part(b, "masks", r)), out=count)
                count.sub_(torch.sum(keep, -1, out=part(b, "count2", r)))
            self._changed.add_(count.mul_(rows))
            self._drops.append(_drop(rows, toks, part(b, "kept", r)))

    def update(self, row_idx: torch.Tensor, new_logits: torch.Tensor) -> None:
        """Set ``logits[row_idx]`` to ``new_logits`` ``[len(row_idx), V]`` on candidate entries."""
        if row_idx.numel() == 0:
            return
        old = self.logits[row_idx]
        cand = old > float("-inf")
        new = torch.where(cand, new_logits.to(old.dtype), old)
        logits = self.logits  # not self: an undo entry must not keep the view alive
        self._wrote(lambda: logits.index_put_((row_idx,), old))
        logits[row_idx] = new
        self._changed.index_add_(0, row_idx, count_rows(cand & (new != old)))

    def update_all(
        self, new_logits: torch.Tensor, buffers: GuideBuffers, rows: torch.Tensor | None = None
    ) -> None:
        """Set every (``rows``: those) row's candidates to ``new_logits [R, V]``, copied in when
        the guide returns; allocates nothing."""
        logits = self.logits
        if new_logits.shape != logits.shape or new_logits.dtype != logits.dtype:
            raise ValueError(
                f"update_all needs new logits of the logits' shape {tuple(logits.shape)} and "
                f"dtype {logits.dtype}, got {tuple(new_logits.shape)} {new_logits.dtype}"
            )
        if not buffers.dense:
            raise ValueError("update_all needs GuideBuffers made with dense=True")
        r = logits.shape[0]
        if r == 0:
            return
        cand, flag = buffers.mask(0, r), buffers.mask(1, r)
        torch.gt(logits, NEG_INF, out=cand)
        if rows is not None:
            cand.logical_and_(rows.to(logits.device)[:, None])
        torch.where(cand, new_logits, logits, out=new_logits)
        torch.ne(new_logits, logits, out=flag).logical_and_(cand)
        self._changed.add_(torch.sum(flag, -1, out=buffers.take("count", r)))
        self._wrote(None)
        self._drops.append(lambda logits: logits.copy_(new_logits))

    def changed_per_row(self) -> torch.Tensor:
        """Logits changed through this view so far, per row (int64 ``[R]``, on the device)."""
        return self._changed

    def guided_counts(self) -> tuple[int, int]:
        """Rows with a logit changed through this view, and logits changed (one host read)."""
        c = self._changed
        return tuple(torch.stack([(c > 0).sum(), c.sum()]).cpu().tolist())

    @property
    def rows_guided(self) -> int:
        """Rows with at least one logit changed through this view (a host read)."""
        return self.guided_counts()[0]

    @property
    def candidates_guided(self) -> int:
        """Logits changed through this view (a host read)."""
        return self.guided_counts()[1]

    def rollback(self) -> None:
        """Undo every write made through this view (newest first)."""
        self._drops.clear()
        for restore in reversed(self._undo):
            restore()
        self._undo.clear()
        self._busy.clear()
        self._candidates = None
        self._changed.zero_()
        self.wrote = False


def _drop(
    rows: torch.Tensor, toks: torch.Tensor, kept: torch.Tensor | None
) -> Callable[[torch.Tensor], None]:
    """A drop_rest write: in ``rows``, every candidate outside ``toks`` to -inf."""

    def apply(logits: torch.Tensor) -> None:
        k = logits.gather(1, toks) if kept is None else torch.gather(logits, 1, toks, out=kept)
        logits.masked_fill_(rows[:, None], NEG_INF)
        logits.scatter_(1, toks, k)

    return apply
