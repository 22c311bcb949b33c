"""``sae``: encode one site's activations with a sparse autoencoder while vLLM serves: summary
counters, top-k feature records (``out``) and steering by feature (``steer``), per request too."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

import numpy as np
import torch

from consumers.export.requests import rows_to_write, sampled_tokens
from consumers.export.writer import output_layout
from consumers.sae.config import SaeConfig, SaeRequest, edit_port, parse_site, read_port
from consumers.sae.features import FeatureWriter, bytes_per_row
from consumers.sae.loader import load_sae
from consumers.sae.model import SparseAutoencoder, top_codes, top_features
from consumers.sae.steer import Clamp, FeatureSteer, check_features
from tllm_core import (
    Bundle,
    Consumer,
    ConsumerContext,
    Delivery,
    EditPlan,
    Phase,
    PlannedRequest,
    ReadPort,
    RequestInfo,
    RequestRows,
    RowInfo,
    SampledTokens,
    WritePort,
    array_json_bytes,
    as_selector,
    host_to_device,
    request_runs,
    window_rows,
)

log = logging.getLogger("tllm")


class SaeConsumer(Consumer):
    name = "sae"
    proof_counter = "rows_encoded"
    description = (
        "Sparse-autoencoder features at one site: summary counters, top-k feature records "
        "(sparse shards) and steering by feature, per request."
    )
    Config = SaeConfig
    Request: ClassVar[type[SaeRequest]] = SaeRequest
    # Sampled tokens complete the token ids: a request's window narrows the rows only.
    request_window_rows = frozenset({"token"})

    config: SaeConfig

    def __init__(self, config: SaeConfig, context: ConsumerContext):
        super().__init__(config, context)
        self.delivery = Delivery(config.delivery)
        site = parse_site(config.site)
        try:
            layer = context.resolve_layer(site.layer)
        except ValueError as e:
            raise ValueError(f"sae: site {config.site!r}: {e}") from None
        self.site = dataclasses.replace(site, layer=layer)
        self.key = str(self.site)  # bundle key and edit target
        self.phase = as_selector(config.phase, "sae: phase")
        self._read_port = read_port(self.site, self.phase)
        try:
            sae = load_sae(config.path, d_model=int(context.model.hidden_size))
        except ValueError as e:
            raise ValueError(f"sae: path {config.path!r}: {e}") from None
        check_features((e.feature for e in config.steer), sae.d_sae, "sae: steer[{}].feature")
        check_features(config.watch, sae.d_sae, "sae: watch[{}]")
        self.sae = sae  # host copy (fp32): encodes background bundles
        self._returned = RequestRows(context.max_result_bytes, "sae")
        self._no_rows = {
            "positions": np.zeros(0, np.int64),
            "features": np.zeros((0, config.top_k), np.int64),
            "values": np.zeros((0, config.top_k), np.float32),
        }
        dev = context.model.device
        self.sae_dev = sae if dev.type in ("cpu", "meta") else sae.to(dev)
        # (feature, value); a later entry for the same feature wins.
        clamps = list(
            {e.feature: float(e.clamp) for e in config.steer if e.clamp is not None}.items()
        )
        self._clamp = Clamp(self.sae_dev, clamps) if clamps else None
        # Declared even without steering in the config: a request may steer.
        self._edit_port = edit_port(self.site, self._clamp)
        self._config_vector = self._vector(config.steer)
        # engine_id -> (steering vector, config's clamps apply, records): _plan
        self._plans: dict[str, tuple[torch.Tensor | None, bool, bool]] = {}
        self.writer: FeatureWriter | None = None
        if config.out is not None:
            layout = output_layout(
                config.out, config.overwrite, context.data_parallel_rank, context.data_parallel_size
            )
            self.writer = FeatureWriter(
                layout.path,
                config.top_k,
                config.values_dtype,
                config.shard_rows,
                config.overwrite,
                self.describe,
                layout,
                self.phase,
                self,
            )

    def _vector(self, entries: list[FeatureSteer]) -> torch.Tensor | None:
        """``sum(scale * W_dec[feature])`` over the ``scale`` entries in the model's dtype (None:
        it changes nothing); made on the host copy and sent without a wait."""
        vs = [e.scale * self.sae.W_dec[e.feature] for e in entries if e.scale is not None]
        v = sum(vs[1:], vs[0]).to(self.context.model.dtype) if vs else None
        return host_to_device(v, self.sae_dev.W_dec.device) if v is not None and v.any() else None

    def describe(self) -> dict[str, Any]:
        s = self.sae
        return {
            "path": self.config.path,
            "site": self.site.short(),
            "key": self.key,
            **{a: getattr(s, a) for a in ("architecture", "d_in", "d_sae", "k")},
            "hook_name": s.metadata.get("hook_name"),
        }

    def _plan(self, req: RequestInfo) -> tuple[torch.Tensor | None, bool, bool]:
        """``req``'s steering vector, whether the config's clamps apply (a request's own 'steer'
        replaces them) and whether it records; cached."""
        got = self._plans.get(req.engine_id)
        if got is None:
            try:
                s = req.settings(self)  # failing only where the front end's check was bypassed
            except ValueError as e:
                self.counters.add("invalid_request_settings")
                log.warning("sae: request %r: %s; not steered, not recorded", req.request_id, e)
                got = (None, False, False)
            else:
                vec = self._config_vector if s.steer is None else self._vector(s.steer)
                clamped = self._clamp is not None and s.steer is None
                got = (vec, clamped, self.writer is not None and s.record is not False)
            self._plans[req.engine_id] = got
        return got

    def reads(self) -> list[ReadPort]:
        if self.writer is None:
            return [self._read_port]
        # Records need every fed token id (prompt rows too) and the sampled ones.
        return [read_port(self.site, Phase.ALL), SampledTokens(Phase.ALL)]

    def writes(self) -> list[WritePort]:
        return [self._edit_port]

    def _count_clamped(self) -> None:
        if self._clamp is not None:
            self.counters.add("rows_clamped", self._clamp.take_rows())

    def edit(self, rows: RowInfo, plan: EditPlan) -> None:
        self._count_clamped()  # the previous forward's, before this step's
        n = len(rows)
        if n == 0:
            return
        idx: list[np.ndarray] = []
        vecs: list[torch.Tensor] = []
        clamped: list[np.ndarray] = []
        for req, start, stop in rows.runs():
            vec, clamped_req, _ = self._plan(req)
            if vec is not None:
                idx.append(np.arange(start, stop, dtype=np.int64))
                vecs.append(vec)
            if clamped_req:
                clamped.append(np.arange(start, stop, dtype=np.int64))
        if clamped:
            plan.transform(self.key, np.concatenate(clamped))
        if not idx:
            return
        rows_sel = np.concatenate(idx)
        if all(v is vecs[0] for v in vecs):
            value = vecs[0]
        else:
            value = torch.cat([v.expand(len(r), -1) for r, v in zip(idx, vecs, strict=True)])
        plan.add(self.key, rows_sel, value)
        self.counters.add("rows_selected_steer", int(rows_sel.size))

    def on_bundle(self, bundle: Bundle) -> None:
        if len(bundle.rows):
            x = bundle.hidden.get(self.key)
            if x is None:  # a tap the step did not write (see StaleTapError)
                raise ValueError(f"sae: bundle lacks {self.key!r} (has {sorted(bundle.hidden)})")
            self._encode(bundle.rows, x)
        if self.writer is not None and (sampled := sampled_tokens(bundle)) is not None:
            self._note_tokens(*sampled)

    def _encode(self, rows: RowInfo, x: torch.Tensor) -> None:
        n = len(rows)
        keep = rows_to_write(rows, self.phase, self.counters)
        positions = np.asarray(rows.position, np.int64)
        tokens = rows.token_ids.detach().to("cpu", torch.int64).numpy()
        sel = np.nonzero(keep)[0]
        rec = None
        if self.writer is not None:
            rec = np.fromiter((self._plan(rows.requests[j])[2] for j in sel), np.bool_, sel.size)
            # Token ids of the rows that are not recorded below (recorded rows carry theirs).
            unrecorded = np.ones(n, np.bool_)
            unrecorded[sel[rec]] = False
            self._note_tokens(rows.requests, positions, tokens, unrecorded)
        if sel.size == 0:
            return
        xs = x if sel.size == n else x.index_select(0, torch.from_numpy(sel).to(x.device))
        sae = self.sae if xs.device.type == "cpu" else self.sae_dev
        with torch.no_grad():
            codes = _Codes.encode(sae, xs, self.config.watch)
            stats = codes.stats.tolist()
            self.counters.add("rows_encoded", int(sel.size))
            self.counters.add("active_features", int(stats[0]))
            self.counters.add("recon_sq_error", stats[1])
            self.counters.add("input_sq_norm", stats[2])
            for f, fired in zip(self.config.watch, stats[3:], strict=True):
                self.counters.add(f"watch_fired.{f}", int(fired))
            self._return_features(rows, sel, positions, codes)
            if rec is None or not rec.any():
                return
            ridx = np.nonzero(rec)[0]
            ind, val = codes.top(self.config.top_k, None if ridx.size == sel.size else ridx)
        rsel = sel[ridx]
        before = len(self.writer.shards)
        try:
            self.writer.append(
                [rows.requests[j] for j in rsel],
                positions[rsel],
                tokens[rsel],
                np.asarray(rows.is_decode, np.bool_)[rsel],
                ind.cpu(),
                val.to("cpu", getattr(torch, self.config.values_dtype)),
            )
            self.counters.add("rows_recorded", int(rsel.size))
        finally:  # a failed write still counts the shards it wrote before
            self._count_shards(before)

    def _count_shards(self, before: int) -> None:
        if wrote := len(self.writer.shards) - before:
            self.counters.add("shards_written", wrote)

    def _return_features(
        self, rows: RowInfo, sel: np.ndarray, positions: np.ndarray, codes: _Codes
    ) -> None:
        asking = np.fromiter(
            (rows.requests[j].wants_result(self.name) for j in sel), np.bool_, sel.size
        )
        if not asking.any():
            return
        at = np.nonzero(asking)[0]
        ind, val = codes.top(self.config.top_k, None if at.size == sel.size else at)
        ind, val = ind.cpu(), val.float().cpu()
        taken = sel[at]
        for req, a, b in request_runs([rows.requests[j] for j in taken]):
            self._returned.add(
                req.engine_id, positions=positions[taken[a:b]], features=ind[a:b], values=val[a:b]
            )
        self.counters.add("rows_returned", int(at.size))

    def request_result(self, request: RequestInfo) -> dict[str, Any]:
        """``positions`` and per row the ``top_k`` strongest ``features`` with their ``values``."""
        return self._returned.take(request.engine_id, self._no_rows)

    @classmethod
    def result_bytes(cls, config: SaeConfig, request: PlannedRequest) -> int:
        rows = window_rows(cls.name, as_selector(config.phase, "sae: phase"), request)
        return array_json_bytes(rows * config.top_k, 8) * 2 + array_json_bytes(rows, 8)

    def _note_tokens(
        self,
        requests: list[RequestInfo],
        pos: np.ndarray,
        ids: np.ndarray,
        among: np.ndarray | None = None,
    ) -> None:
        """Token ids of the rows (in the mask ``among``) of requests that record."""
        if among is not None and not among.any():
            return
        rec = np.fromiter((self._plan(r)[2] for r in requests), np.bool_, len(requests))
        sel = np.nonzero(rec if among is None else rec & among)[0]
        if sel.size:
            self.writer.note_tokens([requests[j] for j in sel], pos[sel], ids[sel])

    def on_request_finished(self, request: RequestInfo) -> None:
        self._plans.pop(request.engine_id, None)
        if self.writer is not None:
            self.writer.finished(request)
            if request.cut_short:
                self.counters.add("requests_cut_short")

    def on_bundle_dropped(self, step: int, requests: list[RequestInfo]) -> None:
        if self.writer is not None:
            self.writer.dropped(requests)  # the bus counts it (bundles_dropped.sae)

    def close(self) -> None:
        if self.writer is not None:
            before = len(self.writer.shards)
            try:
                self.writer.close()
            finally:
                self._count_shards(before)

    def result(self) -> dict[str, Any]:
        self._count_clamped()  # the last forward's (no forward runs while results are read)
        c = self.counters
        rows = c.get("rows_encoded")
        norm = c.get("input_sq_norm")
        out: dict[str, Any] = {
            **self.describe(),
            "rows_encoded": int(rows),
            "mean_l0": c.get("active_features") / rows if rows else None,
            "relative_mse": c.get("recon_sq_error") / norm if norm else None,
            "watch": {
                str(f): (c.get(f"watch_fired.{f}") / rows if rows else None)
                for f in self.config.watch
            },
            "rows_selected_steer": int(c.get("rows_selected_steer")),
        }
        if (w := self.writer) is not None:
            out |= {
                "out": w.path,
                "rows_recorded": int(c.get("rows_recorded")),
                "shards": len(w.shards),
                "requests_open": w.table.open_count,
                **({"error": w.error} if w.error else {}),
                "bytes_per_row": {
                    "features": bytes_per_row(self.config.top_k, self.config.values_dtype),
                    "dense_float32": self.sae.d_in * 4 + 25,
                },
            }
        return out


@dataclasses.dataclass
class _Codes:
    """One step's SAE activations of the selected rows (``topk``: k codes per row, else dense)
    and ``stats`` = [active features, squared error, squared input norm, watched firings]."""

    dense: torch.Tensor | None
    codes: tuple[torch.Tensor, torch.Tensor] | None
    stats: torch.Tensor

    @classmethod
    def encode(cls, sae: SparseAutoencoder, x: torch.Tensor, watch: list[int]) -> _Codes:
        xf = x.float()
        if sae.architecture == "topk":
            idx, vals, state = sae.encode_codes(x)
            recon = sae.decode_codes(idx, vals, state)
            active = vals > 0
            fired = [((idx == f) & active).any(-1).sum() for f in watch]
            dense, codes = None, (idx, vals)
        else:
            acts, state = sae.encode(x)
            recon = sae.decode_sparse(acts, state)
            active = acts > 0
            fired = [active[:, f].sum() for f in watch]
            dense, codes = acts, None
        stats = torch.stack(
            [
                active.sum().float(),
                ((xf - recon) ** 2).sum(),
                (xf**2).sum(),
                *(f.float() for f in fired),
            ]
        )
        return cls(dense, codes, stats)

    def top(self, top_k: int, rows: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`top_features` of ``rows`` (all when None)."""
        sel = slice(None) if rows is None else torch.from_numpy(rows).to(self.stats.device)
        if self.codes is not None:
            return top_codes(self.codes[0][sel], self.codes[1][sel], top_k)
        return top_features(self.dense[sel], top_k)
