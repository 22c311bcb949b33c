"""Runtime settings: what travels to the engine in ``additional_config["tllm"]``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ADDITIONAL_CONFIG_KEY = "tllm"


class ConsumerEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    config: dict[str, Any] = Field(default_factory=dict)
    per_request: bool = Field(
        False,
        description="act only on requests whose extra_args['tllm_consumers'] names this consumer",
    )


class RuntimeSettings(BaseModel):
    """Engine-side runtime settings (JSON in ``additional_config["tllm"]``)."""

    model_config = ConfigDict(extra="forbid")
    consumers: list[ConsumerEntry] = Field(default_factory=list)
    queue_size: int = Field(64, ge=1, description="bundles per background queue")
    overflow: Literal["block", "drop"] = Field(
        "block", description="full background queue: wait (block) or drop the bundle (counted)"
    )
