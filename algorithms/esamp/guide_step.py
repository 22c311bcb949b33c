"""ESamp's guidance, in the sampler: predict ``f(h_1)`` for the step's random-sampling
decode rows and mix it into their logits (post-filter candidates or the whole vocabulary),
each row with its request's beta (scaled by the fit when ``beta_schedule`` is 'fit').

:class:`GuideStep` picks the rows; a strategy chosen at construction
(:func:`algorithms.esamp.factory.guide_for`) mixes them with :mod:`~algorithms.esamp.guidance`'s
math: :class:`HostGuide` (allocating, counters read at once) or
:class:`~algorithms.esamp.guide_cuda.CudaGuide` (every temporary in a preallocated workspace,
nothing read back in the step)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from algorithms.esamp.diagnostics import Diagnostics
from algorithms.esamp.fit_beta import FitScale
from algorithms.esamp.guidance import (
    candidate_dist_fn,
    f_noise_prediction,
    full_dist_logits,
    mix_candidates,
    mix_full_vocab_logits,
    mix_latent,
    mixed_rows,
    noise_prediction,
    relative_error,
    take,
)
from algorithms.esamp.guide_workspace import GuideWorkspace
from algorithms.esamp.lifecycle import Groups
from algorithms.esamp.shared import Shared, host_to, row_index, rows_id, select_rows
from tllm_core import FINAL, GuideView, ModelInfo, RequestInfo

log = logging.getLogger("tllm")

# Ablations that replace the prediction by seeded noise (the workspace then holds it).
NOISE_ABLATIONS = ("noise", "f_noise")
# What a guided step counts, in order.
GUIDED_COUNTERS = ("rows_guided", "candidates_guided", "candidates_over_cap")


def f_positions(
    n_rows: int, idx: torch.Tensor, mixed: torch.Tensor, ws: GuideWorkspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per view row: its position in the prediction of rows ``idx`` (0 where it has none, so
    that every index stays valid) and whether it is ``mixed``. Masks, no nonzero."""
    n, dev = idx.numel(), idx.device
    arange = torch.arange(n, device=dev) if ws is None else ws.take("arange", n)
    pos = take(ws, "pos", (n_rows,), torch.long, dev).zero_().index_copy_(0, idx, arange)
    live = take(ws, "live", (n_rows,), torch.bool, dev).zero_().index_copy_(0, idx, mixed)
    return pos, live


class Guide:
    """What both strategies hold: the fit, the noise generator, the head."""

    def __init__(
        self,
        shared: Shared,
        groups: Groups,
        model: ModelInfo,
        diagnostics: Diagnostics | None,
        ws: GuideWorkspace | None = None,
    ):
        self.s, self.groups, self.model, self.diagnostics = shared, groups, model, diagnostics
        cfg = shared.cfg
        fit = cfg.beta_schedule == "fit"
        self.fit = FitScale(cfg.fit_decay, shared.counters, ws) if fit else None
        self.weight = model.lm_head_weight
        # Latent mixing is exact only for a plain linear head predicting the final state.
        self.latent_ok = self.weight is not None and shared.tgt_key == FINAL
        # The front end's dry build runs on the meta device, which has no generator.
        gen_device = "cpu" if model.device.type == "meta" else model.device
        self.noise_gen = torch.Generator(device=gen_device).manual_seed(cfg.seed + 1)

    def post_filter(self, view: GuideView) -> bool:
        mode = self.s.cfg.mode
        return mode == "post_filter" or (mode == "auto" and view.filtered)

    def predict(
        self,
        view: GuideView,
        sel: list[int],
        slots: list[int],
        rows: Callable[[torch.Tensor, str], torch.Tensor],
        ws: GuideWorkspace | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prediction the mix uses for view rows ``sel`` (``rows(t, part)``: their rows
        of ``t``, in the workspace's ``part``): ``f(h_1)`` or, with a noise ablation, its
        stand-in; and with 'fit' or diagnostics each row's relative error of ``f(h_1)``."""
        s, ablation = self.s, self.s.cfg.ablation
        f = f_real = s.predict(
            torch.tensor(slots, dtype=torch.long),
            rows(view.hidden(s.src_key), "x"),
            rows_id(view.step, view.rows, sel),  # the update of the same rows reuses its forward
        )
        if ablation == "noise":
            f = noise_prediction(rows(view.hidden(s.tgt_key), "hb"), f, self.noise_gen, ws)
        elif ablation == "f_noise":
            f = f_noise_prediction(f, self.noise_gen, ws)
        rel = None
        if self.fit is not None or self.diagnostics is not None:
            rel = relative_error(rows(view.hidden(s.tgt_key), "hb"), f_real, ws)
        return f, rel

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(z.to(self.model.dtype)).float()

    def latent_fallback(self, n: int) -> bool:
        """Whether the whole-vocabulary mix is latent; counts the rows that asked for it
        where it is not exact."""
        if self.s.cfg.mix != "latent":
            return False
        if not self.latent_ok:
            self.s.counters.add("latent_fallback_rows", n)
        return self.latent_ok

    def guide(self, view: GuideView, sel: list[int], slots: list[int], betas: list[float]) -> None:
        """Guide view rows ``sel`` (their groups' distiller ``slots``, their ``betas``)."""
        raise NotImplementedError

    def read(self, wait: bool) -> list[int] | None:
        """The guided counts not yet counted (``GUIDED_COUNTERS``), if any."""
        if self.fit is not None:
            self.fit.read(wait)
        return None


class HostGuide(Guide):
    """The allocating strategy: exact candidate search, counters read every step."""

    def guide(
        self, view: GuideView, sel: list[int], slots: list[int], host_betas: list[float]
    ) -> None:
        s = self.s
        idx = row_index(sel, view.logits.device, s.arange)
        f, rel = self.predict(view, sel, slots, lambda t, _: select_rows(t, sel, idx), None)
        s.counters.max("staleness_max", s.distiller.staleness_max())
        betas = host_to(torch.tensor(host_betas, dtype=torch.float32), f.device)
        diag = None
        if self.diagnostics is not None:
            diag = ([self.groups.by_slot[slot].age for slot in slots], rel)
            self.diagnostics.record_error(*diag)
        if self.fit is not None:
            groups = [self.groups.by_slot[x] for x in slots]
            betas = betas * self.fit(slots, groups, rel).to(betas.device)
            self.fit.read()
        if not any(host_betas) and diag is None:
            # beta = 0 on every row: nothing is written, so the runtime lets vLLM's own
            # sampling call go on (it decides on whether a write was made, host-side).
            return
        # Only rows with a finite prediction and beta != 0 are mixed; the others keep their
        # logits untouched.
        mixed = mixed_rows(f, betas)
        # The view counts what its writes really change; ESamp's rows_guided and
        # candidates_guided are that count, per consumer (the runtime's are totals).
        before = view.changed_per_row().clone()
        if self.post_filter(view):
            self._mix_candidates(view, idx, f, betas, mixed, diag)
        else:
            self._mix_full_vocab(view, idx, f, betas, mixed)
        delta = view.changed_per_row() - before
        for name, n in zip(GUIDED_COUNTERS[:2], ((delta > 0).sum(), delta.sum()), strict=True):
            s.counters.add(name, int(n))

    def _mix_candidates(
        self,
        view: GuideView,
        idx: torch.Tensor,
        f: torch.Tensor,
        betas: torch.Tensor,
        mixed: torch.Tensor,
        diag: tuple[list[int], torch.Tensor] | None,
    ) -> None:
        """Post-filter mode: dist logits and the mix for the surviving candidates, written
        back sparsely (no pass over the vocabulary beyond finding the candidates); the
        candidates of rows not ``mixed`` keep their logits."""
        cand = view.candidates()
        p_row, row_live = f_positions(len(view.rows), idx, mixed)
        p, live = p_row[cand.rows], row_live[cand.rows]
        if diag is not None:
            entries = live.nonzero().squeeze(1)
        else:
            entries = torch.arange(len(p), device=p.device)
        p, live = p[entries], live[entries]
        ref = cand.logits[entries]
        if ref.numel() == 0:
            return
        tokens = cand.tokens[entries]
        dist = candidate_dist_fn(f, self.weight, self.head)(p, tokens)
        temp = view.temperature.to(ref.device).float()[cand.rows[entries]]
        new = torch.where(live, mix_candidates(ref, dist, betas[p], temp), ref)
        if diag is not None:
            self.diagnostics.record_shift(*diag, tokens, ref, new, p, betas)
        view.update_candidates(entries, new)  # unchanged entries are written as they are

    def _mix_full_vocab(
        self,
        view: GuideView,
        idx: torch.Tensor,
        f: torch.Tensor,
        betas: torch.Tensor,
        mixed: torch.Tensor,
    ) -> None:
        """Whole-vocabulary mix of the ``mixed`` rows: in latent space when exact, else two
        projections; the other rows keep their logits."""
        # All rows in order (the usual decode step): the view's logits themselves, no copy
        # (read only until view.update below).
        ref = view.logits if idx.numel() == view.logits.shape[0] else view.logits[idx]
        temp = view.temperature[idx].float().to(ref.device)
        if self.latent_fallback(int(idx.numel())):
            new = self.head(mix_latent(view.hidden(FINAL)[idx], f, betas)) / temp[:, None]
        else:
            dist = full_dist_logits(f, self.weight, self.head).to(ref.dtype)
            new = mix_full_vocab_logits(ref, dist, betas, temp, inplace=True)
        # GuideView.update writes candidate (finite) entries only.
        view.update(idx, torch.where(mixed[:, None], new, ref, out=new))


class GuideStep:
    """Picks a step's rows to guide (random-sampling decode rows of groups with a slot) and
    hands them to its strategy."""

    def __init__(
        self,
        shared: Shared,
        groups: Groups,
        beta_of: Callable[[RequestInfo], float],
        strategy: Guide,
    ):
        self.s, self.groups, self.beta_of, self.strategy = shared, groups, beta_of, strategy
        self._warned_cap = False

    def _skip(self, reason: str, n: int) -> None:
        if n:
            self.s.counters.add("rows_skipped", n)
            self.s.counters.add(f"rows_skipped_{reason}", n)

    def __call__(self, view: GuideView) -> None:
        cfg, rows = self.s.cfg, view.rows
        # beta = 0 still runs the path (selection, prediction) but writes nothing back. With
        # some rows at beta != 0, the others' candidates are written with their own values
        # (masks, no nonzero): the step takes the guided path, which it would anyway.
        if len(rows) == 0:
            return
        is_dec = np.asarray(rows.is_decode, dtype=bool)
        is_rand = np.asarray(view.is_random, dtype=bool)
        if cfg.skip_mixed_batches and not is_dec.all():
            self._skip("mixed", len(rows))
            return
        self._skip("prefill", int((~is_dec).sum()))  # the token after prefill is the model's own
        self._skip("greedy", int((is_dec & ~is_rand).sum()))
        sel, slots, capped = self.groups.claim(
            rows.requests, np.flatnonzero(is_dec & is_rand).tolist()
        )
        self._skip("cap", capped)
        if not sel:
            return
        self.s.counters.add("rows_visited", len(sel))
        self.strategy.guide(view, sel, slots, [self.beta_of(rows.requests[i]) for i in sel])

    def read_guided(self, wait: bool = True) -> None:
        """Count what the strategy summed on the device since the last read (``wait``:
        everything now, a host wait where a sync is paid anyway); the first candidates
        dropped at the cap are logged once (a top-k filter the user did not ask for)."""
        counts = self.strategy.read(wait)
        if counts is None:
            return
        for name, n in zip(GUIDED_COUNTERS, counts, strict=True):
            self.s.counters.add(name, n)
        k = self.s.cfg.cuda_max_candidates
        if counts[2] and not self._warned_cap:
            self._warned_cap = True
            log.warning(
                "esamp: %d candidates of guided rows were past cuda_max_candidates=%d and "
                "were dropped (a top-%d filter; counter candidates_over_cap); raise "
                "cuda_max_candidates to mix them",
                counts[2],
                k,
                k,
            )
