"""The CUDA guidance's temporaries: views of one device allocation made with the consumer (the
step allocates nothing; the memory plan counts it), and the step's host values in one copy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Torch and tllm_core's lazily imported public API only (the memory plan imports this module).
from tllm_core import (
    GuideBuffers,
    StagingRing,
    WorkspaceSpec,
    carve_workspace,
    carve_workspace_from,
    workspace_bytes,
)

STAGING_BUFFERS = 4  # pinned staging buffers in rotation
DIAG_STEPS = 256  # diagnostics: guided steps the device ring holds before a read
DIAG_FIELDS = 6  # per row, fp32 (guide_step.RING_COLUMNS; token ids exact below 2**24)
MODES = ("post_filter", "full_vocab", "auto")


def _parts(names: str, shape: tuple[int, ...], dtype: torch.dtype) -> WorkspaceSpec:
    """A part of ``shape`` and ``dtype`` for each name."""
    return [(name, shape, dtype) for name in names.split()]


def _stage_spec(rows: int) -> WorkspaceSpec:
    return _parts("idx slots fresh", (rows,), torch.long) + _parts("betas", (rows,), torch.float32)


@dataclass(frozen=True)
class GuideShape:
    """What sizes the guidance workspace (``rows``: cuda_rows_per_step)."""

    rows: int
    hidden: int
    vocab: int
    max_candidates: int
    mode: str
    slots: int
    dtype: torch.dtype
    noise: bool = False
    diagnostics: bool = False

    @property
    def aliases_masks(self) -> bool:
        """Whether the head's ``[rows, vocab]`` output fits in the view buffers' two masks."""
        return self.mode != "post_filter" and self.dtype.itemsize <= 2

    def view_buffers_args(self) -> dict:
        """The :class:`~tllm_core.GuideBuffers` options of this mode."""
        return {
            "top_k": None if self.mode == "full_vocab" else self.max_candidates,
            "dense": self.mode != "post_filter",
        }


def workspace_spec(shape: GuideShape) -> WorkspaceSpec:
    """The workspace's parts (name, shape, dtype) for this shape."""
    mode, vocab, slots = shape.mode, shape.vocab, shape.slots
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    r, h, dtype, f32 = shape.rows, shape.hidden, shape.dtype, torch.float32
    spec: list = [
        ("stage", (workspace_bytes(_stage_spec(r)),), torch.uint8),
        ("x", (r, h), dtype),  # the source rows of a partial step
        ("hb", (r, h), dtype),  # target rows of a partial step; the head's input
        ("hf", (r, h), f32),  # fp32 scratch: relative error, finiteness, latent mix
        # per row: relative error, finite check, mixed rows, positions, change counts
        *_parts("num den rel rtmp fin one_b", (r,), f32),
        *_parts("rmask mixed bmask live dmask", (r,), torch.bool),
        *_parts("arange pos before", (r,), torch.long),
        *_parts("counts guided", (3,), torch.long),
        # beta_schedule 'fit': per slot, then per row
        *_parts("err sums cnt upd", (slots,), f32),
        ("smask", (slots,), torch.bool),
        *_parts("scale fit_val fit_abs fit_okf", (r,), f32),
        ("fit_ok", (r,), torch.bool),
        *_parts("pending total zero", (), f32),
    ]
    if shape.noise:
        # ablation 'noise'/'f_noise': the stand-in prediction and two norms per row
        spec += [("fn", (r, h), f32), *_parts("fn_err fn_norm", (r,), f32)]
    if shape.diagnostics:
        spec.append(("dg_ring", (DIAG_STEPS, r, DIAG_FIELDS), f32))
    if mode != "full_vocab":
        k = min(shape.max_candidates, vocab)
        spec += [
            ("p_slot", (r * k,), torch.long),
            ("dist", (r * k,), f32),
            ("bp", (r,), f32),
            ("mix", (r, k), f32),
            ("live_k", (r, k), torch.bool),
            ("over", (r,), torch.long),
        ]
        if shape.diagnostics:  # the candidate shift per view row (guidance.candidate_shift)
            spec += [
                *_parts("dg_x dg_p dg_q", (r, k), f32),
                *_parts("dg_mx dg_s", (r, 1), f32),
                *_parts("dg_arg dg_tok", (r, 1), torch.long),
                ("dg_cnt", (r,), torch.long),
                ("dg_none", (r, 1), torch.bool),
                *_parts("dg_rows dg_sel", (r, 4), f32),
                ("ninf", (), f32),
            ]
    if mode != "post_filter":
        spec += [("new", (r, vocab), f32), *_parts("fw fb", (r, h), f32)]
        spec += [("bfull", (r,), f32), ("mfull", (r,), torch.bool)]
        if not shape.aliases_masks:
            spec.append(("proj", (r, vocab), dtype))
    return spec


def guidance_workspace_bytes(shape: GuideShape) -> int:
    """Device bytes of a :class:`GuideWorkspace` of this shape, view buffers included."""
    return workspace_bytes(workspace_spec(shape)) + GuideBuffers.nbytes(
        shape.rows, shape.vocab, **shape.view_buffers_args()
    )


class GuideWorkspace:
    """The guided step's temporaries (``take``), view buffers and pinned staging (``stage``)."""

    def __init__(self, shape: GuideShape, device: torch.device):
        rows, vocab = self.rows, self.vocab = shape.rows, shape.vocab
        self.flat, self.parts = carve_workspace(workspace_spec(shape), device)
        self.view_buffers = GuideBuffers(rows, vocab, device, **shape.view_buffers_args())
        self.parts["arange"].copy_(torch.arange(rows, device=device))
        self.parts["err"].fill_(1.0)  # 'fit': a slot's error starts at 1
        if "ninf" in self.parts:
            self.parts["ninf"].fill_(float("-inf"))
        self._proj_aliased, self._dtype = shape.aliases_masks, shape.dtype
        self._stage_dev = carve_workspace_from(self.parts["stage"], _stage_spec(rows))
        n = self.parts["stage"].numel()
        self._staging = StagingRing(device, STAGING_BUFFERS, torch.uint8, numel=n)
        self._host = [
            carve_workspace_from(flat, _stage_spec(rows)) for flat in self._staging.buffers
        ]

    def take(self, name: str, rows: int) -> torch.Tensor:
        """Part ``name``'s first ``rows`` rows."""
        return self.parts[name][:rows]

    def proj(self, rows: int) -> torch.Tensor:
        """``[rows, vocab]`` for the head's output (the view buffers' masks when it fits)."""
        if not self._proj_aliased:
            return self.parts["proj"][:rows]
        flat = self.view_buffers.parts["masks"].view(-1).view(torch.uint8)
        n = rows * self.vocab
        return flat[: n * self._dtype.itemsize].view(self._dtype).view(rows, self.vocab)

    def stage(
        self,
        idx: list[int],
        betas: list[float],
        slots: Sequence[int] = (),
        fresh: Sequence[int] = (),
    ) -> tuple[torch.Tensor, ...]:
        """``(idx, betas, slots, fresh)`` on the device in one copy (slots, fresh: 'fit' only)."""
        i, _ = self._staging.take(self.parts["stage"].numel())
        values = {"idx": idx, "betas": betas, "slots": slots, "fresh": fresh}
        for name, v in values.items():
            self._host[i][name].numpy()[: len(v)] = v
        self._staging.send(i, self.parts["stage"])
        return tuple(self._stage_dev[name][: len(v)] for name, v in values.items())
