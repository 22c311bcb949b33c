"""The few lines a person reads after a run: what each consumer did, then what went wrong.

Each consumer words its own lines (``Consumer.summary`` / ``Consumer.summary_warnings``,
class methods that read the counters and result the engine returned); a consumer that
words none gets one line with its proof counter. The runtime's own warnings (a consumer
failing or switched off, bundles dropped, stale captures, timeouts) are added here, from
the runtime counters. Nothing else: the full counter table is ``--counters``, and
``--json`` is unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tllm_core.app.progress import proof_counter

log = logging.getLogger("tllm")

# Consumer name -> its class (None: not installed here, e.g. a report read elsewhere).
Lookup = Callable[[str], "type | None"]


@dataclass
class Summary:
    """``head``: tokens and speed; ``lines``: per consumer; ``warnings``: what went wrong."""

    head: str
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def text(self) -> list[str]:
        return [self.head, *self.lines, *(f"warning: {w}" for w in self.warnings)]


def registry_lookup() -> Lookup:
    """Consumer classes from the installed plugins (a fresh ``Registry``)."""
    from tllm_core.plugins.registry import Registry

    registry = Registry()

    def lookup(name: str) -> type | None:
        try:
            return registry.get(name)
        except (KeyError, ValueError):
            return None

    return lookup


def _count(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def generic_line(name: str, counters: dict[str, Any], declared: str = "") -> str:
    """``name: <proof counter> <value>``, or that it did no work."""
    found = proof_counter(counters, declared)
    if found is None:
        return f"{name}: no work"
    return f"{name}: {found[0]} {_count(found[1])}"


def _result_of(report: dict[str, Any], name: str) -> Any:
    res = report.get("results", {}).get(name)
    # Data parallel: one result per engine; the summary reads the first engine's.
    if isinstance(res, list) and "ranks" in report:
        res = next((r for r in res if r is not None), None)
    return res


def _call(cls: type, method: str, name: str, counters: dict[str, Any], result: Any) -> list[str]:
    """A consumer's own lines; a failing method is logged and reads as none (the run is
    done: its summary must not fail it)."""
    fn = getattr(cls, method, None)
    if fn is None:
        return []
    try:
        return [str(x) for x in fn(counters, result) or []]
    except Exception as e:  # noqa: BLE001 - a plugin's wording must not fail the command
        log.warning("tllm: %s.%s failed: %s: %s", name, method, type(e).__name__, e)
        return []


def runtime_warnings(runtime: dict[str, Any], names: list[str]) -> list[str]:
    """Warnings from the runtime's counters (docs/counters.md)."""
    out = []
    for name in names:
        errors = runtime.get(f"consumer_errors.{name}", 0)
        if errors:
            out.append(f"consumer {name!r}: {errors} callback error(s) (see the errors above)")
        dropped = runtime.get(f"bundles_dropped.{name}", 0)
        if dropped:
            out.append(f"consumer {name!r}: {dropped} bundle(s) dropped (its queue was full)")
    if runtime.get("consumers_disabled", 0):
        out.append(
            f"{runtime['consumers_disabled']} consumer(s) switched off after repeated failures"
        )
    if runtime.get("steps_greedy", 0):
        out.append(
            f"{runtime['steps_greedy']} step(s) sampled every row greedily (temperature 0): vLLM "
            "calls no guide then, so guiding consumers left those steps alone (sample with "
            "temperature > 0 to guide them)"
        )
    if runtime.get("stale_captures", 0):
        out.append(f"{runtime['stale_captures']} stale capture(s): those reads were not delivered")
    for key, what in (
        ("flush_timeouts", "waits for a background consumer timed out"),
        ("close_timeouts", "background consumer thread(s) did not stop in time"),
    ):
        if runtime.get(key, 0):
            out.append(f"{runtime[key]} {what} ({key})")
    return out


def _head(run: dict[str, Any]) -> str:
    tokens, seconds = run.get("tokens", 0), run.get("seconds", 0.0)
    rate = tokens / seconds if seconds else 0.0
    head = f"{tokens} tokens in {seconds:.1f} s ({rate:.1f} tok/s)"
    text = run.get("summary", "")
    if run.get("interrupted") and text.startswith("interrupted"):
        head = f"{text.split('; ', 1)[0]}; {head}"
    return head


def summarize(report: dict[str, Any], lookup: Lookup | None = None) -> Summary:
    """The summary of ``report`` (``TllmLLM.close()`` plus the command's ``run``, or the
    ``--json`` object, whose ``counters`` hold ``runtime`` and the consumers)."""
    if "consumers" not in report and "counters" in report:  # the --json form
        counters = dict(report["counters"])
        runtime = counters.pop("runtime", {})
        report = {**report, "runtime": runtime, "consumers": counters}
    lookup = lookup or registry_lookup()
    consumers: dict[str, dict[str, Any]] = report.get("consumers", {})
    out = Summary(_head(report.get("run", {})))
    for name, counters in consumers.items():
        cls = lookup(name)
        result = _result_of(report, name)
        lines = _call(cls, "summary", name, counters, result) if cls is not None else []
        if not lines:
            lines = [generic_line(name, counters, getattr(cls, "proof_counter", ""))]
        elif not lines[0].startswith(f"{name}:"):
            lines = [f"{name}: {lines[0]}", *lines[1:]]
        out.lines += lines
        if proof_counter(counters) is None:
            out.warnings.append(f"consumer {name!r} did no work (all its counters are zero)")
        if cls is not None:
            out.warnings += [
                f"{name}: {w}" for w in _call(cls, "summary_warnings", name, counters, result)
            ]
    out.warnings += runtime_warnings(report.get("runtime", {}), list(consumers))
    return out
