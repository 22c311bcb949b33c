"""``steer``'s config and per-request settings, and the registered vectors kept in ``keep_dir``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tllm_core import ConsumerConfig, FiniteF32, RequestSettings

if TYPE_CHECKING:
    import torch

# Inline vectors are model-width; a million entries is past any model (and bounds the JSON).
MAX_INLINE_VECTOR = 1 << 20


class _FromPathOrVector(BaseModel):
    """A direction given as exactly one of ``path`` and ``vector``."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _one_source(self) -> _FromPathOrVector:
        if (self.path is None) == (self.vector is None):  # type: ignore[attr-defined]
            raise ValueError("give exactly one of 'path' and 'vector'")
        return self


class SteerGate(_FromPathOrVector):
    """A probe that decides, row by row inside the forward, whether a vector applies."""

    path: str | None = Field(None, description="Probe direction file (as a vector's 'path').")
    vector: list[FiniteF32] | None = Field(
        None, max_length=MAX_INLINE_VECTOR, description="The probe direction inline."
    )
    threshold: FiniteF32 = Field(..., description="The probe fires where its score crosses this.")
    above: bool = Field(
        True, description="Fire where score > threshold (false: where score < threshold)."
    )
    normalize: bool = Field(
        True, description="Score with the unit direction (s.d/|d|); false: the raw s.d."
    )


class SteerVector(_FromPathOrVector):
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Name a request chooses the vector by (tllm_steer_vectors).",
    )
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
    mode: Literal["add", "ablate", "clamp"] = Field(
        "add",
        description="'add': s += scale*v; 'ablate': remove the component of s along v "
        "(s -= (s.u)u with u = v/|v|); 'clamp': clip the projection s.u to [lo, hi], or set "
        "it to 'target' (s += (p' - s.u)u).",
    )
    normalize: bool = Field(False, description="Scale v to unit norm before applying 'scale'.")
    lo: FiniteF32 | None = Field(None, description="'clamp': lowest projection kept.")
    hi: FiniteF32 | None = Field(None, description="'clamp': highest projection kept.")
    target: FiniteF32 | None = Field(None, description="'clamp': the projection set on every row.")
    gate: SteerGate | None = Field(
        None,
        description="Apply only to rows where this probe, read at the same layer (before "
        "steer's in-graph edits there), fires; decided inside the forward (counter rows_gated).",
    )
    registered: bool = Field(
        False,
        description="Used only by requests that name it (tllm_steer_vectors); removable on a "
        "running server. Vectors a server registers get it.",
    )

    @model_validator(mode="after")
    def _check(self) -> SteerVector:
        bounds = (self.lo, self.hi, self.target)
        if self.mode != "clamp":
            if any(b is not None for b in bounds):
                raise ValueError(f"lo, hi and target are for mode 'clamp', not {self.mode!r}")
        elif self.target is not None and (self.lo, self.hi) != (None, None):
            raise ValueError("'clamp': give 'target', or 'lo' and/or 'hi', not both")
        elif self.target is None and self.lo is None and self.hi is None:
            raise ValueError("'clamp' needs 'target', or 'lo' and/or 'hi'")
        elif self.lo is not None and self.hi is not None and self.lo > self.hi:
            raise ValueError(f"'clamp': lo ({self.lo}) is above hi ({self.hi})")
        return self

    @property
    def in_graph(self) -> bool:
        """Decided on the row's own value inside the forward (an in-graph transform)."""
        return self.mode == "clamp" or self.gate is not None


class SteerConfig(ConsumerConfig):
    vectors: list[SteerVector] = Field(
        default_factory=list, description="Vectors to apply (at least one, or open_layers)."
    )
    positions: Literal["prompt", "generated", "all"] = Field(
        "all", description="Rows edited: prompt tokens, generated tokens (decode rows), or both."
    )
    open_layers: list[int] = Field(
        default_factory=list,
        max_length=1024,
        description="Layers where a running server may register vectors (besides configured "
        "vectors' layers): their edit ports are declared at start.",
    )
    keep_dir: str | None = Field(
        None,
        description="Folder where registered vectors are kept, and loaded from at start "
        "(None: a registration ends with the server).",
    )
    max_registered: int = Field(64, ge=0, le=4096, description="Registered vectors at most.")
    max_registered_mib: float = Field(
        64.0, gt=0, le=65536, description="Registered vectors' values at most, in MiB (float32)."
    )

    @model_validator(mode="after")
    def _names_and_layers(self) -> SteerConfig:
        if self.keep_dir is not None:
            have = {v.name for v in self.vectors}
            kept = [SteerVector.model_validate(e) for e in kept_entries(self.keep_dir)]
            self.vectors = [*self.vectors, *(v for v in kept if v.name not in have)]
        if not self.vectors and not self.open_layers:
            raise ValueError("give at least one vector, or open_layers for registered ones")
        names = [v.name for v in self.vectors if v.name is not None]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"vector name(s) {', '.join(map(repr, dup))} given twice")
        return self

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
    scale: FiniteF32 | None = Field(
        None,
        description="replaces the 'scale' of every 'add' vector for this request "
        "(default: each vector's configured scale)",
    )
    vectors: dict[str, FiniteF32 | None] | None = Field(
        None,
        max_length=256,
        json_schema_extra={"form": "'NAME[=SCALE],...' (each SCALE a finite float32)"},
        description="the named vectors this request uses, as 'NAME[=SCALE],...' (no scale: "
        "the configured one); the others are off for it (default: every vector)",
    )

    @field_validator("vectors", mode="before")
    @classmethod
    def _parse_names(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        out: dict[str, str | None] = {}
        for item in filter(None, (p.strip() for p in value.split(","))):
            name, eq, scale = item.partition("=")
            out[name.strip()] = scale.strip() if eq else None
        return out

    @model_validator(mode="after")
    def _known_names(self, info: ValidationInfo) -> SteerRequest:
        config = (info.context or {}).get("config")
        if self.vectors is None or not isinstance(config, SteerConfig):
            return self
        known = {v.name: v for v in config.vectors if v.name is not None}
        for name, scale in self.vectors.items():
            if name not in known:
                raise ValueError(
                    f"no steering vector named {name[:64]!r}; this engine's: "  # names: <= 64
                    f"{', '.join(sorted(known)) or '(none named)'}"
                )
            if scale is not None and known[name].mode != "add":
                raise ValueError(f"vector {name!r} is '{known[name].mode}': it takes no scale")
        return self


# keep_dir: one NAME.safetensors per registered vector, its settings as metadata.
KEPT_SUFFIX = ".safetensors"


def kept_entries(folder: str) -> list[dict[str, Any]]:
    from safetensors import safe_open

    path = Path(folder)
    if not path.is_dir():
        return []
    out = []
    for f in sorted(path.glob(f"*{KEPT_SUFFIX}")):
        with safe_open(str(f), "pt") as st:
            meta = st.metadata() or {}
        out.append(
            {
                "name": f.name[: -len(KEPT_SUFFIX)],
                "layer": int(meta.get("layer", "0")),
                "mode": meta.get("mode", "add"),
                "scale": float(meta.get("scale", "1.0")),
                "normalize": meta.get("normalize", "false") == "true",
                "path": str(f),
                "registered": True,
            }
        )
    return out


def keep(folder: str, name: str, vector: torch.Tensor, entry: dict[str, Any]) -> None:
    """Write ``NAME.safetensors`` atomically."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    meta = {
        "layer": str(entry["layer"]),
        "mode": str(entry.get("mode", "add")),
        "scale": repr(float(entry.get("scale", 1.0))),
        "normalize": "true" if entry.get("normalize") else "false",
    }
    final = Path(folder) / f"{name}{KEPT_SUFFIX}"
    tmp = final.with_name(f".{name}.{os.getpid()}.tmp")
    save_file({"vector": vector.detach().float().cpu().contiguous()}, str(tmp), metadata=meta)
    os.replace(tmp, final)


def forget(folder: str, name: str) -> None:
    (Path(folder) / f"{name}{KEPT_SUFFIX}").unlink(missing_ok=True)
