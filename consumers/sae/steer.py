"""Steering by SAE feature: ``{"feature": f, "scale": s}`` adds ``s * W_dec[f]``;
``{"feature": f, "clamp": v}`` adds ``decode(a with a_f = v) - decode(a)``, in the forward."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from consumers.sae.model import SparseAutoencoder
from tllm_core import FiniteF32

MAX_STEER_ENTRIES = 1024  # per steering list (config or request)
MAX_FEATURE = 2**31 - 1


class FeatureSteer(BaseModel):
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
    """``ValueError`` for an index outside the SAE (``where.format(i)`` names the ``i``-th)."""
    for i, f in enumerate(features):
        if not 0 <= f < d_sae:
            raise ValueError(
                f"{where.format(i)} is {f}: the SAE has {d_sae} features (valid: 0..{d_sae - 1})"
            )


@torch.no_grad()
def clamp_delta(
    sae: SparseAutoencoder, x: torch.Tensor, clamps: list[tuple[int, float]]
) -> torch.Tensor:
    """``decode(a') - decode(a)`` (fp32) for rows ``x``, ``a = encode(x)``, ``a'[:, f] = v``
    per clamp (for a top-k SAE even when ``f`` is not among the row's ``k``)."""
    acts, state = sae.encode(x)
    changed = acts.clone()
    for f, v in clamps:
        changed[:, f] = v
    return sae.decode(changed, state) - sae.decode(acts, state)


class Clamp(torch.nn.Module):
    """The in-graph edit of the config's clamps: ``x + clamp_delta(sae, x, clamps)``."""

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
        """Rows clamped since the last call (between forwards)."""
        n = int(self.rows_done.item())
        if n:
            self.rows_done.sub_(n)
        return n
