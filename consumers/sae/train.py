"""A tiny pure-torch SAE trainer for tests and the docs example (Adam on exported activations).
``standard``: MSE + L1 on decoder-weighted activations; ``topk``: MSE only; ``jumprelu``: as
``standard``, then each threshold set to a quantile of the feature's positive activations."""

from __future__ import annotations

import os

import torch

from consumers.export.reader import read_export
from consumers.sae.model import ARCHITECTURES, SparseAutoencoder


def activations_from_export(path: str | os.PathLike, key: str) -> torch.Tensor:
    """All rows of ``key`` (``"layer.{i}"``) of an export directory, fp32 ``[N, H]``."""
    rows = [rec.hidden[key].float() for rec in read_export(path)]
    if not rows:
        raise ValueError(f"export {os.fspath(path)!r} holds no rows")
    return torch.cat(rows)


def train_sae(
    x: torch.Tensor,
    d_sae: int,
    architecture: str = "standard",
    k: int | None = None,
    steps: int = 300,
    lr: float = 3e-3,
    l1_coefficient: float = 3e-2,
    batch_size: int = 256,
    threshold_quantile: float = 0.25,
    seed: int = 0,
) -> SparseAutoencoder:
    """Train an SAE of width ``d_sae`` on rows ``x [N, d_in]``; returns it on the CPU."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r}: allowed {', '.join(ARCHITECTURES)}")
    if architecture == "topk" and not k:
        raise ValueError("a topk SAE needs k >= 1")
    x = x.detach().float().cpu()
    n, d_in = x.shape
    g = torch.Generator().manual_seed(seed)
    # Train in units where rows have mean norm sqrt(d_in); fold the scale back at the end.
    scale = float(x.norm(dim=-1).mean().clamp_min(1e-6)) / d_in**0.5
    z = x / scale
    W_dec = torch.randn(d_sae, d_in, generator=g)
    W_dec = 0.1 * W_dec / W_dec.norm(dim=-1, keepdim=True)
    params = {
        "W_enc": W_dec.T.clone() * 10 / d_in**0.5,
        "b_enc": torch.zeros(d_sae),
        "W_dec": W_dec,
        "b_dec": z.mean(0),
    }
    for p in params.values():
        p.requires_grad_(True)
    opt = torch.optim.Adam(params.values(), lr=lr)
    train_arch = "topk" if architecture == "topk" else "standard"

    for _ in range(steps):
        batch = z[torch.randint(0, n, (min(batch_size, n),), generator=g)]
        sae = SparseAutoencoder(**params, architecture=train_arch, k=k)  # type: ignore[arg-type]
        acts, state = sae.encode(batch)
        recon = sae.decode(acts, state)
        loss = ((recon - batch) ** 2).sum(-1).mean() / d_in
        if train_arch == "standard":
            loss = loss + l1_coefficient * (acts * params["W_dec"].norm(dim=-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        out = {name: p.detach().clone() for name, p in params.items()}
        out["W_enc"] /= scale  # back to the units of x
        out["W_dec"] *= scale
        out["b_dec"] *= scale
        sae = SparseAutoencoder(**out, architecture=train_arch, k=k)  # type: ignore[arg-type]
        if architecture != "jumprelu":
            return sae
        acts, _ = sae.encode(x)
        thr = torch.zeros(d_sae)
        for f in range(d_sae):
            thr[f] = _threshold(acts[:, f][acts[:, f] > 0], threshold_quantile)
        sae.architecture = "jumprelu"
        sae.threshold = thr
        return sae


def _threshold(pos: torch.Tensor, quantile: float, rel_gap: float = 1e-3) -> float:
    """A threshold near the ``quantile`` of ``pos``, mid-gap between two of them: repeated rows
    (a shared first token) must not sit within rounding noise of it."""
    if pos.numel() == 0:
        return 0.0
    s = pos.sort().values
    gaps = s[1:] - s[:-1]
    clear = (gaps > rel_gap * s[1:].abs().clamp_min(1e-6)).nonzero().squeeze(1)
    if clear.numel() == 0:
        return float(s[0]) / 2
    target = quantile * (s.numel() - 1)
    j = int(clear[(clear.float() - target).abs().argmin()])
    return float(s[j] + s[j + 1]) / 2
