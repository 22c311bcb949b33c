"""Plugin discovery (pluggy): consumers, producers and commands; consumer spec parsing
(``NAME`` or ``NAME:{json config}``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pluggy
from pydantic import ValidationError

from tllm_core import hookspecs
from tllm_core.consumer import Consumer, ConsumerConfig
from tllm_core.ports import FINAL, HiddenStates, LayerPort, Phase, ReadPort, TokenPort
from tllm_core.producer import Producer

# Built-ins register through this entry-point group and the same hooks as third-party
# plugins (see pyproject.toml), so the core names none of them.
ENTRY_POINT_GROUP = "tllm"


class ConsumerSpecError(ValueError):
    """A consumer name or config the user gave is not valid."""


@dataclass
class ConsumerSpec:
    """A consumer to build in the engine: its registered name and its config dict."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)
    # Act only on requests whose extra_args["tllm_consumers"] names this consumer.
    per_request: bool = False

    @classmethod
    def parse(cls, text: str) -> ConsumerSpec:
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
        return cls(name, config)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "config": self.config, "per_request": self.per_request}


class Registry:
    """Consumer and producer classes, collected from the ``tllm`` entry points (built-ins
    included) and plugins registered at run time.

    One per engine or command: no process-wide state.
    """

    def __init__(self, load_entry_points: bool = True):
        self.pm = pluggy.PluginManager("tllm")
        self.pm.add_hookspecs(hookspecs)
        if load_entry_points:
            self.pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        self._classes: dict[str, type[Consumer]] = {}
        self._producers: dict[type[ReadPort], Producer] = {}
        self._collect()

    def _collect(self) -> None:
        for classes in self.pm.hook.tllm_consumers():
            for cls in classes:
                if not (isinstance(cls, type) and issubclass(cls, Consumer)) or not cls.name:
                    raise TypeError(f"plugin returned {cls!r}: expected a named Consumer subclass")
                if cls.name in self._classes and self._classes[cls.name] is not cls:
                    raise ValueError(
                        f"two plugins register a consumer named {cls.name!r}: "
                        f"{self._classes[cls.name].__module__} and {cls.__module__}"
                    )
                self._classes[cls.name] = cls
        for classes in self.pm.hook.tllm_producers():
            for cls in classes:
                if not (isinstance(cls, type) and issubclass(cls, Producer)) or not cls.ports:
                    raise TypeError(
                        f"plugin returned {cls!r}: expected a Producer subclass serving ports"
                    )
                for port_cls in cls.ports:
                    old = self._producers.get(port_cls)
                    if old is not None and type(old) is not cls:
                        raise ValueError(
                            f"two plugins serve port {port_cls.__name__}: "
                            f"{type(old).__module__}.{type(old).__name__} and "
                            f"{cls.__module__}.{cls.__name__}"
                        )
                    if old is None:
                        self._producers[port_cls] = cls()

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object/module at run time (tests, notebooks)."""
        self.pm.register(plugin, name=name)
        self._collect()

    # -- producers --------------------------------------------------------------------
    def producer_for(self, port: ReadPort) -> Producer:
        """The producer serving ``port``'s type (or its nearest registered base type)."""
        for t in type(port).__mro__:
            prod = self._producers.get(t)
            if prod is not None:
                return prod
        raise ValueError(
            f"no producer serves port {type(port).__name__}; served: "
            f"{', '.join(sorted(t.__name__ for t in self._producers)) or '(none)'}"
        )

    def parse_port(self, text: str, phase: Phase = Phase.ALL) -> TokenPort:
        """A token port from its export name: ``{i}`` / ``final`` (residual stream) or
        ``{prefix}.{i}`` of any registered layer port (``attn.3``, ``mlp.-1``)."""
        text = text.strip()
        prefixes = {
            t.prefix: t
            for t in self._producers
            if isinstance(t, type) and issubclass(t, LayerPort) and hasattr(t, "prefix")
        }
        if text == FINAL:
            return HiddenStates(FINAL, phase)
        head, sep, tail = text.partition(".")
        try:
            if not sep:
                return HiddenStates(int(text), phase)
            if head in prefixes:
                return prefixes[head](int(tail), phase)
            if head == "layer":
                return HiddenStates(int(tail), phase)
        except ValueError:
            pass
        names = ", ".join(["{i}", "final", "layer.{i}", *(f"{p}.{{i}}" for p in sorted(prefixes))])
        raise ValueError(
            f"bad port {text!r}: expected one of {names} (i a layer index, negative from the end)"
        )

    @property
    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> type[Consumer]:
        try:
            return self._classes[name]
        except KeyError:
            raise ConsumerSpecError(
                f"unknown consumer {name!r}; available: {', '.join(self.names) or '(none)'}"
            ) from None

    def validate(self, spec: ConsumerSpec) -> ConsumerConfig:
        """Build the consumer's config model; errors name the consumer and the field."""
        cls = self.get(spec.name)
        try:
            return cls.Config(**spec.config)
        except ValidationError as e:
            raise ConsumerSpecError(f"invalid config for consumer {spec.name!r}:\n{e}") from None

    def describe(self) -> list[dict[str, Any]]:
        """Name, one-line description and config fields of every consumer."""
        out = []
        for name in self.names:
            cls = self._classes[name]
            fields = []
            for fname, f in cls.Config.model_fields.items():
                fields.append(
                    {
                        "name": fname,
                        "type": _type_name(f.annotation),
                        "default": None
                        if f.is_required()
                        else _jsonable(f.get_default(call_default_factory=True)),
                        "required": f.is_required(),
                        "description": f.description or "",
                    }
                )
            out.append(
                {
                    "name": name,
                    "description": cls.description,
                    "module": cls.__module__,
                    "fields": fields,
                }
            )
        return out


def _type_name(t: Any) -> str:
    """Readable annotation: ``int | 'final'``, ``list[int | str]``, ``'a' | 'b'``."""
    import types
    import typing

    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return (
            f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
        )
    if t is type(None):
        return "None"
    return getattr(t, "__name__", str(t))


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)
