"""Typed bundles handed to consumers, and the sampler's in-step view for guidance."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tllm_core.api.candidates import (
    NEG_INF,
    Candidates,
    TopCandidates,
    candidate_entries,
    count_rows,
    top_candidate_entries,
)
from tllm_core.api.guide_buffers import GuideBuffers
from tllm_core.api.rows import RowInfo


@dataclass
class Bundle:
    """What one engine step produced for one consumer's read ports.

    ``hidden[key]`` holds each token port's data, ``[len(rows), ...]`` (keys such as
    ``"layer.{i}"``, ``"final"``, ``"attn.{i}"``); ``rows`` is the union of the phases the
    consumer's token ports select. ``per_sample[key]`` holds each sample port's data for
    ``sampled_rows``: the rows whose sampled token is kept (the last row of a finished
    prefill, every decode row); ``logits`` and ``sampled_token_ids`` are its built-in keys.

    End-of-step bundles hold device tensors valid only during the call; background
    bundles hold host copies the consumer may keep. (The runtime gathers end-of-step rows
    into buffers it reuses, but only once nothing holds them: a tensor kept past the call
    keeps its values; work on another CUDA stream that reads one must be waited for by the
    engine's stream or hold the tensor until it ran. See ``docs/delivery.md`` and
    ``tllm_core/runtime/buffer_pool.py``.)
    """

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


class GuideView:
    """The sampler's view for one step (write port ``SamplerGuide``).

    ``logits`` are fp32, already divided by each row's temperature and filtered by
    top-k/top-p/min-p: non-candidates are ``-inf``. Row ``i`` of ``logits`` belongs to
    ``rows[i]``. Change logits only through :meth:`update_candidates` (sparse: the few
    surviving candidates), :meth:`update_top_candidates` (up to ``k`` per row, fixed-size:
    no host sync), :meth:`update` (dense rows) or :meth:`update_all` (every row, nothing
    allocated); all keep filtered-out entries at
    ``-inf``, leave other entries bit for bit and count what changed (``rows_guided``,
    ``candidates_guided``: a write of an unchanged value counts nothing; counted on the
    logits' device and read when the counters are). ``wrote`` says, without a device read,
    whether any write was made: vLLM then samples from the guided logits, otherwise its
    own sampling call goes on as it was made. ``changed`` (optional): an int64 ``[R]``
    buffer on the logits' device to count into, zeroed here (the runtime's reused one);
    by default one is made.
    """

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
        # Writes not applied yet (drop_rest drops, update_all rows), each a function of the
        # logits: applied in order when the consumer's guide returns (commit: nothing to
        # undo then) or, with an undo copy, when the logits are read before that.
        self._drops: list[Callable[[torch.Tensor], None]] = []
        # GuideBuffers holding this step's pending writes or undo values (by id): a second
        # search into them before commit would overwrite those.
        self._busy: set[int] = set()
        self.temperature = temperature
        self.is_random = is_random
        self.filtered = filtered
        self._hidden = hidden
        # What the writes really changed (a write of an unchanged value counts nothing),
        # per row, kept on the logits' device: counted without a host sync, read on demand.
        if changed is None:
            changed = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        else:
            changed.zero_()
        self._changed = changed
        self._candidates: Candidates | None = None
        self._writes = 0  # writes so far (a TopCandidates taken since saw them all)
        # Whether a write was made (host-side: the runtime decides on it without a read).
        self.wrote = False
        # Undo log (how to restore each write, newest last) so a consumer that raises leaves
        # nothing behind.
        self._undo: list[Callable[[], None]] = []

    @property
    def logits(self) -> torch.Tensor:
        """The step's candidate logits ``[R, V]``, as written so far."""
        if self._drops:
            self._apply_drops(undo=True)
        return self._logits

    def _apply_drops(self, undo: bool) -> None:
        """Apply the pending writes in order, in place (drops: the whole row to -inf, then
        the kept values back; update_all: its rows copied in). No ``[R, V]`` temporary;
        with ``undo`` one copy of the logits to restore them from."""
        logits = self._logits
        if undo:
            snapshot = logits.clone()
            self._undo.append(lambda: logits.copy_(snapshot))
        for apply in self._drops:
            apply(logits)
        self._drops.clear()

    def commit(self) -> None:
        """The consumer's guide returned: apply pending writes (no undo needed any more)."""
        if self._drops:
            self._apply_drops(undo=False)
        self._undo.clear()
        self._busy.clear()

    def hidden(self, key: str) -> torch.Tensor:
        """A token port's data (``"layer.{i}"``, ``"final"``, ...) at the sampling rows, ``[R, H]``."""
        try:
            return self._hidden[key]
        except KeyError:
            raise KeyError(
                f"{key!r} is not captured in this step; declare a read port with that key "
                f"(captured: {sorted(self._hidden)})"
            ) from None

    def candidates(self) -> Candidates:
        """The surviving (row, token) entries (one scan of the logits, cached until a write)."""
        if self._candidates is None:
            rows, toks = candidate_entries(self.logits)
            self._candidates = Candidates(rows, toks, self.logits[rows, toks])
        return self._candidates

    def update_candidates(self, entries: torch.Tensor, new_logits: torch.Tensor) -> None:
        """Set candidate entries ``entries`` (indices into :meth:`candidates`) to
        ``new_logits`` ``[len(entries)]``; every other logit stays bit for bit."""
        if entries.numel() == 0:
            return
        cand = self.candidates()
        rows, toks = cand.rows[entries], cand.tokens[entries]
        old = cand.logits[entries]
        new = new_logits.to(self.logits.dtype)
        logits = self.logits  # not self: an undo entry must not keep the view alive
        self._undo.append(lambda: logits.index_put_((rows, toks), old))
        self.wrote = True
        self._writes += 1
        self.logits[rows, toks] = new
        self._candidates = None
        self._changed.index_add_(0, rows, (new != old).long())

    def top_candidates(self, k: int, buffers: GuideBuffers | None = None) -> TopCandidates:
        """Up to ``k`` surviving entries of every row, in fixed ``[R, k]`` tensors (see
        :class:`TopCandidates`): found without a host sync, where :meth:`candidates` ends in
        a ``nonzero`` (on CUDA the host then waits for the device). Not cached. With
        ``buffers`` (made with ``top_k=k``, at least this view's rows) the search and its
        :meth:`update_top_candidates` allocate nothing; the buffers serve one write per
        step (until the guide returns)."""
        if buffers is not None and id(buffers) in self._busy:
            raise ValueError(
                "these GuideBuffers already hold a write of this step; a second search into "
                "them would overwrite it (use other buffers, or none)"
            )
        return top_candidate_entries(self.logits, k, version=self._writes, buffers=buffers)

    def update_top_candidates(
        self,
        top: TopCandidates,
        new_logits: torch.Tensor,
        drop_rest: torch.Tensor | None = None,
    ) -> None:
        """Set the valid slots of ``top`` (from :meth:`top_candidates`) to ``new_logits``
        ``[R, k]``; invalid slots, slots filtered out since ``top`` was taken and every other
        logit stay bit for bit. ``drop_rest`` (bool ``[R]``): in those rows, also set every
        candidate outside ``top`` to ``-inf`` (a top-``k`` filter; dropped candidates count
        as changed). No host sync."""
        if top.buffers is not None:
            return self._update_top_into(top, new_logits, drop_rest, top.buffers)
        logits = self.logits  # not self: an undo entry must not keep the view alive
        old = logits.gather(1, top.tokens)  # current values: earlier writes count
        keep = top.valid & (old > NEG_INF)
        new = torch.where(keep, new_logits.to(logits.dtype), old)
        toks = top.tokens
        self._undo.append(lambda: logits.scatter_(1, toks, old))
        self.wrote = True
        self._writes += 1
        logits.scatter_(1, toks, new)
        self._candidates = None
        self._changed += ((new != old) & keep).sum(-1)
        if drop_rest is not None:
            # Which candidates drop is known on the device only: applied at commit (or
            # when the logits are next read), so no copy is needed to undo it. Dropped:
            # the row's candidates outside its kept slots, counted now.
            rows = drop_rest.to(logits.device)
            if top.version == self._writes - 1:  # no write between: its count holds
                dropped = top.over_cap + (top.valid & ~keep).sum(-1)
            else:
                dropped = count_rows(logits > NEG_INF) - keep.sum(-1)
            self._changed += dropped * rows
            self._drops.append(_drop(rows, toks, None))

    def _update_top_into(
        self,
        top: TopCandidates,
        new_logits: torch.Tensor,
        drop_rest: torch.Tensor | None,
        b: GuideBuffers,
    ) -> None:
        """:meth:`update_top_candidates` with every temporary a view of ``b`` (the same
        operations, ``out=`` and in place)."""
        if id(b) in self._busy:
            raise ValueError("these GuideBuffers already hold a write of this step")
        self._busy.add(id(b))
        logits = self.logits  # not self: an undo entry must not keep the view alive
        r, toks = logits.shape[0], top.tokens
        old = torch.gather(logits, 1, toks, out=b.take("old", r))
        keep = torch.gt(old, NEG_INF, out=b.take("keep", r)).logical_and_(top.valid)
        new = torch.where(keep, new_logits.to(logits.dtype), old, out=b.take("new", r))
        self._undo.append(lambda: logits.scatter_(1, toks, old))
        self.wrote = True
        self._writes += 1
        logits.scatter_(1, toks, new)
        self._candidates = None
        flag, count = b.take("flag", r), b.take("count", r)
        torch.ne(new, old, out=flag).logical_and_(keep)
        self._changed.add_(torch.sum(flag, -1, out=count))
        if drop_rest is not None:
            rows = drop_rest.to(logits.device)
            if top.version == self._writes - 1:  # no write between: its count holds
                torch.logical_not(keep, out=flag).logical_and_(top.valid)
                torch.sum(flag, -1, out=count).add_(top.over_cap)
            else:
                torch.sum(torch.gt(logits, NEG_INF, out=b.mask(0, r)), -1, out=count)
                count.sub_(torch.sum(keep, -1, out=b.take("count2", r)))
            self._changed.add_(count.mul_(rows))
            self._drops.append(_drop(rows, toks, b.take("kept", r)))

    def update(self, row_idx: torch.Tensor, new_logits: torch.Tensor) -> None:
        """Set ``logits[row_idx]`` to ``new_logits`` ``[len(row_idx), V]`` on candidate entries
        only (dense: prefer :meth:`update_candidates` when only candidates change)."""
        if row_idx.numel() == 0:
            return
        old = self.logits[row_idx]
        cand = old > float("-inf")
        new = torch.where(cand, new_logits.to(old.dtype), old)
        logits = self.logits  # not self: an undo entry must not keep the view alive
        self._undo.append(lambda: logits.index_put_((row_idx,), old))
        self.wrote = True
        self._writes += 1
        self.logits[row_idx] = new
        self._candidates = None
        self._changed.index_add_(0, row_idx, count_rows(cand & (new != old)))

    def update_all(
        self, new_logits: torch.Tensor, buffers: GuideBuffers, rows: torch.Tensor | None = None
    ) -> None:
        """Set every row's candidate entries to ``new_logits [R, V]`` (the logits' dtype),
        allocating nothing: ``new_logits`` becomes the values to write (filtered-out entries
        taken from the logits) and is copied into them when the guide returns, so no copy
        is kept for undo; leave it untouched until then. ``rows`` (bool ``[R]``): only those
        rows are written, the others keep their logits bit for bit. ``buffers``
        (``dense``) hold the masks that count what changed."""
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
        self.wrote = True
        self._writes += 1
        self._candidates = None
        self._drops.append(lambda logits: logits.copy_(new_logits))

    def changed_per_row(self) -> torch.Tensor:
        """Logits changed through this view so far, per row (int64 ``[R]``, on the logits'
        device: reading it is up to the caller)."""
        return self._changed

    def guided_counts(self) -> tuple[int, int]:
        """``(rows_guided, candidates_guided)`` in one host read."""
        c = self._changed
        rows, cands = torch.stack([(c > 0).sum(), c.sum()]).cpu().tolist()
        return rows, cands

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
    """A drop_rest write: every candidate of the selected ``rows`` outside their ``toks`` to
    -inf, in place (the rows to -inf, then the kept values back; ``kept``: where to hold
    them, None to allocate)."""

    def apply(logits: torch.Tensor) -> None:
        k = logits.gather(1, toks) if kept is None else torch.gather(logits, 1, toks, out=kept)
        logits.masked_fill_(rows[:, None], NEG_INF)
        logits.scatter_(1, toks, k)

    return apply
