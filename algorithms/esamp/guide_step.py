"""ESamp's guidance in the sampler: ``f(h_1)`` of random-sampling decode rows mixed into their
logits (:class:`HostGuide` allocates; :class:`CudaGuide` neither allocates nor reads back)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from algorithms.esamp.guidance import (
    candidate_dist,
    candidate_shift,
    f_noise_prediction,
    fit_scale,
    mix_candidates,
    mix_full_vocab_logits,
    mix_latent,
    mixed_rows,
    noise_prediction,
    relative_error,
    take,
)
from algorithms.esamp.guide_workspace import GuideShape, GuideWorkspace
from algorithms.esamp.kernels import candidate_dot
from algorithms.esamp.lifecycle import Group, Groups, Shared, row_index, rows_id, select_rows
from algorithms.esamp.training import ByAge
from tllm_core import FINAL, Counters, DeviceSums, HostCopyRing, host_to_device

if TYPE_CHECKING:  # pydantic-free on the GPU image (gpu_smoke.py)
    from tllm_core import GuideView, ModelInfo, RequestInfo

log = logging.getLogger("tllm")

NOISE_ABLATIONS = ("noise", "f_noise")  # the prediction replaced by seeded noise
GUIDED_COUNTERS = ("rows_guided", "candidates_guided", "candidates_over_cap")  # in order
_DIAG_CAP = 50000  # records kept (the counters go on counting)
RING_COLUMNS = ("rel_err", "candidates", "top_ref", "top_new", "tv", "beta")  # a guided row's
_INT_COLUMNS = ("candidates", "top_ref", "top_new")


class Diagnostics:
    def __init__(self, counters: Counters):
        self.counters = counters
        self._diag: dict[str, list] = {k: [] for k in ("age", *RING_COLUMNS)}
        self._err_age = ByAge()

    def record_error(self, ages: list[int], rel: torch.Tensor | list[float]) -> None:
        """The prediction's relative error by the group's step index."""
        rel = rel.cpu().tolist() if isinstance(rel, torch.Tensor) else rel
        for age, e in zip(ages, rel, strict=True):
            if math.isfinite(e):
                self._err_age.add(age, [e])

    def add_shift(self, ages: list[int], values: list[list[float]]) -> None:
        """Records (:data:`RING_COLUMNS`) of guided rows: those with candidates kept and counted."""
        cols = {
            "age": ages,
            **{name: [r[j] for r in values] for j, name in enumerate(RING_COLUMNS)},
        }
        for name in _INT_COLUMNS:
            cols[name] = [int(v) for v in cols[name]]
        rows = [i for i, c in enumerate(cols["candidates"]) if c > 0]
        self.counters.add("diag_rows", len(rows))
        self.counters.add(
            "diag_top_changed", sum(cols["top_ref"][i] != cols["top_new"][i] for i in rows)
        )
        room = _DIAG_CAP - len(self._diag["age"])
        for k, v in cols.items():
            self._diag[k].extend([v[i] for i in rows[: max(room, 0)]])

    def as_result(self) -> dict[str, Any]:
        return {
            **self._diag,
            # [group step index, mean relative error, rows]
            "rel_err_curve": self._err_age.curve(points=None),
        }


class DeviceRecords:
    """CUDA: guided rows in a device ring of two halves, a full one copied back without a wait."""

    def __init__(self, diagnostics: Diagnostics, ring: torch.Tensor):
        self.diagnostics = diagnostics
        half = max(ring.shape[0] // 2, 1)
        self._halves = [ring[:half], ring[half : 2 * half]]
        self._copies = HostCopyRing(self._halves[0], 2)
        self._cur = 0
        self._steps: list[tuple[list[int], bool]] = []  # per row of the current half
        self.halves_sent = 0

    @property
    def waits(self) -> int:
        """Steps that waited for a half's copy (a host wait each; not expected)."""
        return self._copies.waits

    def begin(self, ages: list[int], shift: bool) -> torch.Tensor:
        """The ring row of a guided step (``shift``: its candidate columns are written)."""
        self._hand_arrived(wait=False)
        if len(self._steps) == self._halves[self._cur].shape[0]:  # full: copy, use the other
            if self._copies.full:  # both host buffers hold copies not yet handed over
                self._hand_arrived(wait=True)
            self._copies.send(self._halves[self._cur], tag=self._steps)
            self.halves_sent += 1
            self._steps = []
            self._cur = 1 - self._cur
        self._steps.append((ages, shift))
        return self._halves[self._cur][len(self._steps) - 1]

    def _hand_arrived(self, wait: bool) -> None:
        """Hand the copies that have arrived to the diagnostics, in order (``wait``: all)."""
        for steps, values in self._copies.arrived(wait):
            self._hand(steps, values)

    def read(self) -> None:
        """Hand every step recorded so far to the diagnostics (a host read)."""
        self._hand_arrived(wait=True)
        if self._steps:
            self._hand(self._steps, self._halves[self._cur][: len(self._steps)].tolist())
            self._steps = []

    def _hand(self, steps: list[tuple[list[int], bool]], values: list) -> None:
        for (ages, shift), rows in zip(steps, values, strict=False):
            rows = rows[: len(ages)]
            self.diagnostics.record_error(ages, [r[0] for r in rows])
            if shift:
                self.diagnostics.add_shift(ages, rows)


@dataclass
class Rows:
    """The guided rows of one step, as the mixes read them."""

    view: GuideView
    idx: torch.Tensor  # their rows in the view
    f: torch.Tensor  # the prediction the mix uses
    betas: torch.Tensor
    mixed: torch.Tensor  # a finite prediction and beta != 0
    every: bool  # every view row, in order


def f_positions(
    n_rows: int, idx: torch.Tensor, mixed: torch.Tensor, ws: GuideWorkspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per view row: its position in the prediction of rows ``idx`` (else 0), and if mixed."""
    n, dev = idx.numel(), idx.device
    arange = torch.arange(n, device=dev) if ws is None else ws.take("arange", n)
    pos = take(ws, "pos", (n_rows,), torch.long, dev).zero_().index_copy_(0, idx, arange)
    live = take(ws, "live", (n_rows,), torch.bool, dev).zero_().index_copy_(0, idx, mixed)
    return pos, live


class FitScale:
    """``beta_schedule: "fit"``: each group's recent error per slot on the device."""

    def __init__(
        self,
        decay: float,
        counters: Counters,
        device: torch.device,
        ws: GuideWorkspace | None = None,
    ):
        """``ws``: the CUDA guidance's workspace (else the errors grow with the slots)."""
        self.decay, self.counters, self.device, self.ws = decay, counters, device, ws
        self._err: torch.Tensor | None = None if ws is None else ws.parts["err"]  # [slots]
        self._serial: dict[int, int] = {}  # slot -> serial of the group whose error it holds
        self._n = 0
        self._sum = 0.0
        # The scales' sum, sent to the host without a wait.
        sums = torch.zeros((), device=device) if ws is None else ws.parts["pending"]
        self._sums = DeviceSums(sums)

    def fresh(self, slots: list[int], groups: list[Group]) -> list[int]:
        """The slots a new group has taken since their error was last set (it restarts at 1)."""
        if self.ws is None and (self._err is None or self._err.shape[0] <= max(slots)):
            grown = torch.ones(max(max(slots) + 1, 8), device=self.device)
            if self._err is not None:
                grown[: self._err.shape[0]].copy_(self._err)
            self._err = grown
        fresh = sorted(
            {s for s, g in zip(slots, groups, strict=True) if self._serial.get(s) != g.serial}
        )
        for s, g in zip(slots, groups, strict=True):
            self._serial[s] = g.serial
        return fresh

    def scale(self, slots: torch.Tensor, fresh: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
        """Each row's factor from its group's error *before* this step, then the update."""
        ws, n, d, dev, f32 = self.ws, slots.numel(), self.decay, rel.device, torch.float32
        err = self._err
        if fresh.numel():
            err.index_fill_(0, fresh, 1.0)
        scale = torch.index_select(err, 0, slots, out=take(ws, "scale", (n,), f32, dev))
        fit_scale(scale, out=scale)
        ok = torch.lt(
            torch.abs(rel, out=take(ws, "fit_abs", (n,), f32, dev)),
            float("inf"),
            out=take(ws, "fit_ok", (n,), torch.bool, dev),
        )
        zero = torch.zeros((), device=dev) if ws is None else ws.parts["zero"]
        val = torch.where(ok, rel, zero, out=take(ws, "fit_val", (n,), f32, dev))
        shape = tuple(err.shape)
        sums = take(ws, "sums", shape, f32, dev).zero_().index_add_(0, slots, val)
        okf = take(ws, "fit_okf", (n,), f32, dev).copy_(ok)
        count = take(ws, "cnt", shape, f32, dev).zero_().index_add_(0, slots, okf)
        upd = take(ws, "upd", shape, f32, dev)
        mean = sums.div_(torch.clamp(count, min=1.0, out=upd))
        upd = torch.mul(err, d, out=upd).add_(mean.mul_(1 - d))
        has = torch.gt(count, 0, out=take(ws, "smask", shape, torch.bool, dev))
        torch.where(has, upd, err, out=err)
        self._n += n
        self.counters.add("fit_rows", n)
        self._sums.add(torch.sum(scale, 0, out=take(ws, "total", (), f32, dev)))
        return scale

    def read(self, wait: bool = True) -> None:
        """Count fit_scale_mean from the sums that reached the host (``wait``: all)."""
        self._sums.send()
        for (total,) in self._sums.arrived(wait):
            self._sum += total
        if self._n:
            self.counters.set("fit_scale_mean", self._sum / self._n)


class Guide:
    """Picks a step's rows and guides them; subclasses say where values live (``stage`` ...)."""

    def __init__(
        self,
        shared: Shared,
        groups: Groups,
        model: ModelInfo,
        diagnostics: Diagnostics | None,
        beta_of: Callable[[RequestInfo], float],
    ):
        self.s, self.groups, self.model, self.diagnostics = shared, groups, model, diagnostics
        self.beta_of, self._warned_cap = beta_of, False
        cfg = shared.cfg
        self.weight = model.lm_head_weight
        self.ws = self._workspace()
        self.fit = None
        if cfg.beta_schedule == "fit":
            self.fit = FitScale(cfg.fit_decay, shared.counters, model.device, self.ws)
        # Latent mixing is exact only for a plain linear head predicting the final state.
        self.latent_ok = self.weight is not None and shared.tgt_key == FINAL
        # The front end's dry build runs on the meta device, which has no generator.
        gen_device = "cpu" if model.device.type == "meta" else model.device
        self.noise_gen = torch.Generator(device=gen_device).manual_seed(cfg.seed + 1)

    def _workspace(self) -> GuideWorkspace | None:
        """The step's preallocated temporaries (None: each step allocates its own)."""
        return None

    def _skip(self, reason: str, n: int) -> None:
        if n:
            self.s.counters.add("rows_skipped", n)
            self.s.counters.add(f"rows_skipped_{reason}", n)

    def __call__(self, view: GuideView) -> None:
        cfg, rows = self.s.cfg, view.rows  # beta = 0 runs the path but writes nothing back
        if len(rows) == 0:
            return
        is_dec = np.asarray(rows.is_decode, dtype=bool)
        is_rand = np.asarray(view.is_random, dtype=bool)
        # Tracked (no slot): a sample still in prefill keeps its group's distiller alive.
        self.groups.claim(rows.requests, np.flatnonzero(~is_dec).tolist(), lambda *_: False)
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
        self.guide(view, sel, slots, [self.beta_of(rows.requests[i]) for i in sel])

    def read_guided(self, wait: bool = True) -> None:
        """Count what the strategy summed on the device (``wait``: all); warn once of drops."""
        counts = self.read(wait)
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

    def guide(
        self, view: GuideView, sel: list[int], slots: list[int], host_betas: list[float]
    ) -> None:
        """Guide view rows ``sel`` (their groups' distiller ``slots``, their betas)."""
        ws, r, fit = self.ws, len(view.rows), self.fit
        # Only 'fit' (serials, slots on the device) and diagnostics (ages) read the groups.
        used = fit is not None or self.diagnostics is not None
        groups = [self.groups.by_slot[x] for x in slots] if used else []
        fit_args = () if fit is None else (slots, fit.fresh(slots, groups))
        idx, betas, *fit_t = self.stage(view, sel, host_betas, *fit_args)
        f, rel = self.predict(view, sel, slots, lambda t, part: select_rows(t, sel, idx, ws, part))
        if fit is not None:
            betas.mul_(fit.scale(*fit_t, rel))
        mode = self.s.cfg.mode
        post_filter = mode == "post_filter" or (mode == "auto" and view.filtered)
        rec = self.record([g.age for g in groups], rel, betas, post_filter and any(host_betas))
        if not any(host_betas):
            return  # nothing written: vLLM's own sampling call goes on
        dev = view.logits.device
        # rows_guided, candidates_guided: what the view's writes change, for this consumer.
        before = take(ws, "before", (r,), torch.long, dev).copy_(view.changed_per_row())
        counts = take(ws, "counts", (3,), torch.long, dev)
        every = len(sel) == r and sel[-1] == r - 1
        rows = Rows(view, idx, f, betas, mixed_rows(f, betas, ws), every)
        if post_filter:
            self.mix_candidates(rows, counts[2], rec)
        else:
            counts[2].zero_()
            self.mix_full(rows)
        delta = torch.sub(view.changed_per_row(), before, out=before)
        changed = torch.gt(delta, 0, out=take(ws, "dmask", (r,), torch.bool, dev))
        torch.sum(changed, 0, out=counts[0])
        torch.sum(delta, 0, out=counts[1])
        self.add_counts(counts)

    def predict(
        self,
        view: GuideView,
        sel: list[int],
        slots: list[int],
        rows: Callable[[torch.Tensor, str], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``f(h_1)`` (or noise) of rows ``sel``, and with 'fit' or diagnostics each row's error."""
        s, ablation, ws = self.s, self.s.cfg.ablation, self.ws
        f = f_real = s.distiller.predict(
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
        """Whether the whole-vocabulary mix is latent (counts the rows where it is not exact)."""
        if self.s.cfg.mix != "latent":
            return False
        if not self.latent_ok:
            self.s.counters.add("latent_fallback_rows", n)
        return self.latent_ok

    def read(self, wait: bool) -> list[int] | None:
        """The guided counts not yet counted (``GUIDED_COUNTERS``), if any."""
        if self.fit is not None:
            self.fit.read(wait)
        return None


class HostGuide(Guide):
    """Temporaries allocated, the exact candidate set, counts added at once."""

    def stage(
        self, view: GuideView, sel: list[int], betas: list[float], *fit_args: list[int]
    ) -> tuple[torch.Tensor, ...]:
        """On the device: the rows, their betas and, for 'fit', their slots and fresh slots."""
        dev = view.logits.device

        def on_dev(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return host_to_device(torch.tensor(values, dtype=dtype), dev)

        idx = row_index(sel, dev, self.s.arange)
        return idx, on_dev(betas, torch.float32), *map(on_dev, fit_args)

    def record(
        self, ages: list[int], rel: torch.Tensor | None, betas: torch.Tensor, shift: bool
    ) -> object:
        if self.diagnostics is None:
            return None
        self.diagnostics.record_error(ages, rel)
        return ages, rel

    def add_counts(self, counts: torch.Tensor) -> None:
        for name, n in zip(GUIDED_COUNTERS, counts.tolist(), strict=True):
            self.s.counters.add(name, n)
        if self.fit is not None:
            self.fit.read()

    def mix_candidates(self, rows: Rows, over: torch.Tensor, rec: object) -> None:
        view = rows.view  # sparse: the surviving candidates only, written back one by one
        over.zero_()
        cand = view.candidates()
        if cand.logits.numel() == 0:
            return
        p_row, row_live = f_positions(len(view.rows), rows.idx, rows.mixed)
        p, live, ref = p_row[cand.rows], row_live[cand.rows], cand.logits
        dist = candidate_dist(rows.f, p, cand.tokens, self.weight, self.head)
        temp = view.temperature.to(ref.device).float()[cand.rows]
        new = torch.where(live, mix_candidates(ref, dist, rows.betas[p], temp), ref)
        view.update_candidates(torch.arange(len(p), device=p.device), new)
        if rec:  # diagnostics: the mixed rows' candidates as [guided rows, candidates]
            ages, rel = rec
            e = live.nonzero().squeeze(1)
            r_e, p_e = cand.rows[e], p[e]  # entries are row-major: a row's are contiguous
            per_row = torch.bincount(r_e, minlength=len(view.rows))
            col = torch.arange(e.numel(), device=e.device) - (per_row.cumsum(0) - per_row)[r_e]
            shape = (rows.idx.numel(), max(int(per_row.max()), 1))
            grid = torch.full((2, *shape), float("-inf"), device=e.device)
            grid[:, p_e, col] = torch.stack([ref[e], new[e].to(ref.dtype)]).float()
            tokens = torch.zeros(shape, dtype=torch.long, device=e.device)
            tokens[p_e, col] = cand.tokens[e]
            shift = candidate_shift(grid[0], grid[1], torch.gt(grid[0], float("-inf")), tokens)
            ring = torch.cat([rel[:, None], shift, rows.betas[:, None]], 1)
            self.diagnostics.add_shift(ages, ring.tolist())

    def mix_full(self, rows: Rows) -> None:
        view, idx = rows.view, rows.idx
        # Every row in order: the view's logits themselves (read only until view.update).
        ref = view.logits if rows.every else view.logits[idx]
        temp = view.temperature[idx].float().to(ref.device)
        if self.latent_fallback(int(idx.numel())):
            new = self.head(mix_latent(view.hidden(FINAL)[idx], rows.f, rows.betas)) / temp[:, None]
        else:
            dist = self.head(rows.f).to(ref.dtype)
            new = mix_full_vocab_logits(ref, dist, rows.betas, temp, inplace=True)
        # GuideView.update writes candidate (finite) entries only.
        view.update(idx, torch.where(rows.mixed[:, None], new, ref, out=new))


class CudaGuide(Guide):
    def _workspace(self) -> GuideWorkspace:
        shared, model, diagnostics, cfg = self.s, self.model, self.diagnostics, self.s.cfg
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
        ws = GuideWorkspace(shape, model.device)
        shared.arange = ws.parts["arange"]  # whole-step row indices are its views
        self.guided_sums = DeviceSums(ws.parts["guided"])
        self.records = None
        if diagnostics is not None:
            self.records = DeviceRecords(diagnostics, ws.parts["dg_ring"])
        if self.weight is not None and "p_slot" in ws.parts:
            # Compile the gather-dot's kernel now, not in the first guided step (~1 s stall).
            pairs = ws.parts["p_slot"].zero_()
            candidate_dot(self.weight, ws.parts["hf"].zero_(), pairs, pairs, ws.parts["dist"])
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
        return ws

    def stage(
        self, view: GuideView, sel: list[int], betas: list[float], *fit_args: list[int]
    ) -> tuple[torch.Tensor, ...]:
        if (n := len(view.rows)) > self.ws.rows:
            raise ValueError(
                f"esamp: a guided step of {n} rows exceeds cuda_rows_per_step={self.ws.rows} "
                "(the guidance workspace is sized from it); set cuda_rows_per_step to "
                "vLLM's max_num_seqs"
            )
        return self.ws.stage(sel, betas, *fit_args)

    def record(
        self, ages: list[int], rel: torch.Tensor | None, betas: torch.Tensor, shift: bool
    ) -> object:
        if self.records is None:
            return None
        rec = self.records.begin(ages, shift)  # this step's rows in the device ring
        rec[: len(ages), 0].copy_(rel)
        rec[: len(ages), 5].copy_(betas)
        return rec

    def add_counts(self, counts: torch.Tensor) -> None:
        self.guided_sums.add(counts)

    def read(self, wait: bool) -> list[int] | None:
        """The device sums that have reached the host (``wait``: all, and the records)."""
        super().read(wait)
        if self.records is not None and wait:
            self.records.read()
        self.guided_sums.send()
        counts = None
        for more in self.guided_sums.arrived(wait):
            counts = more if counts is None else [a + b for a, b in zip(counts, more, strict=True)]
        return counts

    def mix_candidates(self, rows: Rows, over: torch.Tensor, rec: object) -> None:
        # A mixed row's candidates past the cap are dropped: mixing only some would shift
        # them against each other. Fixed shapes; rows not mixed are written back unchanged.
        ws, view = self.ws, rows.view
        top = view.top_candidates(self.s.cfg.cuda_max_candidates, buffers=ws.view_buffers)
        r, k = top.tokens.shape
        p, row_live = f_positions(r, rows.idx, rows.mixed, ws)
        p_slot = ws.take("p_slot", r * k)
        p_slot.view(r, k).copy_(p[:, None].expand(r, k))  # each slot's row in f
        dist = ws.take("dist", r * k)
        if self.weight is None:  # the model's own head (allocates its output), then the gather
            hb = ws.take("hb", rows.f.shape[0]).copy_(rows.f)
            dist.copy_(self.model.lm_head(hb)[p_slot, top.tokens.reshape(-1)])
        else:  # the gather-dot: reads the R * k head rows, never the whole head
            candidate_dot(self.weight, rows.f, p_slot, top.tokens.reshape(-1), dist)
        temp = view.temperature.to(top.logits.device).float()[:, None]
        beta = torch.index_select(rows.betas, 0, p, out=ws.take("bp", r))[:, None]
        new = mix_candidates(top.logits, dist.view(r, k), beta, temp, ws)
        live = torch.logical_and(row_live[:, None], top.valid, out=ws.take("live_k", r))
        torch.where(live, new, top.logits, out=new)
        if rec is not None:  # diagnostics: the guided rows' candidate shift into the ring
            shift = candidate_shift(top.logits, new, live, top.tokens, ws)
            n = rows.idx.numel()
            rec[:n, 1:5].copy_(torch.index_select(shift, 0, rows.idx, out=ws.take("dg_sel", n)))
        view.update_top_candidates(top, new, drop_rest=row_live)
        torch.sum(torch.mul(top.over_cap, row_live, out=ws.take("over", r)), 0, out=over)

    def mix_full(self, rows: Rows) -> None:
        # Over every view row (fixed shapes): rows not guided get beta 0 and are not written.
        ws, view = self.ws, rows.view
        ref, f, betas, mixed = view.logits, rows.f, rows.betas, rows.mixed
        r = ref.shape[0]
        if not rows.every:
            f = ws.take("fw", r).zero_().index_copy_(0, rows.idx, f)
            betas = ws.take("bfull", r).zero_().index_copy_(0, rows.idx, betas)
            mixed = ws.take("mfull", r).zero_().index_copy_(0, rows.idx, mixed)
        temp = view.temperature.float().to(ref.device)
        new = ws.take("new", r)
        if self.latent_fallback(int(rows.idx.numel())):
            h = mix_latent(view.hidden(FINAL), f, betas, ws)
            self._head_into(h, new).div_(temp[:, None])
        else:
            mix_full_vocab_logits(ref, self._head_into(f, new), betas, temp, True, ws)
        view.update_all(new, ws.view_buffers, rows=mixed)

    def _head_into(self, z: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``head(z)`` (the model dtype's product, then fp32) into ``out``."""
        r = z.shape[0]
        hb = self.ws.take("hb", r).copy_(z)
        if self.weight is None:  # not a plain product: the model's own head (allocates)
            return out.copy_(self.model.lm_head(hb))
        return out.copy_(torch.mm(hb, self.weight.t(), out=self.ws.proj(r)))
