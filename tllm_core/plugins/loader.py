"""Loading the ``tllm`` entry points into a pluggy manager (docs/hooks.md): a broken plugin is
named once and skipped; ``TLLM_PLUGINS`` (an allow-list) limits the third-party ones."""

from __future__ import annotations

import importlib.metadata
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pluggy

from tllm_core.api import hookspecs

# Built-ins register through this group and the same hooks as third-party plugins.
ENTRY_POINT_GROUP = "tllm"
ALLOW_ENV = "TLLM_PLUGINS"
# The built-ins' distribution: never filtered by the allow-list (consumers need its producers).
OWN_DISTRIBUTION = "tllm"


class TllmPluginWarning(UserWarning):
    """A ``tllm`` plugin is broken and was skipped."""


@dataclass(frozen=True)
class BrokenPlugin:
    """A plugin that was skipped: its entry-point name, what it points at, and why."""

    name: str
    source: str  # the entry point's value, or the plugin object's repr
    error: str
    distribution: str | None = None

    def message(self) -> str:
        dist = self.distribution
        where = self.source + (f", from the installed distribution {dist!r}" if dist else "")
        fix = f"Fix or uninstall it (pip uninstall {dist})" if dist else "Fix it"
        return (
            f"tllm plugin {self.name!r} ({where}) is broken and was skipped: {self.error}. "
            f"{fix}, or leave it out of {ALLOW_ENV}."
        )


def allowed_plugins(environ: Mapping[str, str] | None = None) -> frozenset[str] | None:
    """The entry-point names ``TLLM_PLUGINS`` allows (comma-separated); None when unset (all)."""
    raw = (os.environ if environ is None else environ).get(ALLOW_ENV)
    return None if raw is None else frozenset(n.strip() for n in raw.split(",") if n.strip())


def warn(broken: BrokenPlugin) -> None:
    """The default report of a broken plugin: a Python warning (shown once per process)."""
    warnings.warn(broken.message(), TllmPluginWarning, stacklevel=2)


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("tllm")
    pm.add_hookspecs(hookspecs)
    return pm


@dataclass
class Plugins:
    """A plugin manager with the ``tllm`` hook specs, and the plugins found broken in it."""

    pm: pluggy.PluginManager = field(default_factory=_new_manager)
    broken: list[BrokenPlugin] = field(default_factory=list)
    on_broken: Callable[[BrokenPlugin], None] = warn
    # entry-point name -> distribution, for messages about failures after loading
    _dists: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(
        cls,
        load_entry_points: bool = True,
        on_broken: Callable[[BrokenPlugin], None] = warn,
        environ: Mapping[str, str] | None = None,
    ) -> Plugins:
        """Every ``tllm`` entry point the allow-list lets through, each registered and checked."""
        out, allowed = cls(on_broken=on_broken), allowed_plugins(environ)
        builtin: set[str] = set()  # tllm's own entry points: first, and no one else's name
        for own, dist_name, eps in _tllm_entry_points() if load_entry_points else []:
            for ep in eps:
                if not own and ep.name in builtin:
                    why = f"its entry point name {ep.name!r} is a built-in's; it must use another"
                    out._skip(f"{ep.name} ({dist_name})", ep.value, why)
                    continue
                if own:
                    builtin.add(ep.name)
                if out.pm.has_plugin(ep.name) or any(b.name == ep.name for b in out.broken):
                    continue  # a distribution seen twice on sys.path registers (or fails) once
                if not own and allowed is not None and ep.name not in allowed:
                    continue
                out._dists[ep.name] = dist_name
                try:
                    plugin = ep.load()
                except Exception as e:  # noqa: BLE001 - any import failure skips the plugin
                    out._skip(ep.name, ep.value, f"import failed: {type(e).__name__}: {e}")
                    continue
                try:
                    out.register(plugin, ep.name)
                except Exception as e:  # noqa: BLE001 - e.g. a misspelled hook
                    out._skip(ep.name, ep.value, f"{type(e).__name__}: {e}")
        return out

    def register(self, plugin: object, name: str | None = None) -> str:
        """Register ``plugin``; a misspelled hook raises ``PluginValidationError`` (unregistered)."""
        registered = self.pm.register(plugin, name=name)
        if registered is None:
            raise ValueError(f"plugin {name or plugin!r} is blocked")
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError:
            self.pm.unregister(name=registered)
            raise
        return registered

    def mark_broken(self, name: str, error: str) -> None:
        """Unregister a registered plugin whose hooks failed, and name it."""
        plugin = self.pm.unregister(name=name)
        self._skip(name, getattr(plugin, "__name__", None) or repr(plugin), error)

    def _skip(self, name: str, source: str, error: str) -> None:
        broken = BrokenPlugin(name, source, error, self._dists.get(name))
        self.broken.append(broken)
        self.on_broken(broken)

    @property
    def loaded(self) -> list[str]:
        return [n for n, _ in self.pm.list_name_plugin()]


def _tllm_entry_points() -> list[tuple[bool, str, list[importlib.metadata.EntryPoint]]]:
    """``(tllm's own, distribution name, its tllm entry points)``, tllm's own first; only
    distributions with such entry points have their metadata read (slow: hundreds of them)."""
    found = []
    for dist in importlib.metadata.distributions():
        eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        if eps:
            name = dist.metadata["name"] or "?"
            own = re.sub(r"[-_.]+", "-", name).lower() == OWN_DISTRIBUTION
            found.append((own, name, eps))
    return sorted(found, key=lambda f: not f[0])
