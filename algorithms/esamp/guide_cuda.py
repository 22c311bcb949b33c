"""ESamp's guided step on CUDA without a device allocation or a host read: the
:class:`~algorithms.esamp.guide_step.HostGuide`'s math (:mod:`algorithms.esamp.guidance`),
every temporary in the preallocated
:class:`~algorithms.esamp.guide_workspace.GuideWorkspace`, made with the consumer (before vLLM
sizes the KV cache).

- post-filter: the fixed-size candidate search (``cuda_max_candidates`` per row; those past
  it are dropped and counted) and its write take the view's :class:`~tllm_core.GuideBuffers`;
  the dist logits of the ``[R, k]`` candidates come from
  :func:`~algorithms.esamp.kernels.candidate_dot` into the workspace;
- full vocabulary: the mix is computed for every view row (fixed shapes: rows not guided
  get beta 0 and keep their logits) in one ``[R, V]`` fp32 buffer, the head's output in the
  model dtype in the view buffers' masks, and written with ``GuideView.update_all``. Without
  a plain head weight the model's head is called (it allocates its ``[rows, vocab]`` output,
  logged at start);
- the guided counts and the 'fit' sums are summed on the device and sent to the host without
  a wait; diagnostics go into the workspace's ring
  (:class:`~algorithms.esamp.diagnostics.DeviceRecords`), read where a sync is paid anyway.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from algorithms.esamp.diagnostics import DeviceRecords, Diagnostics
from algorithms.esamp.guidance import (
    candidate_dist_fn,
    mix_candidates,
    mix_full_vocab_logits,
    mix_latent,
    mixed_rows,
)
from algorithms.esamp.guide_step import NOISE_ABLATIONS, Guide, f_positions
from algorithms.esamp.guide_workspace import GuideShape, GuideWorkspace
from algorithms.esamp.kernels import candidate_dot
from algorithms.esamp.lifecycle import Groups
from algorithms.esamp.shared import Shared
from tllm_core import FINAL, DeviceSums, GuideView, ModelInfo

if TYPE_CHECKING:
    from tllm_core.api.candidates import TopCandidates

log = logging.getLogger("tllm")

# Post-filter: the [R, k] candidates' dist logits by the gather-dot at any k (never the
# whole-vocabulary product: it allocates [rows, V] and reads the whole head, where the gather
# reads R * k head rows; the search's slots of rows not guided count in R * k, so a step with
# few guided rows would otherwise switch at a k of a few hundred).
TOP_DENSE_FRACTION = math.inf


class CudaGuide(Guide):
    """The allocation-free strategy (fixed shapes, nothing read back in the step)."""

    def __init__(
        self, shared: Shared, groups: Groups, model: ModelInfo, diagnostics: Diagnostics | None
    ):
        cfg = shared.cfg
        shape = GuideShape(
            cfg.cuda_rows_per_step,
            model.hidden_size,
            model.vocab_size,
            cfg.cuda_max_candidates,
            cfg.mode,
            shared.distiller.capacity,
            model.dtype,
            noise=cfg.ablation in NOISE_ABLATIONS,
            diagnostics=diagnostics is not None,
        )
        self.ws = ws = GuideWorkspace(shape, model.device)
        super().__init__(shared, groups, model, diagnostics, ws)
        shared.arange = ws.parts["arange"]  # whole-step row indices are its views
        self.guided_sums = DeviceSums(ws.parts["guided"])
        self.records = (
            None if diagnostics is None else DeviceRecords(diagnostics, ws.parts["dg_ring"])
        )
        if self.weight is not None and "p_slot" in ws.parts:
            # The gather-dot once on every pair: on CUDA its Triton kernel is compiled now,
            # not in the first guided step (a host stall of about a second there).
            pairs, f = ws.parts["p_slot"].zero_(), ws.parts["hf"].zero_()
            candidate_dot(self.weight, f, pairs, pairs, ws.parts["dist"])
        if self.weight is None:
            mb = cfg.cuda_rows_per_step * model.vocab_size * model.dtype.itemsize / 1e6
            log.warning(
                "esamp: the model's LM head is not a plain weight product (no "
                "lm_head_weight: a bias, soft-capping, a logit scale, tensor parallelism or "
                "a quantized head): guidance calls it every step and it allocates its "
                "[rows, vocab] output per step (%.0f MB at cuda_rows_per_step=%d in %s)",
                mb,
                cfg.cuda_rows_per_step,
                str(model.dtype).removeprefix("torch."),
            )

    def guide(
        self, view: GuideView, sel: list[int], slots: list[int], host_betas: list[float]
    ) -> None:
        ws = self.ws
        r, n = len(view.rows), len(sel)
        ws.check_rows(r)
        all_rows = n == r and sel[-1] == n - 1  # every row, in order: no gathers
        fresh = []
        if self.fit is not None:
            fresh = self.fit.fresh(slots, [self.groups.by_slot[x] for x in slots])
        st = ws.stage(sel, host_betas, slots, fresh)
        idx, betas = st["idx"], st["betas"]
        f, rel = self.predict(
            view, sel, slots, lambda t, part: self._rows(t, idx, all_rows, part), ws
        )
        if self.fit is not None:
            betas.mul_(self.fit.scale(st["slots"], st["fresh"], rel))
        post_filter = self.post_filter(view)
        rec = None
        if self.records is not None:  # diagnostics: this step's rows in the device ring
            ages = [self.groups.by_slot[slot].age for slot in slots]
            rec = self.records.begin(ages, shift=post_filter and any(host_betas))
            rec[:n, 0].copy_(rel)
            rec[:n, 5].copy_(betas)
        if not any(host_betas):
            return  # nothing written: vLLM's own sampling call goes on
        mixed = mixed_rows(f, betas, ws)
        before = ws.take("before", r).copy_(view.changed_per_row())
        counts = ws.parts["counts"]
        if post_filter:
            self._mix_top(view, idx, f, betas, mixed, counts[2], rec)
        else:
            counts[2].zero_()
            self._mix_full(view, idx, f, betas, mixed, all_rows)
        delta = torch.sub(view.changed_per_row(), before, out=before)
        torch.sum(torch.gt(delta, 0, out=ws.take("dmask", r)), 0, out=counts[0])
        torch.sum(delta, 0, out=counts[1])
        self.guided_sums.add(counts)

    def read(self, wait: bool) -> list[int] | None:
        """The sums sent to the host without a wait that have arrived (``wait``: all, and
        the diagnostics' records)."""
        super().read(wait)
        if self.records is not None and wait:
            self.records.read()
        self.guided_sums.send()
        counts = None
        for more in self.guided_sums.arrived(wait):
            counts = more if counts is None else [a + b for a, b in zip(counts, more, strict=True)]
        return counts

    def _rows(self, t: torch.Tensor, idx: torch.Tensor, all_rows: bool, part: str) -> torch.Tensor:
        """``t[idx]`` (``t`` itself for every row in order) in the workspace's ``part``."""
        if all_rows:
            return t
        buf = self.ws.take(part, idx.numel())
        if t.dtype != buf.dtype:  # not the model dtype: gathered as it is (allocates)
            return t[idx]
        return torch.index_select(t, 0, idx, out=buf)

    def _mix_top(
        self,
        view: GuideView,
        idx: torch.Tensor,
        f: torch.Tensor,
        betas: torch.Tensor,
        mixed: torch.Tensor,
        out_over: torch.Tensor,
        rec: torch.Tensor | None,
    ) -> None:
        """The mix on each row's ``cuda_max_candidates`` highest candidates. A mixed row's
        candidates past them are dropped (set to -inf: mixing some candidates and not others
        would shift them against each other by an arbitrary offset of the dist logits) and
        counted in ``out_over``. Every slot is computed, empty ones and those of rows not
        ``mixed`` too (fixed shapes), and those are written back unchanged. With ``rec``
        (diagnostics) the candidate shift of each guided row into its columns 1-4."""
        ws = self.ws
        top = view.top_candidates(self.s.cfg.cuda_max_candidates, buffers=ws.view_buffers)
        r, k = top.tokens.shape
        p, row_live = f_positions(r, idx, mixed, ws)
        p_slot = ws.take("p_slot", r * k)
        p_slot.view(r, k).copy_(p[:, None].expand(r, k))  # each slot's row in f
        dist = ws.take("dist", r * k)
        if self.weight is None:  # the model's own head (allocates its output), then the gather
            hb = ws.take("hb", f.shape[0]).copy_(f)
            dist.copy_(self.model.lm_head(hb)[p_slot, top.tokens.reshape(-1)])
        else:
            dist_fn = candidate_dist_fn(f, self.weight, self.head, TOP_DENSE_FRACTION)
            dist_fn(p_slot, top.tokens.reshape(-1), out=dist)
        temp = view.temperature.to(top.logits.device).float()[:, None]
        beta = torch.index_select(betas, 0, p, out=ws.take("bp", r))[:, None]
        new = mix_candidates(top.logits, dist.view(r, k), beta, temp, ws)
        live = torch.logical_and(row_live[:, None], top.valid, out=ws.take("live_k", r))
        torch.where(live, new, top.logits, out=new)
        if rec is not None:
            shift_into(ws, top, new, live, idx, rec)
        view.update_top_candidates(top, new, drop_rest=row_live)
        torch.sum(torch.mul(top.over_cap, row_live, out=ws.take("over", r)), 0, out=out_over)

    def _mix_full(
        self,
        view: GuideView,
        idx: torch.Tensor,
        f: torch.Tensor,
        betas: torch.Tensor,
        mixed: torch.Tensor,
        all_rows: bool,
    ) -> None:
        """The whole-vocabulary mix over every view row (rows not guided: beta 0, not
        mixed, so their logits stay bit for bit)."""
        ws, ref = self.ws, view.logits
        r = ref.shape[0]
        if not all_rows:
            f = ws.take("fw", r).zero_().index_copy_(0, idx, f)
            betas = ws.take("bfull", r).zero_().index_copy_(0, idx, betas)
            mixed = ws.take("mfull", r).zero_().index_copy_(0, idx, mixed)
        temp = view.temperature.float().to(ref.device)
        new = ws.take("new", r)
        if self.latent_fallback(int(idx.numel())):
            h = mix_latent(view.hidden(FINAL), f, betas, ws)
            self._head_into(h, new).div_(temp[:, None])
        else:
            mix_full_vocab_logits(ref, self._head_into(f, new), betas, temp, True, ws)
        # Rows not mixed keep their logits exactly (the write's row mask, no extra pass).
        view.update_all(new, ws.view_buffers, rows=mixed)

    def _head_into(self, z: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``head(z)`` (the model dtype's product, then fp32) into ``out``."""
        r = z.shape[0]
        hb = self.ws.take("hb", r).copy_(z)
        if self.weight is None:  # not a plain product: the model's own head (allocates)
            return out.copy_(self.model.lm_head(hb))
        return out.copy_(torch.mm(hb, self.weight.t(), out=self.ws.proj(r)))


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


def shift_into(
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
