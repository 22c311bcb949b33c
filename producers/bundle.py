"""Cut a StepCapture into the bundle one consumer asked for."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from producers.step import StepCapture
from tllm_core.bundles import Bundle
from tllm_core.ports import FINAL, HiddenStates, Logits, Phase, ReadPort, SampledTokens, layer_key


@dataclass
class ReadPlan:
    """A consumer's read ports, resolved to bundle keys and phases."""

    hidden: dict[str, Phase] = field(default_factory=dict)  # key -> phase
    sampled_phase: Phase | None = None
    logits: bool = False
    tokens: bool = False

    @property
    def empty(self) -> bool:
        return not self.hidden and self.sampled_phase is None


def _union(a: Phase | None, b: Phase) -> Phase:
    if a is None or a == b:
        return b
    return Phase.ALL


def plan_reads(ports: list[ReadPort], resolve_layer) -> ReadPlan:
    """Resolve layer indices (raising ValueError on bad ones) and merge phases."""
    plan = ReadPlan()
    for p in ports:
        if isinstance(p, HiddenStates):
            key = FINAL if p.layer == FINAL else layer_key(resolve_layer(int(p.layer)))
            plan.hidden[key] = _union(plan.hidden.get(key), p.phase)
        elif isinstance(p, Logits):
            plan.logits = True
            plan.sampled_phase = _union(plan.sampled_phase, p.phase)
        elif isinstance(p, SampledTokens):
            plan.tokens = True
            plan.sampled_phase = _union(plan.sampled_phase, p.phase)
        else:
            raise TypeError(f"not a read port: {p!r}")
    return plan


def _phase_mask(is_decode: np.ndarray, phase: Phase) -> np.ndarray:
    if phase is Phase.ALL:
        return np.ones_like(is_decode)
    return is_decode if phase is Phase.DECODE else ~is_decode


def build_bundle(
    plan: ReadPlan, step: StepCapture, enabled: np.ndarray | None = None
) -> Bundle | None:
    """The consumer's bundle for this step, or None when it selects no row.

    ``enabled`` masks token rows to requests the consumer acts on (per-request consumers).
    """
    bundle = Bundle(step=step.step, rows=step.rows.select(np.zeros(len(step.rows), bool)))
    if plan.hidden:
        phase = None
        for ph in plan.hidden.values():
            phase = _union(phase, ph)
        mask = _phase_mask(step.rows.is_decode, phase)
        if enabled is not None:
            mask = mask & enabled
        if mask.any():
            rows = step.rows.select(mask)
            bundle.rows = rows
            idx = torch.from_numpy(rows.row)
            for key in plan.hidden:
                buf = step.hidden[key]
                bundle.hidden[key] = buf.index_select(0, idx.to(buf.device))
    if plan.sampled_phase is not None and step.logits is not None:
        srows = step.sample_rows()
        mask = step.sample_kept & _phase_mask(srows.is_decode, plan.sampled_phase)
        if enabled is not None:
            mask = mask & enabled[step.sample_token_row]
        if mask.any():
            bundle.sampled_rows = srows.select(mask)
            sel = torch.from_numpy(np.nonzero(mask)[0])
            if plan.logits:
                bundle.logits = step.logits.index_select(0, sel.to(step.logits.device))
            if plan.tokens and step.sampled_token_ids is not None:
                t = step.sampled_token_ids
                bundle.sampled_token_ids = t.index_select(0, sel.to(t.device))
    if not bundle.hidden and bundle.sampled_rows is None:
        return None
    return bundle
