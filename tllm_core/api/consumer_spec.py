"""A consumer spec: the one form a consumer choice takes from any front end to the worker."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ConsumerSpecError(ValueError):
    """A consumer name or config the user gave is not valid."""


class ConsumerSpec(BaseModel):
    """A consumer to build in the engine: its registered name, config dict and scope."""

    model_config = ConfigDict(extra="forbid")
    name: str
    config: dict[str, Any] = Field(default_factory=dict)
    per_request: bool = Field(
        False,
        description="act only on requests whose extra_args['tllm_consumers'] names this consumer",
    )

    def json_ready(self) -> ConsumerSpec:
        """This spec, refused naming the value its config holds that JSON cannot (a NumPy
        number, a tensor): the config travels to the engine as JSON."""
        try:
            json.dumps(self.config)
        except (TypeError, ValueError) as e:
            raise ConsumerSpecError(
                f"consumer {self.name!r}: its config must be plain JSON (numbers, strings, lists, "
                f"objects), it is sent to the engine as JSON: {e}"
            ) from None
        return self

    @classmethod
    def parse(cls, text: str) -> ConsumerSpec:
        """``NAME`` or ``NAME:{json config}`` (the command line's ``--consumer``)."""
        name, sep, raw = text.partition(":")
        name = name.strip()
        if not name:
            raise ConsumerSpecError(f"empty consumer name in {text!r}; use NAME or NAME:{{json}}")
        config: Any = {}
        if sep:
            try:
                config = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConsumerSpecError(
                    f"consumer {name!r}: config is not valid JSON ({e.msg} at column {e.colno}): {raw!r}"
                ) from None
            if not isinstance(config, dict):
                raise ConsumerSpecError(
                    f"consumer {name!r}: config must be a JSON object, got {type(config).__name__}"
                )
        return cls(name=name, config=config)

    @staticmethod
    def listed(specs: Any) -> Sequence:
        """``specs`` if a list of them: a bare string would be read as its letters."""
        if isinstance(specs, (str, dict)) or not isinstance(specs, Sequence):
            raise ConsumerSpecError(f"consumers must be a list (e.g. ['stats']), got {specs!r:.80}")
        return specs

    @classmethod
    def coerce(cls, value: str | dict | ConsumerSpec) -> ConsumerSpec:
        """A spec from a ``NAME[:JSON]`` string, a dict of its fields, or a spec."""
        if isinstance(value, ConsumerSpec):
            return value.json_ready()
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, dict):
            try:
                return cls.model_validate(value).json_ready()
            except ValidationError as e:
                raise ConsumerSpecError(f"invalid consumer spec {value!r}:\n{e}") from None
        raise ConsumerSpecError(
            f"a consumer is a 'NAME[:JSON]' string, a dict or a ConsumerSpec, got {value!r}"
        )
