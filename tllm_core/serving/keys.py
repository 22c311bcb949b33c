"""The ``vllm_xargs`` keys of tllm and their validation (see docs/serving.md).

vLLM copies a request's ``vllm_xargs`` into ``SamplingParams.extra_args``; the engine-side
runtime reads them per request (``RequestInfo.extra_args``). Values must be flat strings or
numbers. Every key starting with ``tllm_`` is checked when a request arrives; a bad one is a
``ValueError`` whose message names the key and what is allowed (HTTP 400 in the server).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from tllm_core.settings import RuntimeSettings

PREFIX = "tllm_"
CONSUMERS = "tllm_consumers"
ESAMP_BETA = "tllm_esamp_beta"
STEER_SCALE = "tllm_steer_scale"
STEER_FLAG = "tllm_steer"
GROUP = "tllm_group"

KEYS: dict[str, str] = {
    CONSUMERS: "string: comma-separated names of per-request consumers to switch on for this "
    "request (each must be configured on the server)",
    ESAMP_BETA: "number >= 0 (or a numeric string): ESamp's beta for this request; esamp must "
    "be active for the request",
    STEER_SCALE: "finite number (or a numeric string): replaces the scale of every 'add' "
    "steering vector for this request; steer must be active for the request",
    STEER_FLAG: "steer's own per-request flag, for a steer configured with "
    "config.per_request=true (truthy: steer this request)",
    GROUP: "string: requests sharing this value share one ESamp distiller (default: the n "
    "samples of one request share one)",
}

_FALSE_STRINGS = {"", "0", "false", "no", "off", "none", "null"}


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() not in _FALSE_STRINGS
    return bool(v)


def parse_number(key: str, raw: Any) -> float:
    """A finite float from a number or numeric string; ValueError naming ``key`` otherwise."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ValueError(f"vllm_xargs[{key!r}] must be a number, got {raw!r}")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"vllm_xargs[{key!r}] must be a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"vllm_xargs[{key!r}] must be finite, got {raw!r}")
    return value


def enabled_names(extra: dict[str, Any]) -> list[str]:
    raw = extra.get(CONSUMERS, "")
    if not isinstance(raw, str):
        raise ValueError(
            f'vllm_xargs[{CONSUMERS!r}] must be a comma-separated string (e.g. "esamp,steer"), '
            f"got {raw!r}"
        )
    return [n.strip() for n in raw.split(",") if n.strip()]


@dataclass
class ServerConsumers:
    """The consumers a server was started with (``additional_config["tllm"]``)."""

    per_request: dict[str, bool] = field(default_factory=dict)
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, raw: dict[str, Any] | RuntimeSettings) -> ServerConsumers:
        settings = raw if isinstance(raw, RuntimeSettings) else RuntimeSettings.model_validate(raw)
        out = cls()
        for e in settings.consumers:
            out.per_request[e.name] = e.per_request
            out.configs[e.name] = dict(e.config)
        return out

    def active(self, name: str, extra: dict[str, Any]) -> bool:
        """Whether consumer ``name`` acts on a request with these extra_args."""
        if name not in self.per_request:
            return False
        if self.per_request[name] and name not in enabled_names(extra):
            return False
        if name == "steer" and self.configs[name].get("per_request"):
            return _truthy(extra.get(STEER_FLAG))
        return True

    def describe(self) -> dict[str, Any]:
        return {
            "consumers": {n: {"per_request": p} for n, p in self.per_request.items()},
            "keys": KEYS,
        }


def _need_active(server: ServerConsumers, name: str, key: str, extra: dict[str, Any]) -> None:
    if name not in server.per_request:
        raise ValueError(
            f"vllm_xargs[{key!r}] needs the {name!r} consumer, which this server does not run "
            f"(configured: {sorted(server.per_request) or 'none'})"
        )
    if not server.active(name, extra):
        how = (
            f'add "{name}" to vllm_xargs[{CONSUMERS!r}]'
            if server.per_request[name]
            else f"set vllm_xargs[{STEER_FLAG!r}] to true"
        )
        raise ValueError(
            f"vllm_xargs[{key!r}] has no effect: {name!r} is not active for this request ({how})"
        )


def validate_extra_args(extra: dict[str, Any] | None, server: ServerConsumers) -> None:
    """Check every ``tllm_*`` key of a request; raise ValueError with a clear message."""
    if not extra:
        return
    for key, value in extra.items():
        if not key.startswith(PREFIX):
            continue
        if key not in KEYS:
            raise ValueError(
                f"unknown tllm key vllm_xargs[{key!r}]; known keys: {', '.join(sorted(KEYS))}"
            )
        if not isinstance(value, (str, int, float)):
            raise ValueError(f"vllm_xargs[{key!r}] must be a flat string or number, got {value!r}")
    names = enabled_names(extra)
    optional = sorted(n for n, p in server.per_request.items() if p)
    for n in names:
        if n not in server.per_request:
            raise ValueError(
                f"unknown consumer {n!r} in vllm_xargs[{CONSUMERS!r}]; this server's per-request "
                f"consumers: {optional or 'none'}"
            )
    if ESAMP_BETA in extra:
        beta = parse_number(ESAMP_BETA, extra[ESAMP_BETA])
        if beta < 0:
            raise ValueError(
                f"vllm_xargs[{ESAMP_BETA!r}] must be >= 0 (0: no guidance), got {beta}"
            )
        _need_active(server, "esamp", ESAMP_BETA, extra)
    if STEER_SCALE in extra:
        parse_number(STEER_SCALE, extra[STEER_SCALE])
        _need_active(server, "steer", STEER_SCALE, extra)
    if STEER_FLAG in extra and "steer" not in server.per_request:
        raise ValueError(
            f"vllm_xargs[{STEER_FLAG!r}] needs the 'steer' consumer, which this server does not run"
        )
    if GROUP in extra and isinstance(extra[GROUP], str) and not extra[GROUP].strip():
        raise ValueError(f"vllm_xargs[{GROUP!r}] must not be empty")


def request_salt(extra: dict[str, Any] | None) -> str | None:
    """Prefix-cache salt of a request with tllm settings (None: no ``tllm_*`` key).

    Requests with different tllm settings may compute different KV for the same tokens
    (steering edits the residual stream), so they must not share cached blocks; requests with
    identical settings compute identical KV and may.
    """
    items = sorted((k, str(v)) for k, v in (extra or {}).items() if k.startswith(PREFIX))
    if not items:
        return None
    digest = hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]
    return f"tllm-{digest}"
