"""The request keys of tllm (docs/serving.md) and their validation, in the server (HTTP 400)
and in ``TllmLLM`` (``ValueError``) alike."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from tllm_core.api.consumer_spec import ConsumerSpec
from tllm_core.api.request_settings import (
    CONSUMERS_KEY,
    GROUP_KEY,
    PREFIX,
    TAGS,
    RequestSettings,
    acts_on,
    describe_request_keys,
    enabled_consumers,
    parse_request_settings,
    short_repr,
)
from tllm_core.api.results import RESULTS_KEY, PlannedRequest, asked_results
from tllm_core.runtime.settings import RuntimeSettings

if TYPE_CHECKING:
    from tllm_core.plugins.registry import Registry

# Longest values, checked before parsing (a 32 MiB list of names would hold the event loop);
# tllm's own keys are shorter: names are split again per consumer, groups kept per live group.
MAX_VALUE_CHARS = 65536
MAX_CHARS = MappingProxyType({CONSUMERS_KEY: 1024, GROUP_KEY: 1024, RESULTS_KEY: 1024})

KEYS: Mapping[str, str] = MappingProxyType(
    {
        CONSUMERS_KEY: "string: comma-separated names of per-request consumers to switch on for "
        "this request (each must be configured)",
        GROUP_KEY: "string: requests sharing this value form one group (consumers that keep state "
        "per group, e.g. ESamp's distiller; default: the n samples of one request; in a server, "
        "only requests of the same client, i.e. API key, share a group)",
        RESULTS_KEY: "string: comma-separated names of consumers whose per-request result is "
        "returned with this request's completion (each must make results and act on the "
        "request; docs/serving.md#results-with-the-completion)",
    }
)


@dataclass
class EngineConsumers:
    """The consumers an engine (offline or a server) was started with, and every request key."""

    per_request: dict[str, bool] = field(default_factory=dict)
    models: dict[str, type[RequestSettings] | None] = field(default_factory=dict)
    # consumer name -> its validated config (the context of its request-settings validators)
    configs: dict[str, Any] = field(default_factory=dict)
    # every registered consumer's request key -> (consumer name, field name)
    owners: dict[str, tuple[str, str]] = field(default_factory=dict)
    # consumers the engine reported failed (switched off until restart), learned from reports
    failed: set[str] = field(default_factory=set)
    # consumer name -> its class (control requests are checked by the class, in the front end)
    classes: dict[str, type] = field(default_factory=dict)
    # consumer name -> how many control requests changed its config (a server's prefix-cache
    # salts: a registered name may then stand for another vector)
    controls: dict[str, int] = field(default_factory=dict)

    def control_applied(self, name: str, config: Any) -> None:
        """The engine applied a control request to consumer ``name``: its config is now
        ``config`` (and requests with its keys get new prefix-cache salts)."""
        self.configs[name] = config
        self.controls[name] = self.controls.get(name, 0) + 1

    @classmethod
    def from_settings(
        cls, raw: dict[str, Any] | RuntimeSettings, registry: Registry | None = None
    ) -> EngineConsumers:
        """From runtime settings; checks consumer names and configs (``ConsumerSpecError``)."""
        from tllm_core.plugins.registry import Registry

        settings = raw if isinstance(raw, RuntimeSettings) else RuntimeSettings.model_validate(raw)
        registry = registry or Registry()
        return cls.of(settings.consumers, registry.check(settings.consumers), registry)

    @classmethod
    def of(
        cls, specs: Iterable[ConsumerSpec], configs: Iterable[Any], registry: Registry
    ) -> EngineConsumers:
        """From specs and their configs, already checked against ``registry``."""
        out = cls(owners=registry.request_keys)
        for spec, config in zip(specs, configs, strict=True):
            out.per_request[spec.name] = spec.per_request
            out.classes[spec.name] = registry.get(spec.name)
            out.models[spec.name] = out.classes[spec.name].Request
            out.configs[spec.name] = config
        return out

    def active(self, name: str, extra: dict[str, Any]) -> bool:
        """Whether consumer ``name`` acts on a request with these extra_args."""
        return name in self.per_request and acts_on(name, self.per_request[name], extra)

    def note_report(self, report: dict[str, Any]) -> None:
        """Learn from an engine report which consumers were switched off."""
        self.failed.update(
            e["consumer"]
            for e in report.get("errors", [])
            if e.get("consumer") in self.models and e.get("disabled", True)
        )

    def failed_named(self, extra: dict[str, Any]) -> list[str]:
        """Failed consumers that a request names in ``tllm_consumers``."""
        try:
            names = enabled_consumers(extra)
        except ValueError:
            return []  # the key check reports it
        return sorted(set(names) & self.failed)

    def keys(self) -> dict[str, str]:
        """Every key a request may carry on this engine, with its description."""
        out = dict(KEYS)
        for name, model in self.models.items():
            for k in describe_request_keys(name, model):
                out[k["key"]] = f"{k['allowed']}: {k['description']} (consumer {name!r})"
        return out

    def control_state(self) -> dict[str, Any]:
        """Each consumer's answer to a ``"list"`` control request (those that take one)."""
        from tllm_core.api.consumer import ControlError

        out = {}
        for name, cls in self.classes.items():
            try:
                _, out[name] = cls.check_control("list", {}, self.configs[name])
            except ControlError:
                continue
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "consumers": {
                n: {"per_request": p, "request_keys": describe_request_keys(n, self.models[n])}
                for n, p in self.per_request.items()
            },
            "keys": self.keys(),
        }


def validate_extra_args(
    extra: dict[str, Any] | None,
    engine: EngineConsumers,
    where: str = "vllm_xargs",
    tags: bool = False,
) -> None:
    """Check every ``tllm_*`` key of a request (``where``: the dict's name); ``tags``: the
    internal row tags (:data:`TAGS`) are allowed."""
    if not extra:
        return
    mine: dict[str, str] = {}  # consumer -> its first key in this request
    for key, value in extra.items():
        if not key.startswith(PREFIX):
            continue
        if tags and key in TAGS:  # the row tags TllmLLM sets, when its caller gives them
            low = 0 if key == "tllm_prompt_index" else 1
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**31:
                raise ValueError(
                    f"{where}[{key!r}] must be a whole number in [{low}, {2**31 - 1}], got "
                    f"{short_repr(value)}"
                )
            continue
        if key in engine.owners:
            mine.setdefault(engine.owners[key][0], key)
        elif key not in KEYS:
            known = sorted(
                [*KEYS, *(k for k, (c, _) in engine.owners.items() if c in engine.models)]
            )
            raise ValueError(
                f"unknown tllm key {where}[{short_repr(key)}]; known keys: {', '.join(known)}"
            )
        if not isinstance(value, (str, int, float)):
            raise ValueError(
                f"{where}[{key!r}] must be a flat string or number, got {short_repr(value)}"
            )
        most = MAX_CHARS.get(key, MAX_VALUE_CHARS)
        if isinstance(value, str) and (n := len(value)) > most:
            raise ValueError(f"{where}[{key!r}] has {n} characters; allowed: at most {most}")
    names = enabled_consumers(extra, where)
    optional = sorted(n for n, p in engine.per_request.items() if p)
    for n in names:
        if n not in engine.per_request:
            raise ValueError(
                f"unknown consumer {short_repr(n)} in {where}[{CONSUMERS_KEY!r}]; this engine's "
                f"per-request consumers: {optional or 'none'}"
            )
    group = extra.get(GROUP_KEY)
    if isinstance(group, str) and not group.strip():
        raise ValueError(f"{where}[{GROUP_KEY!r}] must not be empty")
    # tllm_results: configured consumers that make results and act on the request.
    makers = sorted(n for n, c in engine.classes.items() if c.makes_results())
    for name in asked_results(extra, where):
        if name not in makers:
            what = "is not configured" if name not in engine.per_request else "makes none"
            raise ValueError(
                f"{where}[{RESULTS_KEY!r}] names {short_repr(name)}, which {what}; consumers that "
                f"return per-request results here: {makers or 'none'}"
            )
        if not engine.active(name, extra):
            raise ValueError(
                f"{where}[{RESULTS_KEY!r}] names {name!r}, which is per-request and not switched "
                f'on for this request (add "{name}" to {where}[{CONSUMERS_KEY!r}])'
            )
    for name, key in mine.items():
        if name not in engine.per_request:
            raise ValueError(
                f"{where}[{key!r}] needs the {name!r} consumer, which this engine does not run "
                f"(configured: {sorted(engine.per_request) or 'none'})"
            )
        if not engine.active(name, extra):
            raise ValueError(
                f"{where}[{key!r}] has no effect: {name!r} is not active for this request "
                f'(add "{name}" to {where}[{CONSUMERS_KEY!r}])'
            )
        model = engine.models[name]
        assert model is not None  # it owns a key
        parse_request_settings(name, model, extra, where, config=engine.configs.get(name))


def result_bounds(request: PlannedRequest, engine: EngineConsumers) -> dict[str, int]:
    """The bound (JSON bytes) of each result a request asks for, where its consumer gives one."""
    out = {}
    for name in asked_results(request.extra_args):
        if name in engine.classes:
            bound = engine.classes[name].result_bytes(engine.configs[name], request)
            if bound is not None:
                out[name] = int(bound)
    return out


def request_salt(
    extra: dict[str, Any] | None,
    key: bytes | None = None,
    *,
    can_change_kv: bool = True,
    server: EngineConsumers | None = None,
) -> str | None:
    """The prefix-cache salt of a request whose tllm keys may change its KV (None: none); a
    server's secret ``key`` makes it an HMAC no client's own ``cache_salt`` can equal;
    ``server``: the control requests applied to the consumers acting on it count too (so a
    consumer acting on every request gives requests without keys a salt once controlled)."""
    items = sorted(
        (k, str(v))
        for k, v in (extra or {}).items()
        # Asking for results changes no computation: such requests share the cache.
        if k.startswith(PREFIX) and k not in TAGS and k != RESULTS_KEY
    )
    if server is not None:  # a control changed what these consumers do to this request
        acting = [n for n in sorted(server.controls) if server.active(n, extra or {})]
        items += [(f"{n}#controls", str(server.controls[n])) for n in acting]
    if not items or not can_change_kv:
        return None
    text = json.dumps(items).encode()
    if key is None:
        digest = hashlib.sha256(text).hexdigest()[:16]
    else:
        digest = hmac.new(key, text, hashlib.sha256).hexdigest()[:32]
    return f"tllm-{digest}"
