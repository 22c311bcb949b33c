"""Steering by SAE feature: ``{"feature": f, "scale": s}`` adds ``s * W_dec[f]``;
``{"feature": f, "clamp": v}`` sets feature ``f`` to ``v`` and adds the difference of the two
reconstructions, ``x' = x + decode(a with a_f = v) - decode(a)`` (the SAE's error term kept),
which depends on the row itself and so runs in the forward (:class:`Clamp`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from consumers.sae.model import SparseAutoencoder
from tllm_core import FiniteF32

# Entries of one steering list (config or request): each is a vector add or a clamp per row.
MAX_STEER_ENTRIES = 1024
# Feature indices index int32-sized tensors.
MAX_FEATURE = 2**31 - 1


class FeatureSteer(BaseModel):
    """One steering entry: exactly one of ``scale`` and ``clamp``."""

    model_config = ConfigDict(extra="forbid")
    feature: int = Field(
        ..., ge=0, le=MAX_FEATURE, description="SAE feature index (0 <= feature < d_sae)."
    )
    scale: FiniteF32 | None = Field(None, description="Add scale * W_dec[feature] to every row.")
    clamp: FiniteF32 | None = Field(
        None,
        description="Set the feature's activation to this value in every row (encode, set, "
        "decode the difference, add it).",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> FeatureSteer:
        if (self.scale is None) == (self.clamp is None):
            raise ValueError(
                f"feature {self.feature}: give exactly one of 'scale' and 'clamp', got "
                f"scale={self.scale!r}, clamp={self.clamp!r}"
            )
        return self


def check_features(features: Iterable[int], d_sae: int, where: str) -> None:
    """Raise ``ValueError`` for a feature index outside the SAE (``where.format(i)`` names
    the ``i``-th)."""
    for i, f in enumerate(features):
        if not 0 <= f < d_sae:
            raise ValueError(
                f"{where.format(i)} is {f}: the SAE has {d_sae} features (valid: 0..{d_sae - 1})"
            )


@torch.no_grad()
def clamp_delta(
    sae: SparseAutoencoder, x: torch.Tensor, clamps: list[tuple[int, float]]
) -> torch.Tensor:
    """``decode(a') - decode(a)`` for rows ``x [R, d_in]``, ``a = encode(x)`` and ``a'`` equal
    to ``a`` but ``a'[:, f] = v`` per clamp (for a top-k SAE even when ``f`` is not among the
    row's ``k``). fp32 ``[R, d_in]``."""
    acts, state = sae.encode(x)
    changed = acts.clone()
    for f, v in clamps:
        changed[:, f] = v
    return sae.decode(changed, state) - sae.decode(acts, state)


class Clamp(torch.nn.Module):
    """The in-graph edit of the config's clamps: ``x + clamp_delta(sae, x, clamps)`` in
    ``x``'s dtype, on each selected row; tensor operations only."""

    def __init__(self, sae: SparseAutoencoder, clamps: list[tuple[int, float]]):
        super().__init__()
        self.sae = sae
        self.clamps = clamps
        # Rows the forward clamped, counted in the graph where the work happens.
        self.rows_done = torch.zeros((), dtype=torch.int64, device=sae.device)

    def forward(self, s: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.rows_done.add_(rows.sum())
        return (s.float() + clamp_delta(self.sae, s, self.clamps)).to(s.dtype)

    def take_rows(self) -> int:
        """Rows clamped since the last call; call between forwards (engine thread)."""
        n = int(self.rows_done.item())
        if n:
            self.rows_done.sub_(n)
        return n
