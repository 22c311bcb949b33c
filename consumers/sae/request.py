"""Per-request settings of the ``sae`` consumer (vllm_xargs keys ``tllm_sae_{field}``).

``tllm_sae_steer``: the steering entries for this request, replacing the config's
``steer`` (``[]`` turns steering off for it); ``tllm_sae_record``: record this request's
features (``false`` skips it; needs ``out`` in the config). Unset fields keep the
config's behaviour.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, field_validator

from consumers.sae.core_api import RequestSettings
from consumers.sae.steer import FeatureSteer


class SaeRequest(RequestSettings):
    steer: list[FeatureSteer] | None = Field(
        None,
        description="Steering entries for this request ({'feature': f, 'scale': s} or "
        "{'feature': f, 'clamp': v}); replaces the config's 'steer'; [] turns it off.",
    )
    record: bool | None = Field(
        None, description="Record this request's features (default: when 'out' is set)."
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
        return v
