"""ESamp guidance's math (temporaries new or in ``ws``); ``dist`` logits get the temperature."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from algorithms.esamp.kernels import candidate_dot

if TYPE_CHECKING:
    from algorithms.esamp.guide_workspace import GuideWorkspace


def take(
    ws: GuideWorkspace | None,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A ``shape`` temporary: a view of the workspace's part ``name``, else a new tensor."""
    if ws is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return ws.parts[name].view(-1)[: math.prod(shape)].view(shape)


def mix_candidates(
    ref: torch.Tensor,
    dist: torch.Tensor,
    beta: torch.Tensor | float,
    temperature: torch.Tensor,
    ws: GuideWorkspace | None = None,
) -> torch.Tensor:
    """The ESamp mix of candidate entries: ``(1+beta)*ref - beta*dist/T`` (fp32, broadcast)."""
    dev, f32 = ref.device, torch.float32
    beta = torch.as_tensor(beta, dtype=f32, device=dev)
    one_b = torch.add(beta, 1, out=take(ws, "one_b", tuple(beta.shape), f32, dev))
    new = torch.mul(one_b, ref, out=take(ws, "mix", tuple(ref.shape), f32, dev))
    scaled = torch.mul(dist, beta, out=take(ws, "dist", tuple(dist.shape), f32, dev))
    return new.sub_(scaled.div_(temperature))


def _per_row(beta: torch.Tensor | float) -> torch.Tensor | float:
    """A per-row beta ``[R]`` as a column ``[R, 1]``; a float stays a float."""
    return beta[:, None] if isinstance(beta, torch.Tensor) else beta


def mix_full_vocab_logits(
    ref_logits: torch.Tensor,
    dist_logits: torch.Tensor,
    beta: torch.Tensor | float,
    temperature: torch.Tensor,
    inplace: bool = False,
    ws: GuideWorkspace | None = None,
) -> torch.Tensor:
    """Whole-vocabulary mix ``(1+beta)*ref - beta*dist/T``; ``inplace``: into ``dist_logits``."""
    if not isinstance(beta, torch.Tensor) and beta == 0:
        return ref_logits.clone()
    dev, b = ref_logits.device, _per_row(beta)
    if not inplace:
        dist_logits = dist_logits.to(ref_logits.dtype, copy=True)
    t = temperature.to(ref_logits.dtype)[:, None]
    b = torch.as_tensor(b, dtype=torch.float32, device=dev)
    one_b = torch.add(b, 1, out=take(ws, "one_b", tuple(b.shape), torch.float32, dev))
    # -(b*dist/t) + (1+b)*ref in one fused pass
    return dist_logits.mul_(b).div_(t).neg_().addcmul_(ref_logits, one_b)


def mix_latent(
    h_target: torch.Tensor,
    f_pred: torch.Tensor,
    beta: torch.Tensor | float,
    ws: GuideWorkspace | None = None,
) -> torch.Tensor:
    """Latent mix ``(1+beta)*h_L - beta*f(h_1)`` (fp32): exact for a plain linear head."""
    dev, f32 = f_pred.device, torch.float32
    b = torch.as_tensor(_per_row(beta), dtype=f32, device=dev)
    one_b = torch.add(b, 1, out=take(ws, "one_b", tuple(b.shape), f32, dev))
    h = take(ws, "hf", tuple(h_target.shape), f32, dev).copy_(h_target).mul_(one_b)
    return h.sub_(torch.mul(f_pred, b, out=take(ws, "fb", tuple(f_pred.shape), f32, dev)))


def candidate_dist(
    f_pred: torch.Tensor,
    rows: torch.Tensor,
    toks: torch.Tensor,
    weight: torch.Tensor | None,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    dense_fraction: float = 0.25,
) -> torch.Tensor:
    """Raw dist logits (fp32) of pairs ``(rows, toks)``: a gather-dot, else ``lm_head`` gathered."""
    n = rows.numel()
    if weight is not None and n <= dense_fraction * f_pred.shape[0] * weight.shape[0]:
        out = torch.empty(n, dtype=torch.float32, device=f_pred.device)
        return candidate_dot(weight, f_pred.float(), rows, toks, out)
    return lm_head(f_pred).float()[rows, toks]


def _unit_noise(
    out: torch.Tensor, norm: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """Gaussian rows into ``out``, scaled to unit norm (clamped at 1e-12)."""
    torch.randn(out.shape, generator=generator, out=out)
    torch.linalg.vector_norm(out, dim=-1, out=norm).clamp_min_(1e-12)
    return out.div_(norm[:, None])


def noise_prediction(
    h_target: torch.Tensor,
    f_pred: torch.Tensor,
    generator: torch.Generator | None = None,
    ws: GuideWorkspace | None = None,
) -> torch.Tensor:
    """Noise ablation: ``h_L - n``, ``n`` Gaussian with the real error's per-row norm."""
    (n, hidden), dev, f32 = f_pred.shape, f_pred.device, torch.float32
    h = take(ws, "hf", (n, hidden), f32, dev).copy_(h_target)
    out = take(ws, "fn", (n, hidden), f32, dev)
    err = torch.linalg.vector_norm(
        torch.sub(h, f_pred, out=out), dim=-1, out=take(ws, "fn_err", (n,), f32, dev)
    )
    _unit_noise(out, take(ws, "fn_norm", (n,), f32, dev), generator).mul_(err[:, None])
    return torch.sub(h, out, out=out)


def f_noise_prediction(
    f_pred: torch.Tensor, generator: torch.Generator | None = None, ws: GuideWorkspace | None = None
) -> torch.Tensor:
    """f-noise ablation: Gaussian noise with the prediction's per-row norm."""
    (n, hidden), dev, f32 = f_pred.shape, f_pred.device, torch.float32
    norm = torch.linalg.vector_norm(f_pred, dim=-1, out=take(ws, "fn_err", (n,), f32, dev))
    out = _unit_noise(
        take(ws, "fn", (n, hidden), f32, dev), take(ws, "fn_norm", (n,), f32, dev), generator
    )
    return out.mul_(norm[:, None])


def relative_error(
    h_target: torch.Tensor, f_pred: torch.Tensor, ws: GuideWorkspace | None = None
) -> torch.Tensor:
    """Per row ``||h_target - f_pred|| / ||h_target||`` (fp32; 1 where the latter is 0 or NaN)."""
    (n, hidden), dev, f32 = h_target.shape, h_target.device, torch.float32
    h = take(ws, "hf", (n, hidden), f32, dev).copy_(h_target)
    den = torch.linalg.vector_norm(h, dim=-1, out=take(ws, "den", (n,), f32, dev))
    num = torch.linalg.vector_norm(h.sub_(f_pred), dim=-1, out=take(ws, "num", (n,), f32, dev))
    safe = torch.clamp_min(den, 1e-30, out=take(ws, "rtmp", (n,), f32, dev))
    rel = torch.div(num, safe, out=take(ws, "rel", (n,), f32, dev))
    ok = torch.gt(den, 0, out=take(ws, "rmask", (n,), torch.bool, dev))
    return rel.masked_fill_(ok.logical_not_(), 1.0)


def mixed_rows(
    f_pred: torch.Tensor, betas: torch.Tensor, ws: GuideWorkspace | None = None
) -> torch.Tensor:
    """Which rows are mixed: a finite prediction (``sum(f * 0) == 0``) and ``beta != 0``."""
    (n, hidden), dev = f_pred.shape, f_pred.device
    zeros = torch.mul(f_pred, 0, out=take(ws, "hf", (n, hidden), torch.float32, dev))
    fin = torch.sum(zeros, -1, out=take(ws, "fin", (n,), torch.float32, dev))
    mixed = torch.eq(fin, 0, out=take(ws, "mixed", (n,), torch.bool, dev))
    return mixed.logical_and_(torch.ne(betas, 0, out=take(ws, "bmask", (n,), torch.bool, dev)))


def fit_scale(err: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """beta_schedule 'fit': the factor ``clamp(1 - err, 0, 1)`` of a group's recent error."""
    return torch.neg(err, out=out).add_(1.0).clamp_(0.0, 1.0)


def candidate_shift(
    before: torch.Tensor,
    after: torch.Tensor,
    live: torch.Tensor,
    tokens: torch.Tensor | None = None,
    ws: GuideWorkspace | None = None,
) -> torch.Tensor:
    """How a mix moved each row's ``live`` candidates: fp32 ``[R, 4]`` (count, top token before,
    after, total-variation distance); a row without any: 0, -1, -1, 0."""
    (r, k), dev, f32 = before.shape, before.device, torch.float32
    out = take(ws, "dg_rows", (r, 4), f32, dev)
    count = torch.sum(live, -1, out=take(ws, "dg_cnt", (r,), torch.long, dev))
    out[:, 0].copy_(count)
    ninf = torch.full((), float("-inf"), device=dev) if ws is None else ws.parts["ninf"]

    def probs(x: torch.Tensor, part: str, col: int) -> torch.Tensor:
        xm = torch.where(live, x, ninf, out=take(ws, "dg_x", (r, k), f32, dev))
        top = torch.argmax(xm, -1, keepdim=True, out=take(ws, "dg_arg", (r, 1), torch.long, dev))
        if tokens is not None:
            top = torch.gather(tokens, 1, top, out=take(ws, "dg_tok", (r, 1), torch.long, dev))
        out[:, col : col + 1].copy_(top)
        mx = torch.amax(xm, -1, keepdim=True, out=take(ws, "dg_mx", (r, 1), f32, dev))
        e = torch.sub(xm, mx, out=take(ws, part, (r, k), f32, dev)).exp_()
        return e.div_(torch.sum(e, -1, keepdim=True, out=take(ws, "dg_s", (r, 1), f32, dev)))

    p, q = probs(before, "dg_p", 1), probs(after, "dg_q", 2)
    torch.sum(p.sub_(q).abs_(), -1, out=out[:, 3]).div_(2)
    none = torch.eq(count[:, None], 0, out=take(ws, "dg_none", (r, 1), torch.bool, dev))
    out[:, 1:3].masked_fill_(none, -1)
    out[:, 3:].masked_fill_(none, 0)  # not NaN (0/0)
    return out
