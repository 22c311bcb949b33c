"""ESamp consumer: predict f(h_1) in the sampler, mix it into the candidate logits, and train
the group's distiller on the step's rows after sampling (strict staleness: guidance at step t
uses the distiller trained through step t-1)."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pydantic import Field

from algorithms.esamp.config import ESampConfig
from algorithms.esamp.factory import make_distiller
from algorithms.esamp.guidance import (
    candidate_dist_fn,
    candidate_shift,
    fit_scale,
    full_dist_logits,
    mix_candidates,
    mix_full_vocab_logits,
    mix_latent,
    noise_prediction,
    relative_error,
)
from algorithms.esamp.memory_plan import (
    check_plan,
    default_slots,
    device_total_bytes,
    plan_memory,
)
from algorithms.esamp.slots import TrainResult
from tllm_core.bundles import Bundle, GuideView
from tllm_core.consumer import Consumer, ConsumerConfig, ConsumerContext
from tllm_core.numbers import FiniteF32
from tllm_core.ports import FINAL, Delivery, HiddenStates, Phase, SamplerGuide, layer_key
from tllm_core.request_settings import RequestSettings
from tllm_core.rows import RequestInfo

log = logging.getLogger("tllm")

_BATCH_KEY = "__batch__"
# Queued updates (CUDA side stream, CPU side thread): losses are read back this often.
_FLUSH_EVERY = 256
_CURVE_POINTS = 64
_DIAG_CAP = 50000
_DIAG_FIELDS = ("age", "rel_err", "candidates", "top_ref", "top_new", "tv", "beta")

COUNTER_NAMES = (
    "decode_steps",
    "optimizer_steps",
    "rows_trained",
    "rows_visited",
    "rows_guided",
    "candidates_guided",
    "loss_first",
    "loss_last",
    "loss_mean",
    "groups_created",
    "groups_freed",
    "groups_alive",
    "rows_skipped",
    "rows_skipped_prefill",
    "rows_skipped_greedy",
    "rows_skipped_cap",
    "rows_skipped_mixed",
    "train_rows_skipped_cap",
    "train_rows_skipped_recomputed",
    "train_rows_skipped_mixed",
    "train_rows_skipped_frozen",
    "nonfinite_losses_skipped",
    "staleness_max",
    "memory_bytes_per_group",
    "memory_plan_bytes",
    "latent_fallback_rows",
    "finished_unseen",
    "graph_failures",
    "eager_updates",
    "warm_start_groups",
    "warm_start_rows",
    "warm_start_steps",
    "fit_rows",
    "fit_scale_mean",
    "diag_rows",
    "diag_top_changed",
)


@dataclass
class _Group:
    live: set[str] = field(default_factory=set)  # engine ids of its unfinished requests
    slot: int | None = None
    serial: int = -1  # creation order; stable id for loss bookkeeping (slots are reused)
    age: int = 0  # train steps submitted
    warmed: bool = False  # warm start done (or not needed)
    fit_err: float = 1.0  # beta_schedule 'fit': recent relative prediction error


def _select(t: torch.Tensor, sel: list[int], idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]``, or ``t`` itself when ``sel`` is every row in order (the usual decode step:
    the distiller copies its inputs anyway, so the gather would be a second copy)."""
    return t if len(sel) == t.shape[0] and sel[-1] == len(sel) - 1 else t[idx]


def _index(sel: list[int], device: torch.device) -> torch.Tensor:
    """Row indices on ``device``; pinned + non_blocking on CUDA (a pageable copy would wait
    for the stream)."""
    t = torch.tensor(sel, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _use_side_thread(mode: str) -> bool:
    """``cpu_update`` resolved: 'auto' means a side thread only if a core is left idle."""
    if mode != "auto":
        return mode == "thread"
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


class ESampRequest(RequestSettings):
    """Per-request settings: ``tllm_esamp_beta``."""

    beta: FiniteF32 | None = Field(
        None,
        ge=0,
        description="ESamp's beta for this request (0: no guidance); default: the config's beta",
    )


class ESampConsumer(Consumer):
    name = "esamp"
    proof_counter = "rows_guided"
    description = "Exploratory Sampling: an online Latent Distiller steers sampling away from familiar continuations."
    Config = ESampConfig
    Request = ESampRequest
    delivery = Delivery.END_OF_STEP

    def __init__(self, config: ConsumerConfig, context: ConsumerContext):
        if not isinstance(config, ESampConfig):
            config = ESampConfig.model_validate(config.model_dump())
        super().__init__(config, context)
        cfg: ESampConfig = config
        self.cfg = cfg
        model = context.model
        self._src = context.resolve_layer(cfg.source_layer)
        self._tgt = FINAL if cfg.target_layer == FINAL else context.resolve_layer(cfg.target_layer)
        if self._tgt == self._src:
            raise ValueError(f"source_layer and target_layer both resolve to layer {self._src}")
        self._src_key, self._tgt_key = layer_key(self._src), layer_key(self._tgt)
        on_cuda = model.device.type == "cuda"
        slots = cfg.max_groups or cfg.cuda_capacity
        slots = slots or default_slots(cfg.cuda_rows_per_step, cfg.cuda_graph_max_rows)
        self.memory_plan = plan_memory(
            model.hidden_size,
            model.vocab_size,
            slots=slots,
            graph_rows=cfg.cuda_graph_max_rows,
            rows_per_step=cfg.cuda_rows_per_step,
            intermediate_size=cfg.intermediate_size,
            num_blocks=cfg.num_blocks,
        )
        # Checked before anything is allocated: a plan that does not fit is refused here,
        # with its numbers, instead of failing later for lack of KV cache.
        self._device_bytes = device_total_bytes(model.device)
        if self._device_bytes is not None:
            check_plan(self.memory_plan, self._device_bytes, cfg.max_memory_fraction)
        extra = {}
        if on_cuda:
            # Everything the CUDA distiller needs is allocated (and its update graph
            # captured) now: construction runs inside vLLM's load_model, before vLLM
            # profiles memory and sizes the KV cache.
            extra = {"capacity": slots, "graph_max_rows": cfg.cuda_graph_max_rows}
        # Not under inference mode: state made there could not be trained in place.
        with torch.inference_mode(False):
            self.distiller = make_distiller(
                model.hidden_size,
                model.device,
                use_cuda_graph=cfg.use_cuda_graph,
                side_thread=model.device.type == "cpu" and _use_side_thread(cfg.cpu_update),
                intermediate_size=cfg.intermediate_size,
                num_blocks=cfg.num_blocks,
                lr=cfg.lr,
                eps=cfg.eps,
                grad_clip=cfg.grad_clip,
                # zero_output: the blocks start at zero (f(x) = x) and the consumer
                # subtracts the input (see _predict / _target).
                init="zero" if cfg.init == "zero_output" else cfg.init,
                seed=cfg.seed,
                **extra,
            )
        # Losses of queued updates (CUDA stream, CPU side thread) are read back in batches;
        # on CUDA every read of a device counter is a host sync, so only there.
        self._on_cuda = self.distiller.device.type == "cuda"
        self._deferred = self._on_cuda or self.distiller.asynchronous
        self._weight = model.lm_head_weight
        # Latent mixing is exact only for a plain linear head predicting the final state.
        self._latent_ok = self._weight is not None and self._tgt == FINAL
        self._training = cfg.train and cfg.ablation != "frozen"
        # The front end's dry build runs on the meta device, which has no generator.
        gen_device = "cpu" if model.device.type == "meta" else model.device
        self._noise_gen = torch.Generator(device=gen_device).manual_seed(cfg.seed + 1)
        self._groups: dict[str, _Group] = {}
        self._slot_group: dict[int, _Group] = {}
        self._serials = 0
        self._pending: list[tuple[list[int], list[int], TrainResult]] = []
        self._warm_pending: list[TrainResult] = []  # warm-start steps not yet read back
        self._loss_sum, self._loss_n = 0.0, 0
        self._loss_first: float | None = None
        self._loss_last: float | None = None
        self._age_sum: list[float] = []
        self._age_n: list[int] = []
        # Per-group first and last losses, as sums over every group so far (a server runs
        # for ever: state is kept only for groups that may still report a loss).
        self._group_last: dict[int, float] = {}  # serial -> last loss, live groups only
        self._freed_serials: set[int] = set()  # freed, with losses still to read back
        self._gfirst_sum = self._glast_sum = 0.0
        self._g_n = 0
        self._zero_out = cfg.init == "zero_output"
        self._warm = cfg.warm_start_steps > 0
        self._fit_n, self._fit_sum = 0, 0.0
        self._guided: torch.Tensor | None = None  # CUDA: [rows, candidates] not yet counted
        self._diag: dict[str, list] = {k: [] for k in _DIAG_FIELDS}
        self._err_age: list[list[float]] = []  # per group step index: [sum, count]
        for name in COUNTER_NAMES:
            self.counters.add(name, 0)
        self.counters.set("memory_bytes_per_group", self.distiller.memory_bytes_per_group())
        self.counters.set("memory_plan_bytes", self.memory_plan.total_bytes)
        self.counters.set("graph_failures", self.distiller.graph_failures)

    # -- declarations -------------------------------------------------------------
    def reads(self) -> list:
        # Warm start trains on the prompt's prefill rows too.
        phase = Phase.ALL if self.cfg.warm_start_steps > 0 else Phase.DECODE
        return [HiddenStates(self._src, phase), HiddenStates(self._tgt, phase)]

    def writes(self) -> list:
        # Declared even for beta = 0: the guidance path then runs and must leave sampling
        # bit-identical, which is what the non-intrusion test checks.
        return [SamplerGuide()]

    # -- groups -------------------------------------------------------------------
    def _group_key(self, req: RequestInfo) -> str:
        return req.group_key if self.cfg.scope == "group" else _BATCH_KEY

    def _track(self, req: RequestInfo) -> _Group:
        g = self._groups.setdefault(self._group_key(req), _Group())
        g.live.add(req.engine_id)
        return g

    def _ensure_slot(self, g: _Group) -> int | None:
        """The group's slot, allocated on its first decode row; None at the ``max_groups`` cap
        (or when a fixed-capacity distiller, the CUDA one, has every slot live)."""
        if g.slot is None:
            d, cap = self.distiller, self.cfg.max_groups
            if (cap is not None and d.num_live >= cap) or (
                not d.growable and d.num_live >= d.capacity
            ):
                return None
            g.slot = self.distiller.alloc()
            g.serial, g.age = self._serials, 0
            self._serials += 1
            self._slot_group[g.slot] = g
            self.counters.add("groups_created")
            self.counters.set("groups_alive", self.distiller.num_live)
        return g.slot

    def _beta(self, req: RequestInfo) -> float:
        """The request's beta: its ``tllm_esamp_beta`` if given, else the config's."""
        given = req.settings(self).beta  # validated and cached per request
        return self.cfg.beta if given is None else given

    def on_request_finished(self, request: RequestInfo) -> None:
        key = self._group_key(request)
        g = self._groups.get(key)
        if g is None or request.engine_id not in g.live:
            # Finished before any decode row reached us (e.g. aborted in prefill, max_tokens=1).
            self.counters.add("finished_unseen")
            return
        g.live.discard(request.engine_id)
        if g.live:
            return
        del self._groups[key]
        self._freed_serials.add(g.serial)
        self._prune_groups()
        if g.slot is not None:
            del self._slot_group[g.slot]
            self.distiller.free(g.slot)
            self.counters.add("groups_freed")
            self.counters.set("groups_alive", self.distiller.num_live)

    # -- guidance (in the sampler) ---------------------------------------------------
    def _skip(self, reason: str, n: int = 1) -> None:
        self.counters.add("rows_skipped", n)
        self.counters.add(f"rows_skipped_{reason}", n)

    def guide(self, view: GuideView) -> None:
        cfg, rows = self.cfg, view.rows
        # beta = 0 still runs the path (selection, prediction) but writes nothing back.
        if len(rows) == 0:
            return
        is_dec = np.asarray(rows.is_decode, dtype=bool)
        is_rand = np.asarray(view.is_random, dtype=bool)
        if cfg.skip_mixed_batches and not is_dec.all():
            self._skip("mixed", len(rows))
            return
        sel: list[int] = []
        slots: list[int] = []
        for i, req in enumerate(rows.requests):
            if not is_dec[i]:
                self._skip("prefill")  # the token sampled after prefill is the model's own
            elif not is_rand[i]:
                self._skip("greedy")
            else:
                slot = self._ensure_slot(self._track(req))
                if slot is None:
                    self._skip("cap")
                else:
                    sel.append(i)
                    slots.append(slot)
        if not sel:
            return
        self.counters.add("rows_visited", len(sel))
        idx = _index(sel, view.logits.device)
        f = self._predict(
            torch.tensor(slots, dtype=torch.long), _select(view.hidden(self._src_key), sel, idx)
        )
        if not self._on_cuda:  # on CUDA read at the next blocking flush (a host sync)
            self.counters.max("staleness_max", self.distiller.staleness_max())
        f_real = f
        if cfg.ablation == "noise":
            h_t = view.hidden(self._tgt_key)[idx].float()
            f = noise_prediction(h_t, f, self._noise_gen)
        betas = torch.tensor(
            [self._beta(rows.requests[i]) for i in sel], dtype=torch.float32, device=f.device
        )
        # Only rows with a finite prediction and beta != 0 are mixed; the others keep their
        # logits untouched (nothing is written back for them).
        rel = None
        if cfg.beta_schedule == "fit" or cfg.diagnostics:
            rel = relative_error(view.hidden(self._tgt_key)[idx], f_real)
        if cfg.diagnostics:
            self._record_error(slots, rel)
        if cfg.beta_schedule == "fit":
            betas = betas * self._fit(slots, rel).to(betas.device)
        mixed = torch.isfinite(f).all(-1) & (betas != 0)
        if cfg.mode == "post_filter" or (cfg.mode == "auto" and view.filtered):
            n_rows, n_cand = self._mix_candidates(
                view, idx, f, betas, mixed, (slots, rel) if cfg.diagnostics else None
            )
        else:
            n_rows, n_cand = self._mix_full_vocab(view, idx, f, betas, mixed)
        self._add_guided(n_rows, n_cand)

    def _add_guided(self, n_rows: torch.Tensor, n_cand: torch.Tensor) -> None:
        """Count guided rows and candidates: on CUDA summed on the device and read at the
        next blocking flush (a read is a host sync); elsewhere counted now."""
        if self._on_cuda:
            pair = torch.stack([n_rows, n_cand])
            self._guided = pair if self._guided is None else self._guided + pair
            return
        self.counters.add("rows_guided", int(n_rows))
        self.counters.add("candidates_guided", int(n_cand))

    def _predict(self, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The distiller's prediction; with init 'zero_output' the blocks' residual sum
        alone (the input subtracted), so an untrained distiller predicts 0."""
        f = self.distiller.predict(slots, x)
        return f - x.float() if self._zero_out else f

    def _target(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """What the blocks are trained to output: ``target`` (+ the input for 'zero_output',
        so that ``blocks(x) - x`` learns ``target``)."""
        return target.float() + x.float() if self._zero_out else target

    def _fit(self, slots: list[int], rel: torch.Tensor) -> torch.Tensor:
        """beta_schedule 'fit': each row's factor clamp(1 - e, 0, 1) from its group's error
        average *before* this step, then the averages updated with this step's rows."""
        errs = rel.cpu().tolist()
        groups = [self._slot_group[s] for s in slots]
        scale = fit_scale(torch.tensor([g.fit_err for g in groups], dtype=torch.float32))
        d = self.cfg.fit_decay
        step: dict[int, list[float]] = {}
        for g, e in zip(groups, errs, strict=True):
            if math.isfinite(e):
                step.setdefault(id(g), []).append(e)
        for g in {id(g): g for g in groups}.values():
            if id(g) in step:
                g.fit_err = d * g.fit_err + (1 - d) * float(np.mean(step[id(g)]))
        self._fit_n += len(errs)
        self._fit_sum += float(scale.sum())
        self.counters.add("fit_rows", len(errs))
        self.counters.set("fit_scale_mean", self._fit_sum / self._fit_n)
        return scale

    def _record_error(self, slots: list[int], rel: torch.Tensor) -> None:
        """diagnostics: the prediction's relative error by the group's step index."""
        for s, e in zip(slots, rel.cpu().tolist(), strict=True):
            age = self._slot_group[s].age
            while len(self._err_age) <= age:
                self._err_age.append([0.0, 0])
            if math.isfinite(e):
                self._err_age[age][0] += e
                self._err_age[age][1] += 1

    def _record(
        self,
        rows_idx: torch.Tensor,
        entries: torch.Tensor,
        cand,
        ref: torch.Tensor,
        new: torch.Tensor,
        p: torch.Tensor,
        betas: torch.Tensor,
        diag: tuple[list[int], torch.Tensor],
    ) -> None:
        """diagnostics: one record per mixed row (see ESampConfig.diagnostics)."""
        slots, rel = diag
        n = len(slots)
        tv, top_ref, top_new, count = candidate_shift(p, cand.tokens[entries], ref, new, n)
        has = (count > 0).cpu().tolist()
        cols = {
            "age": [self._slot_group[s].age for s in slots],
            "rel_err": rel.cpu().tolist(),
            "candidates": count.cpu().tolist(),
            "top_ref": top_ref.cpu().tolist(),
            "top_new": top_new.cpu().tolist(),
            "tv": tv.cpu().tolist(),
            "beta": betas.cpu().tolist(),
        }
        rows = [i for i in range(n) if has[i]]
        self.counters.add("diag_rows", len(rows))
        self.counters.add(
            "diag_top_changed", sum(cols["top_ref"][i] != cols["top_new"][i] for i in rows)
        )
        room = _DIAG_CAP - len(self._diag["age"])
        for k, v in cols.items():
            self._diag[k].extend([v[i] for i in rows[: max(room, 0)]])

    def _head(self, z: torch.Tensor) -> torch.Tensor:
        model = self.context.model
        return model.lm_head(z.to(model.dtype)).float()

    def _mix_candidates(
        self,
        view: GuideView,
        idx: torch.Tensor,
        f: torch.Tensor,
        betas: torch.Tensor,
        mixed: torch.Tensor,
        diag: tuple[list[int], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-filter mode: dist logits and the mix for the surviving candidates, written
        back sparsely (no pass over the vocabulary beyond finding the candidates); the
        candidates of rows not ``mixed`` keep their logits. Returns (rows, candidates)
        changed, as device scalars."""
        cand = view.candidates()
        # Position in ``f`` of each view row that is mixed, -1 elsewhere: masks, no nonzero.
        pos = torch.full((len(view.rows),), -1, dtype=torch.long, device=idx.device)
        here = torch.arange(len(idx), device=idx.device)
        pos[idx] = torch.where(mixed, here, torch.full_like(here, -1))
        p = pos[cand.rows]
        live = p >= 0
        if diag is not None:  # diagnostics read the host every step anyway
            entries = live.nonzero().squeeze(1)
        else:
            entries = torch.arange(len(p), device=p.device)
        p, live = p[entries].clamp(min=0), live[entries]
        ref = cand.logits[entries]
        if ref.numel() == 0:
            zero = torch.zeros((), dtype=torch.long, device=ref.device)
            return zero, zero
        # Every candidate is computed; those of rows not mixed keep their logit exactly.
        dist = candidate_dist_fn(f, self._weight, self._head)(p, cand.tokens[entries])
        temp = view.temperature.to(ref.device).float()[cand.rows[entries]]
        new = torch.where(live, mix_candidates(ref, dist, betas[p], temp), ref)
        if diag is not None:
            self._record(idx, entries, cand, ref, new, p, betas, diag)
        changed = new != ref
        # Rows with a changed candidate, counted by scatter (no unique).
        per_row = torch.zeros(len(view.rows), dtype=torch.long, device=ref.device)
        per_row.index_add_(0, cand.rows[entries], changed.long())
        view.update_candidates(entries, new)  # unchanged entries are written as they are
        return (per_row > 0).sum(), changed.sum()

    def _mix_full_vocab(
        self,
        view: GuideView,
        idx: torch.Tensor,
        f: torch.Tensor,
        betas: torch.Tensor,
        mixed: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole-vocabulary mix of the ``mixed`` rows: in latent space when exact, else two
        projections; the other rows keep their logits. Returns (rows, candidates) changed,
        as device scalars."""
        # All rows in order (the usual decode step): the view's logits themselves, no copy
        # (read only until view.update below).
        ref = view.logits if idx.numel() == view.logits.shape[0] else view.logits[idx]
        temp = view.temperature[idx].float().to(ref.device)
        if self.cfg.mix == "latent" and self._latent_ok:
            h_mix = mix_latent(view.hidden(FINAL)[idx].float(), f, betas)
            new = self._head(h_mix) / temp[:, None]
        else:
            if self.cfg.mix == "latent":
                self.counters.add("latent_fallback_rows", int(idx.numel()))
            dist = full_dist_logits(f, self._weight, self._head).to(ref.dtype)
            new = mix_full_vocab_logits(ref, dist, betas, temp, inplace=True)
        # Rows not mixed keep their logits exactly (a mask, not a nonzero); GuideView.update
        # writes candidate (finite) entries only.
        new = torch.where(mixed[:, None], new, ref, out=new)
        before = view.changed_per_row().clone()  # the view counts what really changed
        view.update(idx, new)
        delta = view.changed_per_row() - before
        return (delta > 0).sum(), delta.sum()

    # -- training (after sampling) ------------------------------------------------
    def on_bundle(self, bundle: Bundle) -> None:
        rows = bundle.rows
        is_dec = np.asarray(rows.is_decode, dtype=bool)
        if self._warm and len(rows) and not is_dec.all():
            self._warm_start(bundle, is_dec)
        if len(rows) == 0 or not is_dec.any():
            return
        if self.cfg.skip_mixed_batches and not is_dec.all():
            self.counters.add("train_rows_skipped_mixed", int(is_dec.sum()))
            return
        recomputed = np.asarray(rows.recomputed, dtype=bool)
        sel: list[int] = []
        slots: list[int] = []
        for i, req in enumerate(rows.requests):
            if not is_dec[i]:
                continue
            g = self._track(req)
            if recomputed[i]:
                # Preemption recomputation: this position was already trained on.
                self.counters.add("train_rows_skipped_recomputed")
                continue
            slot = self._ensure_slot(g)
            if slot is None:
                self.counters.add("train_rows_skipped_cap")
                continue
            sel.append(i)
            slots.append(slot)
        if not sel:
            return
        if not self._training:
            self.counters.add("train_rows_skipped_frozen", len(sel))
            return
        dev = bundle.hidden[self._src_key].device
        idx = _index(sel, dev)
        x = _select(bundle.hidden[self._src_key], sel, idx)
        res = self.distiller.train_step(
            torch.tensor(slots, dtype=torch.long),
            x,
            self._target(x, _select(bundle.hidden[self._tgt_key], sel, idx)),
        )
        groups = [self._slot_group[int(s)] for s in res.slots]
        self._pending.append(([g.serial for g in groups], [g.age for g in groups], res))
        for g in groups:
            g.age += 1
        self._after_submit()

    def _after_submit(self) -> None:
        """Read back the results of submitted train steps as the distiller allows."""
        if not self._deferred or len(self._pending) >= _FLUSH_EVERY:
            self._flush()
        elif self.distiller.asynchronous:
            # CPU side thread: take the updates that have already run (no waiting). Not on
            # CUDA: reading a loss there would sync the stream every step.
            self._flush(block=False)

    def _warm_start(self, bundle: Bundle, is_dec: np.ndarray) -> None:
        """warm_start_steps: create the distiller of each group whose prompt rows arrive and
        train it on them (the rows of the group's first request in this step; a group warms
        once). Counted in warm_start_groups / warm_start_rows / warm_start_steps."""
        rows = bundle.rows
        recomputed = np.asarray(rows.recomputed, dtype=bool)
        first: dict[int, str] = {}  # id(group) -> engine id whose rows are used
        sel: list[int] = []
        slots: list[int] = []
        for i, req in enumerate(rows.requests):
            if is_dec[i] or recomputed[i]:
                continue
            g = self._track(req)
            if g.warmed and id(g) not in first:
                continue
            if first.setdefault(id(g), req.engine_id) != req.engine_id:
                continue
            slot = self._ensure_slot(g)
            if slot is None:
                self.counters.add("train_rows_skipped_cap")
                continue
            g.warmed = True
            sel.append(i)
            slots.append(slot)
        if not sel:
            return
        if not self._training:
            self.counters.add("train_rows_skipped_frozen", len(sel))
            return
        idx = _index(sel, bundle.hidden[self._src_key].device)
        x = _select(bundle.hidden[self._src_key], sel, idx)
        target = self._target(x, _select(bundle.hidden[self._tgt_key], sel, idx))
        slot_t = torch.tensor(slots, dtype=torch.long)
        for _ in range(self.cfg.warm_start_steps):
            self._warm_pending.append(self.distiller.train_step(slot_t, x, target))
        self.counters.add("warm_start_groups", len(set(slots)))
        self.counters.add("warm_start_rows", len(sel))
        self._after_submit()  # warm_start_steps: counted from the results, in _flush

    # -- bookkeeping ----------------------------------------------------------------
    def _flush_warm(self, block: bool) -> None:
        """Count the warm-start updates that ran (one per group and step; a group whose
        loss was non-finite was not updated) once their results are final."""
        n = _final_prefix(self._warm_pending, block)
        done, self._warm_pending = self._warm_pending[:n], self._warm_pending[n:]
        for res in done:
            ok = res.updated.cpu().tolist()
            self.counters.add("warm_start_steps", sum(ok))
            self.counters.add("nonfinite_losses_skipped", len(ok) - sum(ok))

    def _flush(self, block: bool = True) -> None:
        """Read pending losses back to the host and update the loss counters; with
        ``block=False`` only those of updates that have already run, oldest first."""
        if block and (self._pending or self._warm_pending):
            self.distiller.synchronize()
        if block or not self._on_cuda:  # a device read on CUDA: only where a sync is paid
            self.counters.max("staleness_max", self.distiller.staleness_max())
            self.counters.set("eager_updates", self.distiller.eager_updates)
        if block and self._guided is not None:
            rows, cand = self._guided.tolist()
            self._guided = None
            self.counters.add("rows_guided", rows)
            self.counters.add("candidates_guided", cand)
        self._flush_warm(block)
        n_ready = _final_prefix([res for _, _, res in self._pending], block)
        if not n_ready:
            return
        ready, self._pending = self._pending[:n_ready], self._pending[n_ready:]
        steps = bad = rows = train_steps = 0
        for serials, ages, res in ready:
            losses = res.losses.cpu().tolist()
            ok = res.updated.cpu().tolist()
            counts = res.counts.tolist()
            train_steps += any(ok)
            for serial, age, loss, good, n in zip(serials, ages, losses, ok, counts, strict=True):
                if not good:
                    bad += 1
                    continue
                steps += 1
                rows += n
                self._loss_sum += loss
                self._loss_n += 1
                if self._loss_first is None:
                    self._loss_first = loss
                self._loss_last = loss
                while len(self._age_sum) <= age:
                    self._age_sum.append(0.0)
                    self._age_n.append(0)
                self._age_sum[age] += loss
                self._age_n[age] += 1
                last = self._group_last.get(serial)
                if last is None:  # the group's first loss
                    self._g_n += 1
                    self._gfirst_sum += loss
                    self._glast_sum += loss
                else:
                    self._glast_sum += loss - last
                self._group_last[serial] = loss
        self._prune_groups()
        self.counters.add("optimizer_steps", steps)
        self.counters.add("rows_trained", rows)
        self.counters.add("decode_steps", train_steps)
        self.counters.add("nonfinite_losses_skipped", bad)
        if self._loss_n:
            self.counters.set("loss_first", self._loss_first)
            self.counters.set("loss_last", self._loss_last)
            self.counters.set("loss_mean", self._loss_sum / self._loss_n)

    def _prune_groups(self) -> None:
        """Forget the last loss of freed groups whose updates have all been read back."""
        if not self._freed_serials:
            return
        waiting = {s for serials, _, _ in self._pending for s in serials}
        for s in self._freed_serials - waiting:
            self._group_last.pop(s, None)
            self._freed_serials.discard(s)

    def _curve(self) -> list[list[float]]:
        """Mean loss by a group's optimizer step index (its learning curve), <= 64 points."""
        ages = [a for a, n in enumerate(self._age_n) if n]
        if len(ages) > _CURVE_POINTS:
            picks = np.unique(np.linspace(0, len(ages) - 1, _CURVE_POINTS).round().astype(int))
            ages = [ages[i] for i in picks]
        return [[a, self._age_sum[a] / self._age_n[a], self._age_n[a]] for a in ages]

    def result(self) -> Any:
        self._flush()
        return {
            "loss_first": self._loss_first,
            "loss_last": self._loss_last,
            "loss_mean": self._loss_sum / self._loss_n if self._loss_n else None,
            "group_loss_first_mean": self._gfirst_sum / self._g_n if self._g_n else None,
            "group_loss_last_mean": self._glast_sum / self._g_n if self._g_n else None,
            # [step index within a group, mean loss over groups, number of groups]
            "loss_curve": self._curve(),
            "counters": self.counters.snapshot(),
            "memory_plan": {
                **self.memory_plan.as_dict(),
                "max_memory_fraction": self.cfg.max_memory_fraction,
                # None: not checked (CPU: the state grows with live groups instead).
                "device_bytes": self._device_bytes,
            },
            **(
                {
                    "diagnostics": {
                        **self._diag,
                        # [group step index, mean relative error, rows]
                        "rel_err_curve": [
                            [a, s / n, n] for a, (s, n) in enumerate(self._err_age) if n
                        ],
                    }
                }
                if self.cfg.diagnostics
                else {}
            ),
        }

    def close(self) -> None:
        self._flush()
        self.distiller.close()


def _final_prefix(results: list[TrainResult], block: bool) -> int:
    """How many results, oldest first, can be read now: all of them after a synchronize
    (``block``), else those already final (results complete in order)."""
    n = 0
    while n < len(results) and (block or results[n].ready()):
        n += 1
    return n
