"""Typed bundles handed to consumers, and the in-step views for edits and guidance."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tllm_core.rows import RowInfo


@dataclass
class Bundle:
    """What one engine step produced for one consumer's read ports.

    ``hidden[key]`` is ``[len(rows), hidden_size]`` (key ``"layer.{i}"`` or ``"final"``);
    ``rows`` is the union of the phases the consumer's hidden-state ports select.
    ``logits`` / ``sampled_token_ids`` belong to ``sampled_rows``: the rows whose sampled
    token is kept (the last row of a finished prefill, every decode row).

    End-of-step bundles hold device tensors valid only during the call; background
    bundles hold host copies the consumer may keep.
    """

    step: int
    rows: RowInfo
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)
    sampled_rows: RowInfo | None = None
    logits: torch.Tensor | None = None
    sampled_token_ids: torch.Tensor | None = None


class EditPlan:
    """Edits a consumer asks for before this step's forward (write port ``ResidualEdit``).

    Row indices index ``rows`` (all token rows of the step). Edits compose per row as
    ``s' = keep·s + add − ((s·u)·u)`` with ``u`` the ablation direction.
    """

    def __init__(
        self, rows: RowInfo, allowed_layers: set[int], hidden_size: int, num_layers: int = 0
    ):
        self.rows = rows
        self._num_layers = num_layers
        self._allowed = allowed_layers
        self._hidden_size = hidden_size
        # layer -> list of (row indices, kind, tensor)
        self.ops: dict[int, list[tuple[np.ndarray, str, torch.Tensor]]] = {}

    def _push(self, layer: int, rows: np.ndarray, kind: str, value: torch.Tensor) -> None:
        if layer < 0 and self._num_layers:
            layer += self._num_layers  # same indexing as the ResidualEdit port
        if layer not in self._allowed:
            raise ValueError(
                f"layer {layer} was not declared as a ResidualEdit port by this consumer "
                f"(declared: {sorted(self._allowed)})"
            )
        if value.shape[-1] != self._hidden_size:
            raise ValueError(
                f"edit vector has size {value.shape[-1]}, the model's hidden size is "
                f"{self._hidden_size}"
            )
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size:
            self.ops.setdefault(layer, []).append((rows, kind, value))

    def restrict(self, mask: np.ndarray) -> None:
        """Drop ops on rows outside ``mask`` (rows of requests the consumer may not touch)."""
        for layer, ops in list(self.ops.items()):
            kept = []
            for rows, kind, value in ops:
                sel = mask[rows]
                if sel.any():
                    v = value[torch.from_numpy(sel)] if value.dim() == 2 else value
                    kept.append((rows[sel], kind, v))
            self.ops[layer] = kept

    def add(self, layer: int, rows: np.ndarray, vector: torch.Tensor) -> None:
        """Add ``vector`` (``[H]`` or ``[len(rows), H]``) to the stream after ``layer``."""
        self._push(layer, rows, "add", vector)

    def replace(self, layer: int, rows: np.ndarray, values: torch.Tensor) -> None:
        """Replace the stream after ``layer`` at ``rows`` with ``values``."""
        self._push(layer, rows, "replace", values)

    def ablate(self, layer: int, rows: np.ndarray, direction: torch.Tensor) -> None:
        """Remove the component of the stream along ``direction`` (``[H]`` or one per row
        ``[len(rows), H]``; each normalised here)."""
        d = direction.float()
        u = d / d.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        self._push(layer, rows, "ablate", u)


def candidate_entries(logits: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, tokens)`` of the entries ``> -inf`` of ``logits [R, V]``, row-major: what
    ``(logits > -inf).nonzero(as_tuple=True)`` returns, at a fraction of its cost.

    Filters leave a few dozen candidates among tens of thousands of tokens, and a full
    ``nonzero`` pass over ``R x V`` is single-threaded. So: one max per block of ``block``
    tokens, ``nonzero`` over those blocks only, then an exact scan inside the blocks that
    hold a candidate. A block max that is NaN keeps the block (the exact scan decides).
    """
    r, v = logits.shape
    nb = v // block
    if nb == 0 or logits.stride(-1) != 1:
        return (logits > float("-inf")).nonzero(as_tuple=True)
    main = logits[:, : nb * block].view(r, nb, block)
    br, bb = (main.amax(-1) != float("-inf")).nonzero(as_tuple=True)
    k, j = (main[br, bb] > float("-inf")).nonzero(as_tuple=True)
    rows, toks = br[k], bb[k] * block + j
    if v > nb * block:  # the tail past the last whole block, merged back in row order
        tr, tt = (logits[:, nb * block :] > float("-inf")).nonzero(as_tuple=True)
        if tr.numel():
            rows, toks = torch.cat([rows, tr]), torch.cat([toks, tt + nb * block])
            order = torch.argsort(rows * v + toks)
            rows, toks = rows[order], toks[order]
    return rows, toks


@dataclass(frozen=True)
class Candidates:
    """The candidate entries of a :class:`GuideView`: the finite logits, row-major.

    Entry ``j`` is token ``tokens[j]`` of view row ``rows[j]``, with current (temperature-
    scaled) logit ``logits[j]``. Write back through :meth:`GuideView.update_candidates`
    with indices into these entries.
    """

    rows: torch.Tensor  # int64 [N]: view row of each entry
    tokens: torch.Tensor  # int64 [N]
    logits: torch.Tensor  # fp32 [N]

    def __len__(self) -> int:
        return int(self.rows.numel())


class GuideView:
    """The sampler's view for one step (write port ``SamplerGuide``).

    ``logits`` are fp32, already divided by each row's temperature and filtered by
    top-k/top-p/min-p: non-candidates are ``-inf``. Row ``i`` of ``logits`` belongs to
    ``rows[i]``. Change logits only through :meth:`update_candidates` (sparse: the few
    surviving candidates) or :meth:`update` (dense rows); both keep filtered-out entries at
    ``-inf``, leave other entries bit for bit and count what changed.
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
    ):
        self.step = step
        self.rows = rows
        self.logits = logits
        self.temperature = temperature
        self.is_random = is_random
        self.filtered = filtered
        self._hidden = hidden
        self.rows_guided = 0
        self.candidates_guided = 0
        self._candidates: Candidates | None = None
        # Undo log (old values of every write) so a consumer that raises leaves nothing behind.
        self._undo: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]] = []

    def hidden(self, key: str) -> torch.Tensor:
        """Captured states (``"layer.{i}"`` / ``"final"``) at the sampling rows, ``[R, H]``."""
        try:
            return self._hidden[key]
        except KeyError:
            raise KeyError(
                f"{key!r} is not captured in this step; declare a HiddenStates port for it "
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
        self._undo.append(((rows, toks), cand.logits[entries]))
        self.logits[rows, toks] = new_logits.to(self.logits.dtype)
        self._candidates = None
        self.rows_guided += int(torch.unique(rows).numel())
        self.candidates_guided += int(entries.numel())

    def update(self, row_idx: torch.Tensor, new_logits: torch.Tensor) -> None:
        """Set ``logits[row_idx]`` to ``new_logits`` ``[len(row_idx), V]`` on candidate entries
        only (dense: prefer :meth:`update_candidates` when only candidates change)."""
        if row_idx.numel() == 0:
            return
        old = self.logits[row_idx]
        cand = old > float("-inf")
        self._undo.append(((row_idx,), old))
        self.logits[row_idx] = torch.where(cand, new_logits.to(old.dtype), old)
        self._candidates = None
        self.rows_guided += int(row_idx.numel())
        self.candidates_guided += int(cand.sum())

    def rollback(self) -> None:
        """Undo every write made through this view (newest first)."""
        for index, old in reversed(self._undo):
            self.logits[index] = old
        self._undo.clear()
        self._candidates = None
