"""Test consumers found through an entry point in engine tests. ``lens`` checks ModelInfo's final norm and LM head against the engine's own
taps: ``final_norm(layer.-1) == final`` and ``lm_head(final_norm(layer.-1)) == logits`` at
the sampling rows (counters: the largest differences, in units of 1e-6)."""

from __future__ import annotations

import torch

from tllm_core import Consumer, HiddenStates, Logits, SamplerGuide, hookimpl


class Lens(Consumer):
    name = "lens"

    def reads(self):
        return [HiddenStates(-1), HiddenStates("final"), Logits()]

    def on_bundle(self, bundle):
        m = self.context.model
        last = bundle.hidden[f"layer.{m.num_layers - 1}"].float()
        normed = m.final_norm(last.to(m.dtype)).float()
        self._max("norm_err_e6", normed, bundle.hidden["final"].float())
        if m.final_norm_weight is not None:
            rms = torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + m.final_norm_eps)
            self._max("gain_err_e6", last * rms * m.final_norm_weight.float(), normed)
            self.counters.add("gain_checked", last.shape[0])
        if bundle.logits is not None:
            rows = torch.as_tensor(bundle.sampled_rows.row)
            pos = {int(r): i for i, r in enumerate(bundle.rows.row)}
            idx = torch.tensor([pos[int(r)] for r in rows])
            head = m.lm_head(m.final_norm(last[idx].to(m.dtype))).float()
            self._max("head_err_e6", head, bundle.logits.float())
            self.counters.add("rows_checked", len(idx))

    def _max(self, name, a, b):
        err = float((a - b).abs().max()) if a.numel() else 0.0
        self.counters.max(name, int(err * 1e6))


class Peek(Consumer):
    """Given after a guiding consumer: records the candidates it left, per sampling row
    (``"{request}/{sample}/{position}"`` -> sorted tokens and their logits)."""

    name = "peek"

    def __init__(self, config, context):
        super().__init__(config, context)
        self.rows: dict[str, dict[str, list]] = {}

    def writes(self):
        return [SamplerGuide()]

    def guide(self, view):
        c = view.candidates()
        rows = view.rows
        for i, req in enumerate(rows.requests):
            if rows.mid_prefill[i]:
                continue
            sel = c.rows == i
            toks, logits = c.tokens[sel], c.logits[sel]
            order = toks.argsort()
            key = f"{req.request_id}/{req.sample_index}/{int(rows.position[i])}"
            self.rows[key] = {"tokens": toks[order].tolist(), "logits": logits[order].tolist()}

    def result(self):
        return self.rows


@hookimpl
def tllm_consumers():
    return [Lens, Peek]
