"""ESamp's guidance, in the sampler: predict ``f(h_1)`` for the step's random-sampling
decode rows and mix it into their logits (post-filter candidates or the whole vocabulary),
each row with its request's beta (scaled by the fit when ``beta_schedule`` is 'fit').

On CUDA the step is :mod:`algorithms.esamp.guide_cuda`: the same math with every temporary
preallocated, so it allocates nothing on the device (a head without a plain weight
allocates its own output: logged at start)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from algorithms.esamp.diagnostics import DeviceRecords, Diagnostics
from algorithms.esamp.fit_beta import FitScale
from algorithms.esamp.guidance import (
    candidate_dist_fn,
    f_noise_prediction,
    full_dist_logits,
    mix_candidates,
    mix_full_vocab_logits,
    mix_latent,
    noise_prediction,
    relative_error,
)
from algorithms.esamp.guide_cuda import guide_cuda
from algorithms.esamp.guide_workspace import GuideShape, GuideWorkspace
from algorithms.esamp.kernels import candidate_dot
from algorithms.esamp.lifecycle import Groups
from algorithms.esamp.shared import Shared, host_to, row_index, rows_id, select_rows
from tllm_core import FINAL, DeviceSums, GuideView, ModelInfo, RequestInfo

log = logging.getLogger("tllm")

# Ablations that replace the prediction by seeded noise (the workspace then holds it).
NOISE_ABLATIONS = ("noise", "f_noise")
# What _add_guided sums per step, in order.
_GUIDED_COUNTERS = ("rows_guided", "candidates_guided", "candidates_over_cap")


@dataclass
class _Mix:
    """One step's prediction, as both mixes take it."""

    idx: torch.Tensor  # the view rows predicted
    f: torch.Tensor  # their prediction f(h_1)
    betas: torch.Tensor  # their beta
    mixed: torch.Tensor  # which of them are mixed (finite prediction, beta != 0)


def _f_positions(n_rows: int, m: _Mix) -> tuple[torch.Tensor, torch.Tensor]:
    """Per view row: its position in the prediction ``m.f`` (0 where it has none, so that
    every index stays valid) and whether it is mixed. Masks, no nonzero."""
    idx = m.idx
    pos = torch.zeros(n_rows, dtype=torch.long, device=idx.device)
    pos[idx] = torch.arange(len(idx), device=idx.device)
    live = torch.zeros(n_rows, dtype=torch.bool, device=idx.device)
    live[idx] = m.mixed
    return pos, live


class GuideStep:
    # CUDA post-filter: the [R, k] candidates' dist logits by the gather-dot at any k (never
    # the whole-vocabulary product: it allocates [rows, V] and reads the whole head, where
    # the gather reads R * k head rows; the search's slots of rows not guided count in R * k,
    # so a step with few guided rows would otherwise switch at a k of a few hundred).
    TOP_DENSE_FRACTION = math.inf

    def __init__(
        self,
        shared: Shared,
        groups: Groups,
        model: ModelInfo,
        beta_of: Callable[[RequestInfo], float],
        diagnostics: Diagnostics | None,
    ):
        self.s, self.groups, self.model, self.beta_of = shared, groups, model, beta_of
        self.diagnostics = diagnostics
        cfg = shared.cfg
        self.fit = FitScale(cfg.fit_decay, shared.counters) if cfg.beta_schedule == "fit" else None
        self._weight = model.lm_head_weight
        # Latent mixing is exact only for a plain linear head predicting the final state.
        self._latent_ok = self._weight is not None and shared.tgt_key == FINAL
        # The front end's dry build runs on the meta device, which has no generator.
        gen_device = "cpu" if model.device.type == "meta" else model.device
        self._noise_gen = torch.Generator(device=gen_device).manual_seed(cfg.seed + 1)
        self._guided: torch.Tensor | None = None  # CUDA: _GUIDED_COUNTERS not yet counted
        self._warned_cap = False
        # CUDA: the step's temporaries, made now (before vLLM sizes the KV cache).
        self._ws: GuideWorkspace | None = None
        self.records: DeviceRecords | None = None  # CUDA diagnostics: the device's records
        if shared.on_cuda:
            self.workspace()
            self._say_what_allocates()

    def workspace(self) -> GuideWorkspace:
        """The CUDA guidance's workspace (made on first use where the consumer switched to
        the CUDA branches after construction: tests on CPU)."""
        if self._ws is None:
            s = self.s
            shape = GuideShape(
                s.cfg.cuda_rows_per_step,
                self.model.hidden_size,
                self.model.vocab_size,
                s.cfg.cuda_max_candidates,
                s.cfg.mode,
                s.distiller.capacity,
                self.model.dtype,
                noise=s.cfg.ablation in NOISE_ABLATIONS,
                diagnostics=self.diagnostics is not None,
            )
            self._ws = GuideWorkspace(shape, self.model.device)
            s.arange = self._ws.parts["arange"]  # whole-step row indices are its views
            self.guided_sums = DeviceSums(self._ws.parts["guided"])  # the CUDA path's counts
            self._warm_up_candidate_dot()
            if self.diagnostics is not None:
                self.records = DeviceRecords(self.diagnostics, self._ws.parts["dg_ring"])
        return self._ws

    def _warm_up_candidate_dot(self) -> None:
        """Run the post-filter's gather-dot once on the workspace (all pairs, as a step of
        every row), so that on CUDA its Triton kernel is compiled with the consumer and not
        in the first guided step (a host stall of about a second there)."""
        ws = self._ws
        if ws is None or self._weight is None or "p_slot" not in ws.parts:
            return
        pairs, f = ws.parts["p_slot"].zero_(), ws.parts["hf"].zero_()
        candidate_dot(self._weight, f, pairs, pairs, ws.parts["dist"])

    def _say_what_allocates(self) -> None:
        """CUDA: one line at start for a setting that makes a guided step allocate on the
        device (docs/consumers/esamp.md, "On CUDA: what allocates per step")."""
        if self._weight is None:
            cfg = self.s.cfg
            mb = cfg.cuda_rows_per_step * self.model.vocab_size * self.model.dtype.itemsize / 1e6
            log.warning(
                "esamp: the model's LM head is not a plain weight product (no "
                "lm_head_weight: a bias, soft-capping, a logit scale, tensor parallelism or "
                "a quantized head): guidance calls it every step and it allocates its "
                "[rows, vocab] output per step (%.0f MB at cuda_rows_per_step=%d in %s)",
                mb,
                cfg.cuda_rows_per_step,
                str(self.model.dtype).removeprefix("torch."),
            )

    def _fast_cuda(self) -> bool:
        """Whether this step takes the allocation-free CUDA path (tests compare it with the
        general CUDA branch by turning it off)."""
        return self.s.on_cuda

    def _skip(self, reason: str, n: int) -> None:
        if n:
            self.s.counters.add("rows_skipped", n)
            self.s.counters.add(f"rows_skipped_{reason}", n)

    def __call__(self, view: GuideView) -> None:
        s, cfg, rows = self.s, self.s.cfg, view.rows
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
        s.counters.add("rows_visited", len(sel))
        if self._fast_cuda():
            guide_cuda(self, view, sel, slots)
            return
        idx = row_index(sel, view.logits.device, s.arange)
        f = s.predict(
            torch.tensor(slots, dtype=torch.long),
            select_rows(view.hidden(s.src_key), sel, idx),
            rows_id(view.step, rows, sel),  # the update of the same rows reuses its forward
        )
        if not s.on_cuda:  # on CUDA read at the next blocking flush (a host sync)
            s.counters.max("staleness_max", s.distiller.staleness_max())
        f_real = f
        if cfg.ablation == "noise":
            h_t = view.hidden(s.tgt_key)[idx].float()
            f = noise_prediction(h_t, f, self._noise_gen)
        elif cfg.ablation == "f_noise":
            f = f_noise_prediction(f, self._noise_gen)
        host_betas = [self.beta_of(rows.requests[i]) for i in sel]
        betas = host_to(torch.tensor(host_betas, dtype=torch.float32), f.device)
        # Only rows with a finite prediction and beta != 0 are mixed; the others keep their
        # logits untouched (nothing is written back for them).
        rel = diag = None
        if self.fit is not None or self.diagnostics is not None:
            rel = relative_error(view.hidden(s.tgt_key)[idx], f_real)
        if self.diagnostics is not None:
            ages = [self.groups.by_slot[slot].age for slot in slots]
            self.diagnostics.record_error(ages, rel)
            diag = (ages, rel)
        if self.fit is not None:
            groups = [self.groups.by_slot[x] for x in slots]
            betas = betas * self.fit(slots, groups, rel).to(betas.device)
            if not s.on_cuda:  # on CUDA read at the next blocking flush (a host sync)
                self.fit.read()
        if not any(host_betas) and diag is None:
            # beta = 0 on every row: nothing is written, so the runtime lets vLLM's own
            # sampling call go on (it decides on whether a write was made, host-side).
            return
        m = _Mix(idx, f, betas, torch.isfinite(f).all(-1) & (betas != 0))
        # The view counts what its writes really change; ESamp's rows_guided and
        # candidates_guided are that count, per consumer (the runtime's are totals).
        before = view.changed_per_row().clone()
        over = None
        if cfg.mode == "post_filter" or (cfg.mode == "auto" and view.filtered):
            if s.on_cuda:
                over = self._mix_top_candidates(view, m, diag)
            else:
                self._mix_candidates(view, m, diag)
        else:
            self._mix_full_vocab(view, m)
        self._add_guided(view.changed_per_row() - before, over)

    def _add_guided(self, delta: torch.Tensor, over: torch.Tensor | None) -> None:
        """Count guided rows and candidates (and candidates past the cap): on CUDA summed on
        the device and read at the next blocking flush (a read is a host sync); elsewhere
        counted now."""
        if over is None:
            over = torch.zeros((), dtype=delta.dtype, device=delta.device)
        counts = torch.stack([(delta > 0).sum(), delta.sum(), over])
        if self.s.on_cuda:
            self._guided = counts if self._guided is None else self._guided + counts
            return
        self._count_guided(counts.tolist())

    def _count_guided(self, counts: list[int]) -> None:
        for name, n in zip(_GUIDED_COUNTERS, counts, strict=True):
            self.s.counters.add(name, n)

    def read_guided(self, wait: bool = True) -> None:
        """Count the guided counts (and the fit's scale sums) summed on the device since the
        last read; the first candidates dropped at the cap are logged once (a top-k filter
        the user did not ask for). The CUDA path's sums go to the host without waiting and
        are counted once there; ``wait``: everything now (a host wait, where a sync is paid
        anyway; the general path's sums and the diagnostics are read only then)."""
        if self.fit is not None:
            self.fit.read(wait)
        if self.records is not None and wait:
            self.records.read()
        counts = None
        if self._guided is not None and wait:
            counts, self._guided = self._guided.tolist(), None
        if self._ws is not None:  # the CUDA path's sums
            self.guided_sums.send()
            for more in self.guided_sums.arrived(wait):
                counts = (
                    more if counts is None else [a + b for a, b in zip(counts, more, strict=True)]
                )
        if counts is not None:
            self._count_guided(counts)
            if counts[2] and not self._warned_cap:
                self._warned_cap = True
                log.warning(
                    "esamp: %d candidates of guided rows were past cuda_max_candidates=%d "
                    "and were dropped (a top-%d filter; counter candidates_over_cap); raise "
                    "cuda_max_candidates to mix them",
                    counts[2],
                    self.s.cfg.cuda_max_candidates,
                    self.s.cfg.cuda_max_candidates,
                )

    def _head(self, z: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(z.to(self.model.dtype)).float()

    def _mix_candidates(
        self, view: GuideView, m: _Mix, diag: tuple[list[int], torch.Tensor] | None
    ) -> None:
        """Post-filter mode: dist logits and the mix for the surviving candidates, written
        back sparsely (no pass over the vocabulary beyond finding the candidates); the
        candidates of rows not ``mixed`` keep their logits."""
        f, betas = m.f, m.betas
        cand = view.candidates()
        p_row, row_live = _f_positions(len(view.rows), m)
        p, live = p_row[cand.rows], row_live[cand.rows]
        if diag is not None:  # diagnostics read the host every step anyway
            entries = live.nonzero().squeeze(1)
        else:
            entries = torch.arange(len(p), device=p.device)
        p, live = p[entries], live[entries]
        ref = cand.logits[entries]
        if ref.numel() == 0:
            return
        # Every candidate is computed; those of rows not mixed keep their logit exactly.
        tokens = cand.tokens[entries]
        dist = candidate_dist_fn(f, self._weight, self._head)(p, tokens)
        temp = view.temperature.to(ref.device).float()[cand.rows[entries]]
        new = torch.where(live, mix_candidates(ref, dist, betas[p], temp), ref)
        if diag is not None:
            self.diagnostics.record_shift(*diag, tokens, ref, new, p, betas)
        view.update_candidates(entries, new)  # unchanged entries are written as they are

    def _mix_top_candidates(
        self, view: GuideView, m: _Mix, diag: tuple[list[int], torch.Tensor] | None
    ) -> torch.Tensor:
        """Post-filter mode without a host sync (CUDA): the mix on each row's
        ``cuda_max_candidates`` highest candidates, in fixed-size ``[R, k]`` tensors. A mixed
        row's candidates past them are dropped (set to -inf: mixing some candidates and not
        others would shift them against each other by an arbitrary offset of the dist
        logits). Every slot is computed, empty ones and those of rows not ``mixed`` too
        (fixed shapes: no sync), and those are written back unchanged. Returns the number of
        candidates dropped (a device scalar)."""
        f, betas = m.f, m.betas
        top = view.top_candidates(self.s.cfg.cuda_max_candidates)
        n_rows, k = top.tokens.shape
        p, row_live = _f_positions(n_rows, m)
        p_slot = p[:, None].expand(n_rows, k).reshape(-1)  # each slot's row in f
        dist_fn = candidate_dist_fn(f, self._weight, self._head, self.TOP_DENSE_FRACTION)
        dist = dist_fn(p_slot, top.tokens.reshape(-1)).view(n_rows, k)
        temp = view.temperature.to(top.logits.device).float()[:, None]
        mixed_logits = mix_candidates(top.logits, dist, betas[p][:, None], temp)
        live = row_live[:, None] & top.valid
        new = torch.where(live, mixed_logits, top.logits)
        if diag is not None:  # diagnostics read the host every step anyway
            ent = live.reshape(-1)
            self.diagnostics.record_shift(
                *diag,
                top.tokens.reshape(-1)[ent],
                top.logits.reshape(-1)[ent],
                new.reshape(-1)[ent],
                p_slot[ent],
                betas,
            )
        view.update_top_candidates(top, new, drop_rest=row_live)
        return (top.over_cap * row_live).sum()

    def _mix_full_vocab(self, view: GuideView, m: _Mix) -> None:
        """Whole-vocabulary mix of the ``mixed`` rows: in latent space when exact, else two
        projections; the other rows keep their logits."""
        idx, f, betas, mixed = m.idx, m.f, m.betas, m.mixed
        # All rows in order (the usual decode step): the view's logits themselves, no copy
        # (read only until view.update below).
        ref = view.logits if idx.numel() == view.logits.shape[0] else view.logits[idx]
        temp = view.temperature[idx].float().to(ref.device)
        if self.s.cfg.mix == "latent" and self._latent_ok:
            h_mix = mix_latent(view.hidden(FINAL)[idx].float(), f, betas)
            new = self._head(h_mix) / temp[:, None]
        else:
            if self.s.cfg.mix == "latent":
                self.s.counters.add("latent_fallback_rows", int(idx.numel()))
            dist = full_dist_logits(f, self._weight, self._head).to(ref.dtype)
            new = mix_full_vocab_logits(ref, dist, betas, temp, inplace=True)
        # Rows not mixed keep their logits exactly (a mask, not a nonzero); GuideView.update
        # writes candidate (finite) entries only.
        new = torch.where(mixed[:, None], new, ref, out=new)
        view.update(idx, new)
