"""Preallocated temporaries of a :class:`~tllm_core.api.bundles.GuideView`'s fixed-size
writes (:meth:`GuideView.top_candidates`, :meth:`GuideView.update_all`): made once, sized for
the most rows a step can have, so that guidance allocates nothing per step."""

from __future__ import annotations

import torch

from tllm_core.api.workspace import WorkspaceSpec, carve_workspace, workspace_bytes


def guide_buffers_spec(rows: int, vocab: int, top_k: int | None, dense: bool) -> WorkspaceSpec:
    """The parts: with ``top_k``, the search and its write (``[rows, k]`` slots and a
    ``[rows, vocab]`` mask); with ``dense``, two ``[rows, vocab]`` masks (the first shared)."""
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
    """Temporaries for views of up to ``rows`` rows over ``vocab`` tokens: the search of
    ``top_k`` candidates per row and whole-row writes (``dense``), in one allocation."""

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
