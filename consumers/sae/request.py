"""Per-request settings of the ``sae`` consumer (``tllm_sae_{field}``); feature indices are
checked against the configured SAE's ``cfg.json``, so the server answers 400 to a bad one."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from consumers.sae.steer import MAX_STEER_ENTRIES, FeatureSteer, check_features
from tllm_core import RequestSettings, WindowSetting


class SaeRequest(RequestSettings):
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
    def _json_text(cls, v: Any) -> Any:
        # vllm_xargs values are often strings: accept the list as JSON text too.
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
