"""The sampler steps around guidance, as vLLM's sampler orders them: greedy rows take the argmax
of the raw logits; random rows are divided by their temperature, filtered by min-p, then
top-k / top-p (non-candidates ``-inf``), handed to the guiding consumers, and drawn."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # vLLM treats a temperature below this as greedy


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings (the fields of vLLM's ``SamplingParams`` the kit uses)."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature", ">= 0"),
            (self.top_k >= 0, "top_k", ">= 0 (0: off)"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", "in [0, 1]"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def filter_logits(logits: torch.Tensor, params: list[Sampling]) -> tuple[torch.Tensor, bool]:
    """``(filtered, filtered_any)``: fp32 logits divided by temperature (greedy rows by 1), min-p
    then top-k / top-p applied per row (removed entries ``-inf``); ``filtered_any`` as the
    ``GuideView.filtered`` flag: a top-k or top-p for the batch, or min-p > 0 for a row."""
    out = logits.float().clone()
    temp = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=out.dtype)
    out /= temp[:, None]
    for i, p in enumerate(params):
        row = out[i]
        if p.min_p > 0:
            probs = row.softmax(-1)
            row.masked_fill_(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k and p.top_k < row.numel():
            kth = row.topk(p.top_k).values[-1]
            row.masked_fill_(row < kth, float("-inf"))
        if p.top_p < 1.0:
            # Keep the smallest set of highest logits whose probability reaches top_p.
            vals, idx = row.sort(descending=True)
            before = vals.softmax(-1).cumsum(-1) - vals.softmax(-1)  # mass above each entry
            drop = before >= p.top_p
            drop[0] = False
            row[idx[drop]] = float("-inf")
    filtered = any(p.top_k or p.top_p < 1.0 or p.min_p > 0 for p in params)
    return out, filtered


def draw(
    raw: torch.Tensor, guided: torch.Tensor, params: list[Sampling], gens: list[torch.Generator]
) -> torch.Tensor:
    """Token per row: greedy rows the argmax of the raw logits, random rows a draw from the
    softmax of the (guided) filtered logits with the request's generator."""
    out = torch.empty(len(params), dtype=torch.long)
    for i, p in enumerate(params):
        if p.greedy:
            out[i] = raw[i].argmax()
        else:
            probs = guided[i].softmax(-1)
            out[i] = torch.multinomial(probs, 1, generator=gens[i])[0]
    return out
