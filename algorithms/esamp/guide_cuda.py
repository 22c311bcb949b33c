"""ESamp's guided step on CUDA without a device allocation: the operations of
:class:`~algorithms.esamp.guide_step.GuideStep`'s general path (same order, same values),
each written into the preallocated :class:`~algorithms.esamp.guide_workspace.GuideWorkspace`
with ``out=`` and in-place forms, and no host read.

- post-filter: the fixed-size candidate search and its write take the view's
  :class:`~tllm_core.GuideBuffers`; the dist logits of the ``[R, k]`` candidates come from
  :func:`~algorithms.esamp.kernels.candidate_dot` into the workspace;
- full vocabulary: the mix is computed for every view row (fixed shapes: rows not guided
  get beta 0 and keep their logits) in one ``[R, V]`` fp32 buffer, the head's output in the
  model dtype in the view buffers' masks, and written with ``GuideView.update_all`` (no
  copy of the logits to undo it). The head is the plain weight product (the runtime gives
  ``lm_head_weight`` only for such a head); without a weight the model's head is called
  on the workspace's model-dtype rows (it allocates its ``[rows, vocab]`` output, logged at
  start; post-filter's gather of the candidates from it is a second, ``[R, k]``, one);
- ablations 'noise' and 'f_noise': the stand-in prediction is made in the workspace from the
  same generator, in the same order as the general path's;
- diagnostics: each guided row's values go into the workspace's ring
  (:class:`~algorithms.esamp.diagnostics.DeviceRecords`), read where a sync is paid anyway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from algorithms.esamp.guidance import candidate_dist_fn
from algorithms.esamp.guide_workspace import GuideWorkspace
from algorithms.esamp.shared import rows_id
from tllm_core import FINAL, GuideView

if TYPE_CHECKING:
    from algorithms.esamp.guide_step import GuideStep
    from tllm_core.api.candidates import TopCandidates


def guide_cuda(g: GuideStep, view: GuideView, sel: list[int], slots: list[int]) -> None:
    """One guided step for view rows ``sel`` (their groups' distiller ``slots``)."""
    s, cfg = g.s, g.s.cfg
    ws = g.workspace()
    r, n = len(view.rows), len(sel)
    ws.check_rows(r)
    all_rows = n == r and sel[-1] == n - 1  # every row, in order: no gathers
    host_betas = [g.beta_of(view.rows.requests[i]) for i in sel]
    fresh = []
    if g.fit is not None:
        fresh = g.fit.fresh(slots, [g.groups.by_slot[x] for x in slots])
    st = ws.stage(sel, host_betas, slots, fresh)
    idx, betas = st["idx"], st["betas"]
    x = _rows(view.hidden(s.src_key), idx, all_rows, ws, "x")
    # The update of the same rows reuses this forward (the rows' id says they are the same).
    f = f_real = s.predict(
        torch.tensor(slots, dtype=torch.long), x, rows_id(view.step, view.rows, sel)
    )
    if cfg.ablation == "noise":
        f = _noise(g, ws, _rows(view.hidden(s.tgt_key), idx, all_rows, ws, "hb"), f)
    elif cfg.ablation == "f_noise":
        f = _f_noise(g, ws, f)
    if g.fit is not None or g.records is not None:
        h_t = _rows(view.hidden(s.tgt_key), idx, all_rows, ws, "hb")
        rel = _relative_error(h_t, f_real, ws)
    if g.fit is not None:
        betas.mul_(g.fit.scale_into(ws, st["slots"], st["fresh"], rel))
    post_filter = cfg.mode == "post_filter" or (cfg.mode == "auto" and view.filtered)
    rec = None
    if g.records is not None:  # diagnostics: this step's rows in the device ring
        ages = [g.groups.by_slot[slot].age for slot in slots]
        rec = g.records.begin(ages, shift=post_filter and any(host_betas))
        rec[:n, 0].copy_(rel)
        rec[:n, 5].copy_(betas)
    if not any(host_betas):
        return  # nothing written: vLLM's own sampling call goes on
    mixed = _mixed(f, betas, ws)
    before = ws.take("before", r).copy_(view.changed_per_row())
    counts = ws.parts["counts"]
    if post_filter:
        _mix_top(g, view, ws, idx, f, betas, mixed, out_over=counts[2], rec=rec)
    else:
        counts[2].zero_()
        _mix_full(g, view, ws, idx, f, betas, mixed, all_rows)
    delta = torch.sub(view.changed_per_row(), before, out=before)
    torch.sum(torch.gt(delta, 0, out=ws.take("dmask", r)), 0, out=counts[0])
    torch.sum(delta, 0, out=counts[1])
    g.guided_sums.add(counts)


def _rows(
    t: torch.Tensor, idx: torch.Tensor, all_rows: bool, ws: GuideWorkspace, part: str
) -> torch.Tensor:
    """``t[idx]`` (``t`` itself for every row in order) in the workspace's ``part``."""
    if all_rows:
        return t
    buf = ws.take(part, idx.numel())
    if t.dtype != buf.dtype:  # not the model dtype: gathered as it is (allocates)
        return t[idx]
    return torch.index_select(t, 0, idx, out=buf)


def _unit_noise(g: GuideStep, out: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """Gaussian rows from the ablation's generator, scaled to unit norm (``n / ||n||``
    clamped at 1e-12, as in :func:`~algorithms.esamp.guidance.noise_prediction`)."""
    torch.randn(out.shape, generator=g._noise_gen, out=out)
    torch.linalg.vector_norm(out, dim=-1, out=norm).clamp_min_(1e-12)
    return out.div_(norm[:, None])


def _noise(g: GuideStep, ws: GuideWorkspace, h_rows: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """:func:`~algorithms.esamp.guidance.noise_prediction` (``h_L - n``, ``n`` of the error's
    norm) into the workspace's ``fn``; ``h_rows``: the target rows."""
    n = f.shape[0]
    h = ws.take("hf", n).copy_(h_rows)
    out = ws.take("fn", n)
    err = torch.linalg.vector_norm(torch.sub(h, f, out=out), dim=-1, out=ws.take("fn_err", n))
    _unit_noise(g, out, ws.take("fn_norm", n)).mul_(err[:, None])
    return torch.sub(h, out, out=out)


def _f_noise(g: GuideStep, ws: GuideWorkspace, f: torch.Tensor) -> torch.Tensor:
    """:func:`~algorithms.esamp.guidance.f_noise_prediction` (noise of ``f``'s norm) into the
    workspace's ``fn``."""
    n = f.shape[0]
    norm = torch.linalg.vector_norm(f, dim=-1, out=ws.take("fn_err", n))
    return _unit_noise(g, ws.take("fn", n), ws.take("fn_norm", n)).mul_(norm[:, None])


def _relative_error(h: torch.Tensor, f: torch.Tensor, ws: GuideWorkspace) -> torch.Tensor:
    """:func:`~algorithms.esamp.guidance.relative_error` into the workspace."""
    n = h.shape[0]
    hf = ws.take("hf", n).copy_(h)
    den = torch.linalg.vector_norm(hf, dim=-1, out=ws.take("den", n))
    num = torch.linalg.vector_norm(hf.sub_(f), dim=-1, out=ws.take("num", n))
    rel = torch.div(num, torch.clamp_min(den, 1e-30, out=ws.take("rtmp", n)), out=ws.take("rel", n))
    # where(den > 0, num / den, 1): a zero (or NaN) norm counts as 1
    return rel.masked_fill_(torch.gt(den, 0, out=ws.take("rmask", n)).logical_not_(), 1.0)


def _mixed(f: torch.Tensor, betas: torch.Tensor, ws: GuideWorkspace) -> torch.Tensor:
    """``isfinite(f).all(-1) & (betas != 0)``: a row's ``f * 0`` sums to 0 exactly when all
    its values are finite (NaN otherwise)."""
    n = f.shape[0]
    fin = torch.sum(torch.mul(f, 0, out=ws.take("hf", n)), -1, out=ws.take("fin", n))
    mixed = torch.eq(fin, 0, out=ws.take("mixed", n))
    return mixed.logical_and_(torch.ne(betas, 0, out=ws.take("bmask", n)))


def _positions(
    ws: GuideWorkspace, r: int, idx: torch.Tensor, mixed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per view row: its position in the prediction (0 where none) and whether it is mixed
    (``guide_step._f_positions``)."""
    pos = ws.take("pos", r).zero_().index_copy_(0, idx, ws.take("arange", idx.numel()))
    live = ws.take("live", r).zero_().index_copy_(0, idx, mixed)
    return pos, live


def _mix_top(
    g: GuideStep,
    view: GuideView,
    ws: GuideWorkspace,
    idx: torch.Tensor,
    f: torch.Tensor,
    betas: torch.Tensor,
    mixed: torch.Tensor,
    out_over: torch.Tensor,
    rec: torch.Tensor | None = None,
) -> None:
    """``GuideStep._mix_top_candidates``: the mix on each row's ``cuda_max_candidates``
    highest candidates; the number dropped goes to ``out_over``; with ``rec`` (diagnostics)
    the candidate shift of each guided row into its columns 1-4."""
    top = view.top_candidates(g.s.cfg.cuda_max_candidates, buffers=ws.view_buffers)
    r, k = top.tokens.shape
    p, row_live = _positions(ws, r, idx, mixed)
    p_slot = ws.take("p_slot", r * k)
    p_slot.view(r, k).copy_(p[:, None].expand(r, k))  # each slot's row in f
    dist = ws.take("dist", r * k)
    if g._weight is None:  # the model's own head (allocates its output), then the gather
        hb = ws.take("hb", f.shape[0]).copy_(f)
        dist.copy_(g.model.lm_head(hb)[p_slot, top.tokens.reshape(-1)])
    else:  # the gather-dot at any k (GuideStep.TOP_DENSE_FRACTION)
        dist_fn = candidate_dist_fn(f, g._weight, g._head, g.TOP_DENSE_FRACTION)
        dist_fn(p_slot, top.tokens.reshape(-1), out=dist)
    dist = dist.view(r, k)
    temp = view.temperature.to(top.logits.device).float()[:, None]
    # mix_candidates: (1 + beta) * ref - beta * dist / T
    beta = torch.index_select(betas, 0, p, out=ws.take("bp", r))[:, None]
    one_b = torch.add(beta, 1, out=ws.take("one_b", r)[:, None])
    new = torch.mul(one_b, top.logits, out=ws.take("mix", r))
    new.sub_(dist.mul_(beta).div_(temp))
    live = torch.logical_and(row_live[:, None], top.valid, out=ws.take("live_k", r))
    torch.where(live, new, top.logits, out=new)
    if rec is not None:
        _shift_into(ws, top, new, live, idx, rec)
    view.update_top_candidates(top, new, drop_rest=row_live)
    torch.sum(torch.mul(top.over_cap, row_live, out=ws.take("over", r)), 0, out=out_over)


def _probs(ws: GuideWorkspace, x: torch.Tensor, live: torch.Tensor, out: str) -> torch.Tensor:
    """Softmax of each row's ``live`` entries of ``x [R, k]`` (0 elsewhere) into part
    ``out``; the masked logits stay in ``dg_x``."""
    r = x.shape[0]
    xm = torch.where(live, x, ws.parts["ninf"], out=ws.take("dg_x", r))
    mx = torch.amax(xm, -1, keepdim=True, out=ws.take("dg_mx", r))
    e = torch.exp(torch.sub(xm, mx, out=ws.take(out, r)), out=ws.take(out, r))
    return e.div_(torch.sum(e, -1, keepdim=True, out=ws.take("dg_s", r)))


def _top_token(ws: GuideWorkspace, xm: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's token of highest masked logit (the first of ties), ``[R, 1]``."""
    r = xm.shape[0]
    arg = torch.argmax(xm, -1, keepdim=True, out=ws.take("dg_arg", r))
    return torch.gather(tokens, 1, arg, out=ws.take("dg_tok", r))


def _shift_into(
    ws: GuideWorkspace,
    top: TopCandidates,
    new: torch.Tensor,
    live: torch.Tensor,
    idx: torch.Tensor,
    rec: torch.Tensor,
) -> None:
    """:func:`~algorithms.esamp.guidance.candidate_shift` of each view row's ``live``
    candidates (``top.logits`` before, ``new`` after) on the fixed ``[R, k]`` grid, the
    guided rows' values (in ``idx`` order) into ``rec``'s columns candidates, top_ref,
    top_new, tv. Rows without live candidates get garbage there and a count of 0 (not
    recorded). Sums over a row's candidates in another order than the general path's
    ``index_add_``: tv may differ in its last bits."""
    r = top.tokens.shape[0]
    rows = ws.take("dg_rows", r)
    torch.sum(live, -1, out=ws.take("dg_cnt", r))
    rows[:, 1].copy_(ws.parts["dg_cnt"][:r])
    p = _probs(ws, top.logits, live, "dg_p")
    rows[:, 2:3].copy_(_top_token(ws, ws.take("dg_x", r), top.tokens))
    q = _probs(ws, new, live, "dg_q")
    rows[:, 3:4].copy_(_top_token(ws, ws.take("dg_x", r), top.tokens))
    torch.sum(p.sub_(q).abs_(), -1, out=rows[:, 4]).div_(2)
    n = idx.numel()
    torch.index_select(rows[:, 1:5], 0, idx, out=ws.take("dg_sel", n))
    rec[:n, 1:5].copy_(ws.take("dg_sel", n))


def _mix_full(
    g: GuideStep,
    view: GuideView,
    ws: GuideWorkspace,
    idx: torch.Tensor,
    f: torch.Tensor,
    betas: torch.Tensor,
    mixed: torch.Tensor,
    all_rows: bool,
) -> None:
    """``GuideStep._mix_full_vocab`` over every view row (rows not guided: beta 0, not
    mixed, so their logits stay bit for bit)."""
    s = g.s
    ref = view.logits
    r = ref.shape[0]
    if not all_rows:
        f = ws.take("fw", r).zero_().index_copy_(0, idx, f)
        betas = ws.take("bfull", r).zero_().index_copy_(0, idx, betas)
        mixed = ws.take("mfull", r).zero_().index_copy_(0, idx, mixed)
    temp = view.temperature.float().to(ref.device)[:, None]
    b = betas[:, None]
    one_b = torch.add(b, 1, out=ws.take("one_b", r)[:, None])
    new = ws.take("new", r)
    if s.cfg.mix == "latent" and g._latent_ok:
        # mix_latent: (1 + b) h_L - b f, then one head projection / T
        h = ws.take("hf", r).copy_(view.hidden(FINAL)).mul_(one_b)
        h.sub_(torch.mul(f, b, out=ws.take("fb", r)))
        _head_into(g, ws, h, new).div_(temp)
    else:
        if s.cfg.mix == "latent":
            s.counters.add("latent_fallback_rows", int(idx.numel()))
        # mix_full_vocab_logits(inplace=True): -(b * dist / T) + (1 + b) * ref
        _head_into(g, ws, f, new).mul_(b).div_(temp).neg_().addcmul_(ref, one_b)
    # Rows not mixed keep their logits exactly (the write's row mask, no extra pass).
    view.update_all(new, ws.view_buffers, rows=mixed)


def _head_into(
    g: GuideStep, ws: GuideWorkspace, z: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``GuideStep._head(z)`` (the model dtype's product, then fp32) into ``out``."""
    r = z.shape[0]
    hb = ws.take("hb", r).copy_(z)
    if g._weight is None:  # a head that is not a plain product: the model's own (allocates)
        return out.copy_(g.model.lm_head(hb))
    return out.copy_(torch.mm(hb, g._weight.t(), out=ws.proj(r)))
