"""Config of the ``sae`` consumer, its per-request settings and the ports of its ``site``."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from consumers.export.format import Folder
from consumers.sae.loader import SAEFileError, read_config
from consumers.sae.steer import MAX_STEER_ENTRIES, FeatureSteer, check_features
from producers import AttentionOutput, MlpOutput
from tllm_core import (
    CaptureWindow,
    ConsumerConfig,
    Edit,
    HiddenStates,
    Phase,
    PortName,
    ReadPort,
    RequestSettings,
    ResidualEdit,
    WindowSetting,
    WritePort,
    parse_port_name,
)

# A site is a residual layer, attn.{i} or mlp.{i}; not final (an SAE there could not edit it).
SITE_PREFIXES = ("attn", "mlp")


def parse_site(value: int | str) -> PortName:
    """Parse a site spec; raises ``ValueError`` naming the bad value and the allowed forms."""
    return parse_port_name(value, SITE_PREFIXES, final=False, what="site")


def read_port(site: PortName, phase: Any) -> ReadPort:
    layer = int(site.layer)  # type: ignore[arg-type]  # a site is never 'final'
    if site.is_residual:
        return HiddenStates(layer, phase)
    return (AttentionOutput if site.prefix == "attn" else MlpOutput)(layer, phase)


def edit_port(site: PortName, transform: Any = None) -> WritePort:
    """The write port that edits ``site`` (with an in-graph ``transform``: the clamps)."""
    if site.is_residual and transform is None:
        return ResidualEdit(int(site.layer))  # type: ignore[arg-type]
    return Edit(read_port(site, Phase.ALL), transform=transform)


class SaeConfig(ConsumerConfig):
    path: Folder = Field(
        ..., description="SAE folder in SAELens's layout (cfg.json + sae_weights.safetensors)."
    )
    site: int | str = Field(
        -1,
        description="Where the SAE reads (and steers), a port name: '{i}' or 'layer.{i}' residual "
        "stream after layer i, "
        "'attn.{i}' or 'mlp.{i}' (negative i counts from the end).",
    )
    top_k: int = Field(
        32, ge=1, le=65536, description="Active features recorded per row (with 'out')."
    )
    out: Folder | None = Field(
        None, description="Directory for sparse feature records (export layout); none: no records."
    )
    steer: list[FeatureSteer] = Field(
        default_factory=list,
        max_length=MAX_STEER_ENTRIES,
        description="Steering entries applied to every row: {'feature': f, 'scale': s} adds "
        "s*W_dec[f]; {'feature': f, 'clamp': v} clamps feature f to v.",
    )
    watch: list[int] = Field(
        default_factory=list,
        description="Features whose firing rate (fraction of encoded rows) is counted.",
    )
    phase: CaptureWindow = Field(
        "all",
        description="Rows encoded and recorded: 'prefill', 'decode', 'all', or a capture window "
        "('last_prompt', 'generated[0:16]', ...: docs/ports.md#capture-windows).",
    )

    values_dtype: Literal["float16", "float32"] = Field(
        "float16", description="Storage dtype of recorded feature values."
    )
    shard_rows: int = Field(65536, ge=1, description="Rows per feature shard.")
    delivery: Literal["end_of_step", "background"] = Field(
        "end_of_step",
        description="Where rows are encoded: 'end_of_step' on the engine thread, on the "
        "model's device, right after each step (only the top-k leave the device); "
        "'background' on a consumer thread from host copies of the site's rows.",
    )
    overwrite: bool = Field(False, description="Allow a non-empty 'out' (as export's).")

    _d_sae: int | None = PrivateAttr(None)

    def declared_d_sae(self) -> int | None:
        """``d_sae`` from the SAE's ``cfg.json`` (read once); None when unreadable here (the
        engine, which loads it, reports why)."""
        if self._d_sae is None:
            try:
                self._d_sae = int(read_config(self.path)["d_sae"])
            except (SAEFileError, OSError):
                return None
        return self._d_sae

    @field_validator("site")
    @classmethod
    def _site(cls, v: int | str) -> int | str:
        parse_site(v)
        return v


class SaeRequest(RequestSettings):
    """Per-request settings; features are checked against the SAE's ``cfg.json`` (400)."""

    steer: list[FeatureSteer] | None = Field(
        None,
        max_length=MAX_STEER_ENTRIES,
        description="Steering entries for this request ({'feature': f, 'scale': s} or "
        "{'feature': f, 'clamp': v}); replaces the config's 'steer'; [] turns it off.",
    )
    record: bool | None = Field(
        None, description="Record this request's features (default: when 'out' is set)."
    )
    window: WindowSetting = Field(
        None,
        description="Rows of this request to encode and record, within the config's 'phase' "
        "(steering is not windowed).",
    )

    @field_validator("steer", mode="before")
    @classmethod
    def _json_text(cls, v: Any) -> Any:  # vllm_xargs values are often strings
        if isinstance(v, str):
            try:
                return json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"steer: not valid JSON: {e}") from None
            except RecursionError:  # nested deeper than Python's parser goes
                raise ValueError("steer: not valid JSON: nested too deeply") from None
        return v

    @model_validator(mode="after")
    def _fits_the_sae(self, info: ValidationInfo) -> SaeRequest:
        config = (info.context or {}).get("config")
        if self.record and config is not None and getattr(config, "out", None) is None:
            raise ValueError(
                "record is true but the sae consumer's config sets no 'out' folder to record "
                "into; set 'out' in the config (per-request 'record' can only switch "
                "recording off or back on)"
            )
        if not self.steer:
            return self
        for i, e in enumerate(self.steer):
            if e.clamp is not None:
                raise ValueError(
                    f"steer[{i}] uses 'clamp': clamps are compiled into the forward at start-up, "
                    f"so they are given in the consumer's config 'steer' only; use 'scale' here"
                )
        d_sae = config.declared_d_sae() if config is not None else None
        if d_sae is not None:
            check_features((e.feature for e in self.steer), d_sae, "steer[{}].feature")
        return self
