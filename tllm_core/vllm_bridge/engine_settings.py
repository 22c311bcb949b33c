"""The tllm settings in an engine's ``additional_config`` (a leaf module: the plugin, the API
server and the workers read them without importing each other)."""

from __future__ import annotations

import json
from typing import Any

# == runtime.settings.ADDITIONAL_CONFIG_KEY (not imported: this module stays cheap)
SETTINGS_KEY = "tllm"


def tllm_settings(additional_config: Any) -> dict | None:
    """The tllm settings in an engine's ``additional_config`` (dict or JSON text), else None."""
    if isinstance(additional_config, str):
        try:
            additional_config = json.loads(additional_config)
        except ValueError:
            return None
    if not isinstance(additional_config, dict):
        return None
    return additional_config.get(SETTINGS_KEY)
