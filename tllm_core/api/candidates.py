"""A guided step's candidates (logits ``> -inf`` after filtering) and :class:`GuideBuffers`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tllm_core.api.workspace import WorkspaceSpec, carve_workspace, workspace_bytes

NEG_INF = float("-inf")


def candidate_entries(logits: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits > -inf).nonzero(as_tuple=True)`` at a fraction of its cost: a max per block of
    ``block`` tokens, then an exact scan of the blocks holding a candidate."""
    r, v = logits.shape
    nb = v // block
    if nb == 0 or logits.stride(-1) != 1:
        return (logits > NEG_INF).nonzero(as_tuple=True)
    main = logits[:, : nb * block].view(r, nb, block)
    br, bb = (main.amax(-1) != NEG_INF).nonzero(as_tuple=True)
    k, j = (main[br, bb] > NEG_INF).nonzero(as_tuple=True)
    rows, toks = br[k], bb[k] * block + j
    if v > nb * block:  # the tail past the last whole block, merged back in row order
        tr, tt = (logits[:, nb * block :] > NEG_INF).nonzero(as_tuple=True)
        if tr.numel():
            rows, toks = torch.cat([rows, tr]), torch.cat([toks, tt + nb * block])
            order = torch.argsort(rows * v + toks)
            rows, toks = rows[order], toks[order]
    return rows, toks


def count_rows(mask: torch.Tensor, block: int = 8, out: torch.Tensor | None = None) -> torch.Tensor:
    """True entries per row of a bool ``[R, V]`` mask; on CPU a few rows at a time (a bool
    sum there first casts all of it to int64)."""
    if mask.device.type != "cpu" or mask.shape[0] == 0:  # a GPU reduces bools directly
        return torch.sum(mask, -1, out=out)
    parts = [mask[i : i + block].sum(-1) for i in range(0, mask.shape[0], block)]
    return torch.cat(parts, out=out)


def guide_buffers_spec(rows: int, vocab: int, top_k: int | None, dense: bool) -> WorkspaceSpec:
    """The parts of :class:`GuideBuffers` (``dense``: two ``[rows, vocab]`` masks)."""
    spec: list = [("count", (rows,), torch.long), ("count2", (rows,), torch.long)]
    if dense or top_k is not None:
        spec.append(("masks", (2 if dense else 1, rows, vocab), torch.bool))
    if top_k is not None:
        k = min(top_k, vocab)
        spec += [
            ("tokens", (rows, k), torch.long),
            ("logits", (rows, k), torch.float32),
            ("valid", (rows, k), torch.bool),
            ("over_cap", (rows,), torch.long),
            ("old", (rows, k), torch.float32),
            ("new", (rows, k), torch.float32),
            ("keep", (rows, k), torch.bool),
            ("flag", (rows, k), torch.bool),
            ("kept", (rows, k), torch.float32),
        ]
    return spec


class GuideBuffers:
    """One allocation of temporaries for guide views of up to ``rows`` rows (docs/ports.md)."""

    def __init__(
        self,
        rows: int,
        vocab: int,
        device: torch.device | str,
        *,
        top_k: int | None = None,
        dense: bool = False,
    ):
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        self.rows, self.vocab, self.dense = rows, vocab, dense
        self.top_k = None if top_k is None else min(top_k, vocab)
        self.flat, self.parts = carve_workspace(
            guide_buffers_spec(rows, vocab, top_k, dense), device
        )

    @staticmethod
    def nbytes(rows: int, vocab: int, top_k: int | None = None, dense: bool = False) -> int:
        """Device bytes of ``GuideBuffers(rows, vocab, ..., top_k=top_k, dense=dense)``."""
        return workspace_bytes(guide_buffers_spec(rows, vocab, top_k, dense))

    def take(self, name: str, rows: int) -> torch.Tensor:
        """Part ``name``'s first ``rows`` rows (the masks: ``[rows, vocab]`` of the first)."""
        if rows > self.rows:
            raise ValueError(
                f"a view of {rows} rows needs more than these guide buffers' {self.rows} rows"
            )
        t = self.parts[name]
        return t[0, :rows] if name == "masks" else t[:rows]

    def mask(self, i: int, rows: int) -> torch.Tensor:
        """Mask ``i`` (0, or 1 with ``dense``) for ``rows`` rows, ``[rows, vocab]`` bool."""
        self.take("count", rows)  # the row check
        return self.parts["masks"][i, :rows]


def part(buffers: GuideBuffers | None, name: str, rows: int) -> torch.Tensor | None:
    """``out=`` for a temporary: a row view of ``buffers``, or None (allocate)."""
    return None if buffers is None else buffers.take(name, rows)


@dataclass(frozen=True)
class Candidates:
    """A ``GuideView``'s candidate entries, row-major: token ``tokens[j]`` of row ``rows[j]``."""

    rows: torch.Tensor  # int64 [N]: view row of each entry
    tokens: torch.Tensor  # int64 [N]
    logits: torch.Tensor  # fp32 [N]

    def __len__(self) -> int:
        return int(self.rows.numel())


@dataclass(frozen=True)
class TopCandidates:
    """Each row's ``k`` highest candidates, unordered (``over_cap[i]``: those left out)."""

    tokens: torch.Tensor  # int64 [R, k]
    logits: torch.Tensor  # fp32 [R, k]
    valid: torch.Tensor  # bool [R, k]
    over_cap: torch.Tensor  # int64 [R]
    version: int = -1  # the view's write count when taken (-1: not from a view)
    # The preallocated buffers these tensors are views of; a write takes its temporaries there.
    buffers: GuideBuffers | None = None


def top_candidate_entries(
    logits: torch.Tensor, k: int, version: int = -1, buffers: GuideBuffers | None = None
) -> TopCandidates:
    """The ``k`` (at most ``V``) highest candidates of each row of ``logits [R, V]``, in shapes
    fixed by ``R`` and ``k``; with ``buffers`` (``top_k=k``) every tensor is a view of them."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    k = min(k, logits.shape[-1])
    b, r = buffers, logits.shape[0]
    if b is not None and (b.top_k != k or b.vocab != logits.shape[-1]):
        raise ValueError(
            f"guide buffers made for top_k={b.top_k} over {b.vocab} tokens cannot hold "
            f"{k} candidates of {logits.shape[-1]} tokens"
        )
    outs = None if b is None else (b.take("logits", r), b.take("tokens", r))
    vals, toks = torch.topk(logits, k, dim=-1, sorted=False, out=outs)
    valid = torch.gt(vals, NEG_INF, out=part(b, "valid", r))
    # Counted, not assumed to be count - k: a NaN logit is no candidate but tops the order.
    cands = torch.gt(logits, NEG_INF, out=part(b, "masks", r))
    over = count_rows(cands, out=part(b, "over_cap", r))
    over.sub_(torch.sum(valid, -1, out=part(b, "count", r)))
    return TopCandidates(toks, vals, valid, over, version, b)
