"""``steer``: add (or ablate) fixed vectors in the residual stream at chosen layers."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from consumers.steer.vectors import check_vector, load_vector
from tllm_core import (
    Consumer,
    ConsumerConfig,
    ConsumerContext,
    EditPlan,
    FiniteF32,
    RequestInfo,
    RequestSettings,
    ResidualEdit,
    RowInfo,
    WritePort,
)

# Inline vectors are model-width; a million entries is past any model (and bounds the JSON).
MAX_INLINE_VECTOR = 1 << 20


class SteerVector(BaseModel):
    """One vector at one layer."""

    model_config = ConfigDict(extra="forbid")
    layer: int = Field(
        ...,
        description="Decoder layer whose output residual stream is edited "
        "(negative counts from the end).",
    )
    path: str | None = Field(
        None,
        description="Vector file: .safetensors (one tensor, or 'file.safetensors::key'), "
        ".pt/.pth (a tensor or a dict of tensors with '::key'), or .npy.",
    )
    vector: list[FiniteF32] | None = Field(
        None, max_length=MAX_INLINE_VECTOR, description="The vector inline (instead of path)."
    )
    scale: FiniteF32 = Field(
        1.0,
        description="Multiplier of the vector in 'add' mode (0 is allowed; ignored by 'ablate').",
    )
    mode: Literal["add", "ablate"] = Field(
        "add",
        description="'add': s += scale*v; 'ablate': remove the component of s along v "
        "(s -= (s.u)u with u = v/|v|).",
    )
    normalize: bool = Field(False, description="Scale v to unit norm before applying 'scale'.")

    @model_validator(mode="after")
    def _one_source(self) -> SteerVector:
        if (self.path is None) == (self.vector is None):
            raise ValueError("give exactly one of 'path' and 'vector'")
        return self


class SteerConfig(ConsumerConfig):
    vectors: list[SteerVector] = Field(..., min_length=1, description="Vectors to apply.")
    positions: Literal["prompt", "generated", "all"] = Field(
        "all",
        description="Rows edited: prompt tokens, generated tokens (decode rows), or both.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_per_request(cls, data: Any) -> Any:
        if isinstance(data, dict) and "per_request" in data:
            raise ValueError(
                'steer\'s config.per_request was removed: set "per_request": true on the '
                'consumer entry (beside "name" and "config") and name steer in a request\'s '
                "tllm_consumers"
            )
        return data


class SteerRequest(RequestSettings):
    """Per-request settings: ``tllm_steer_scale``."""

    scale: FiniteF32 | None = Field(
        None,
        description="replaces the 'scale' of every 'add' vector for this request "
        "(default: each vector's configured scale)",
    )


# Scaled vectors kept per steer for scale overrides (one per distinct override and vector).
KEEP_SCALED = 64


class _Vec:
    __slots__ = ("layer", "vector", "scale", "mode", "scaled")

    def __init__(self, layer: int, vector: torch.Tensor, scale: float, mode: str):
        self.layer = layer
        self.vector = vector
        self.scale = scale
        self.mode = mode
        # scale -> vector * scale, made once: the same tensor every step, so the edit
        # buffers move it to the model's dtype once (tllm_core/api/edit_values.py).
        self.scaled: dict[float, torch.Tensor] = {}

    def times(self, scale: float) -> torch.Tensor:
        """``vector * scale``, the same tensor for the same scale."""
        out = self.scaled.get(scale)
        if out is None:
            if len(self.scaled) >= KEEP_SCALED:
                self.scaled.pop(next(iter(self.scaled)))
            # Not an inference tensor (edit runs in vLLM's inference mode): one has no
            # version, and the edit buffers keep only values whose changes they can see.
            with torch.inference_mode(False):
                out = self.scaled[scale] = self.vector * scale
        return out


class SteerConsumer(Consumer):
    name = "steer"
    proof_counter = "rows_selected"
    description = (
        "Activation steering: add scale*vector to (or ablate a direction from) the residual "
        "stream after chosen layers, on prompt and/or generated tokens."
    )
    Config = SteerConfig
    Request = SteerRequest

    config: SteerConfig  # the registry builds it from the spec (validated there, once)

    def __init__(self, config: SteerConfig, context: ConsumerContext):
        super().__init__(config, context)
        hidden = int(context.model.hidden_size)
        device = context.model.device
        self.vectors: list[_Vec] = []
        ablated: dict[int, int] = {}
        for i, entry in enumerate(config.vectors):
            try:
                layer = context.resolve_layer(entry.layer)
            except ValueError as e:
                raise ValueError(f"steer: vectors[{i}].layer: {e}") from None
            if entry.path is not None:
                try:
                    vec = load_vector(entry.path, hidden)
                except ValueError as e:
                    raise ValueError(f"steer: vectors[{i}].path: {e}") from None
            else:
                try:
                    vec = check_vector(
                        torch.tensor(entry.vector, dtype=torch.float32),
                        hidden,
                        f"vectors[{i}].vector",
                    )
                except ValueError as e:
                    raise ValueError(f"steer: {e}") from None
            norm = float(vec.norm())
            if (entry.mode == "ablate" or entry.normalize) and norm == 0.0:
                raise ValueError(
                    f"steer: vectors[{i}] is all zeros: 'ablate' and normalize=true need a "
                    f"non-zero direction"
                )
            if entry.mode == "ablate":
                if layer in ablated:
                    raise ValueError(
                        f"steer: vectors[{ablated[layer]}] and vectors[{i}] both ablate at layer "
                        f"{layer}; one ablation direction per layer is supported"
                    )
                ablated[layer] = i
                vec = vec / norm
            elif entry.normalize:
                vec = vec / norm
            self.vectors.append(_Vec(layer, vec.to(device), float(entry.scale), entry.mode))
        self.layers = sorted({v.layer for v in self.vectors})
        # engine_id -> scale override (None: config scales) or False (not steered)
        self._req_cache: dict[str, float | None | bool] = {}

    def writes(self) -> list[WritePort]:
        return [ResidualEdit(layer) for layer in self.layers]

    # -- selection -------------------------------------------------------------------------
    def _request_state(self, req: RequestInfo) -> float | None | bool:
        """False: not steered; None: steered with config scales; float: scale override."""
        state = self._req_cache.get(req.engine_id, _MISSING)
        if state is not _MISSING:
            return state
        if not self.acts_on(req):
            state = False  # per-request steer that this request did not name
        else:
            state = req.settings(self).scale
        self._req_cache[req.engine_id] = state
        return state

    def select(self, rows: RowInfo) -> tuple[np.ndarray, np.ndarray | None]:
        """Row indices to steer, and their per-row scale overrides (NaN: config scale) or None."""
        n = len(rows)
        if n == 0:
            return np.zeros(0, np.int64), None
        pos = self.config.positions
        if pos == "all":
            mask = np.ones(n, np.bool_)
        else:
            dec = np.asarray(rows.is_decode, np.bool_)
            mask = dec.copy() if pos == "generated" else ~dec
        overrides: np.ndarray | None = None
        for req, start, stop in rows.runs():
            state = self._request_state(req)
            if state is False:
                mask[start:stop] = False
            elif state is not None:
                if overrides is None:
                    overrides = np.full(n, np.nan)
                overrides[start:stop] = state
        idx = np.nonzero(mask)[0].astype(np.int64)
        if overrides is not None:
            overrides = overrides[idx]
            if np.isnan(overrides).all():
                overrides = None
        return idx, overrides

    def edit(self, rows: RowInfo, plan: EditPlan) -> None:
        idx, overrides = self.select(rows)
        if idx.size == 0:
            return
        for v in self.vectors:
            if v.mode == "ablate":
                plan.ablate(v.layer, idx, v.vector)
            elif overrides is None:
                plan.add(v.layer, idx, v.times(v.scale))
            else:
                scales = np.where(np.isnan(overrides), v.scale, overrides)
                if np.all(scales == scales[0]):
                    plan.add(v.layer, idx, v.times(float(scales[0])))
                else:  # per-row values: made (and on a GPU copied) every step
                    s = torch.from_numpy(scales.astype(np.float32)).to(v.vector.device)
                    plan.add(v.layer, idx, s[:, None] * v.vector)
        n = int(idx.size)
        for layer in self.layers:
            self.counters.add(f"rows_selected.layer.{layer}", n)
        self.counters.add("rows_selected", n * len(self.layers))

    def on_request_finished(self, request: RequestInfo) -> None:
        self._req_cache.pop(request.engine_id, None)

    def result(self) -> dict[str, Any]:
        return {
            "layers": self.layers,
            "rows_selected": int(self.counters.get("rows_selected")),
        }


_MISSING = object()
