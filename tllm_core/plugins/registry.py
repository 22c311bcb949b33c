"""The consumers, producers and architectures the ``tllm`` plugins contribute."""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

from pydantic import ValidationError

from tllm_core.api.architectures import Architectures
from tllm_core.api.consumer import Consumer, ConsumerConfig
from tllm_core.api.consumer_spec import ConsumerSpec, ConsumerSpecError
from tllm_core.api.port_names import FINAL, parse_port_name
from tllm_core.api.ports import HiddenStates, LayerPort, Phase, ReadPort, TokenPort
from tllm_core.api.producer import Producer
from tllm_core.api.request_settings import (
    GENERIC_KEYS,
    RequestSettings,
    allowed,
    describe_field,
    describe_request_keys,
    message,
    request_keys,
    short_repr,
    short_text,
    type_name,
)
from tllm_core.plugins.loader import BrokenPlugin, Plugins

__all__ = ["ConsumerSpec", "ConsumerSpecError", "Registry"]


class Registry:
    """Consumer and producer classes from the ``tllm`` entry points and run-time plugins."""

    def __init__(self, load_entry_points: bool = True, plugins: Plugins | None = None):
        self.plugins = plugins or Plugins.load(load_entry_points)
        self.pm = self.plugins.pm
        self._classes: dict[str, type[Consumer]] = {}
        self._owners: dict[str, str] = {}  # consumer name -> the plugin that registered it
        self._producers: dict[type[ReadPort], Producer] = {}
        self.architectures = Architectures()
        for name in self.plugins.loaded:
            try:
                self._collect(name)
            except Exception as e:  # noqa: BLE001 - one plugin's failure skips that plugin only
                self.plugins.mark_broken(name, f"{type(e).__name__}: {e}")

    @property
    def broken(self) -> list[BrokenPlugin]:
        return list(self.plugins.broken)

    @contextlib.contextmanager
    def _all_or_nothing(self) -> Iterator[None]:
        """The registry as it was before, if the body fails."""
        saved = dict(self._classes), dict(self._owners), dict(self._producers), self.architectures
        try:
            yield
        except BaseException:
            self._classes, self._owners, self._producers, self.architectures = saved
            raise

    def _collect(self, plugin_name: str) -> None:
        """Add one plugin's producers and consumers, all or none (a failing one is skipped)."""
        with self._all_or_nothing():
            for classes in self._call(self.pm.hook.tllm_producers, plugin_name):
                self._add_producers(classes)
            for classes in self._call(self.pm.hook.tllm_consumers, plugin_name):
                self._add(classes, plugin_name)
            specs = self._call(self.pm.hook.tllm_architectures, plugin_name)
            if specs:
                merged = copy.deepcopy(self.architectures)
                for spec in (s for group in specs for s in group):
                    merged.add(spec, f"plugin {plugin_name!r}")
                self.architectures = merged

    @staticmethod
    def _call(hook: Any, plugin_name: str) -> list[Any]:
        """What one plugin's implementations of ``hook`` return (None left out)."""
        results = (i.function() for i in hook.get_hookimpls() if i.plugin_name == plugin_name)
        return [r for r in results if r is not None]

    def _add(self, classes: Iterable[type], plugin: str = "") -> None:
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, Consumer)) or not cls.name:
                raise TypeError(f"plugin returned {cls!r}: expected a named Consumer subclass")
            if not re.fullmatch(r"[\w.-]+", cls.name):  # specs split at ':', tllm_consumers at ','
                raise ValueError(f"consumer {cls.name!r}: name it with letters, digits, _ . -")
            if cls.name in self._classes and self._classes[cls.name] is not cls:
                raise ValueError(self._clash(cls, plugin))
            req = cls.Request
            if req is not None and not (isinstance(req, type) and issubclass(req, RequestSettings)):
                raise TypeError(
                    f"consumer {cls.name!r}: Request must be a RequestSettings subclass or None, "
                    f"got {req!r}"
                )
            taken = self.request_keys
            for key, fname in request_keys(cls.name, req).items():
                owner = taken.get(key)
                if key in GENERIC_KEYS or (owner is not None and owner[0] != cls.name):
                    by = f"consumer {owner[0]!r}" if owner else "tllm itself"
                    raise ValueError(
                        f"consumer {cls.name!r}: request key {key!r} (field {fname!r}) is "
                        f"already used by {by}; rename the field"
                    )
            self._classes[cls.name] = cls
            self._owners[cls.name] = plugin

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin at run time (tests, notebooks); an error leaves the registry as it was."""
        registered = self.plugins.register(plugin, name)
        try:
            self._collect(registered)
        except BaseException:
            self.pm.unregister(name=registered)
            raise

    @property
    def request_keys(self) -> dict[str, tuple[str, str]]:
        """Every consumer-declared request key -> (consumer name, field name)."""
        return {
            key: (name, fname)
            for name, cls in self._classes.items()
            for key, fname in request_keys(name, cls.Request).items()
        }

    def _add_producers(self, classes: Iterable[type]) -> None:
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

    def producer_for(self, port: ReadPort) -> Producer:
        """The producer serving ``port``'s type (or its nearest registered base type)."""
        for t in type(port).__mro__:
            if t in self._producers:
                return self._producers[t]
        raise ValueError(
            f"no producer serves port {type(port).__name__}; served: "
            f"{', '.join(sorted(t.__name__ for t in self._producers)) or '(none)'}"
        )

    def parse_port(self, text: str, phase: Phase = Phase.ALL) -> TokenPort:
        """A token port from its name (:mod:`tllm_core.api.port_names`), any layer port's prefix."""
        prefixes = {
            t.prefix: t
            for t in self._producers
            if isinstance(t, type) and issubclass(t, LayerPort) and hasattr(t, "prefix")
        }
        name = parse_port_name(text, prefixes)
        if name.is_final:
            return HiddenStates(FINAL, phase)
        if name.is_residual:
            return HiddenStates(int(name.layer), phase)  # type: ignore[arg-type]
        return prefixes[name.prefix](int(name.layer), phase)  # type: ignore[arg-type, call-arg]

    def _clash(self, cls: type[Consumer], plugin: str) -> str:
        """Why ``cls`` cannot be registered: its name is another class's."""
        old, owner = self._classes[cls.name], self._owners.get(cls.name, "")

        def where(c: type) -> str:
            return f"{c.__module__}.{c.__qualname__}"

        if owner and owner == plugin:
            return (
                f"plugin {plugin!r} registers two consumers named {cls.name!r}: {where(old)} "
                f"and {where(cls)}"
            )
        by = f"plugin {owner!r}" if owner else "a consumer registered at run time"
        return f"consumer name {cls.name!r} is taken by {by} ({where(old)}); {where(cls)} needs another name"

    def use(self, cls: type[Consumer]) -> None:
        """Serve consumer ``cls.name`` by ``cls``, replacing one of that name (the test kit)."""
        with self._all_or_nothing():
            self._classes.pop(getattr(cls, "name", ""), None)
            self._add([cls])

    @property
    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> type[Consumer]:
        """The consumer class named ``name`` (else a ConsumerSpecError naming those known)."""
        try:
            return self._classes[name]
        except KeyError:
            skipped = "".join(f"; skipped: {b.message()}" for b in self.plugins.broken)
            near = difflib.get_close_matches(str(name), self.names, n=1)
            mean = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConsumerSpecError(
                f"unknown consumer {name!r}{mean}; available: "
                f"{', '.join(self.names) or '(none)'}{skipped}"
            ) from None

    def validate(self, spec: ConsumerSpec) -> ConsumerConfig:
        """Build the consumer's config model; errors name the consumer and the field."""
        cls = self.get(spec.name)
        try:
            return cls.Config.model_validate(spec.config, context={"consumer": spec.name})
        except ValidationError as e:
            fields = cls.Config.model_fields
            named = {f.alias: n for n, f in fields.items() if f.alias}  # given by its alias
            bad = {named.get(str(x["loc"][0]), str(x["loc"][0])) for x in e.errors() if x["loc"]}
            # Each bad field's bounds and words (what 0 or None means there), as listed.
            hint = "".join(
                f"\n    {n}: {allowed(f)}; {f.description or ''}"
                for n, f in fields.items()
                if n in bad
            )
            hint = f"\n  allowed:{hint}" if hint else ""
            if unknown := sorted(bad - set(fields)):
                hint += f"\n  unknown field(s) {', '.join(map(repr, unknown))}; consumer "
                hint += f"{spec.name!r} takes: {', '.join(fields) or '(no fields)'}"
            said = "".join(
                f"\n  {'.'.join(map(str, x['loc'])) or '(config)'}: {short_text(message(x))}"
                + ("" if x["type"] == "missing" else f", got {short_repr(x.get('input'))}")
                for x in e.errors()
            )
            raise ConsumerSpecError(
                f"invalid config for consumer {spec.name!r}:{said}{hint}"
            ) from None

    def check(self, specs: Iterable[ConsumerSpec]) -> list[ConsumerConfig]:
        """Names, configs and uniqueness of ``specs``: their config models, in order."""
        configs, seen = [], set()
        for spec in specs:
            configs.append(self.validate(spec))
            if spec.name in seen:
                raise ConsumerSpecError(f"consumer {spec.name!r} is given twice; give it once")
            seen.add(spec.name)
        return configs

    def describe(self) -> list[dict[str, Any]]:
        """Every consumer's name, description, config fields and request keys; broken plugins too."""
        out = []
        for name in self.names:
            cls = self._classes[name]
            fields = [
                {
                    "name": fname,
                    "type": type_name(f.annotation),
                    **describe_field(f),
                    "required": f.is_required(),
                }
                for fname, f in cls.Config.model_fields.items()
            ]
            keys = describe_request_keys(name, cls.Request)
            for d in (*fields, *keys):
                d["default"] = _jsonable(d["default"])
            out.append(
                {
                    "name": name,
                    "broken": False,
                    "description": cls.description,
                    "module": cls.__module__,
                    "fields": fields,
                    "request_keys": keys,
                    "returns_results": cls.makes_results(),  # can a request ask tllm_results
                }
            )
        out += [
            {
                "name": b.name,
                "broken": True,
                "error": b.message(),
                "description": f"BROKEN plugin, skipped: {b.error}",
                "module": b.source,
                "fields": [],
                "request_keys": [],
            }
            for b in self.plugins.broken
        ]
        return out


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)
