"""The few lines a person reads after a run: what each consumer did, then what went wrong."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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


def count_text(v: Any) -> str:
    """A counter's value as shown: a float to 6 significant digits."""
    return f"{v:g}" if isinstance(v, float) else str(v)


def proof_counter(counters: dict[str, Any], declared: str = "") -> tuple[str, Any] | None:
    """The counter its class names (``Consumer.proof_counter``), else the first non-zero one."""
    if declared:
        return declared, counters.get(declared, 0)
    return next(((k, v) for k, v in counters.items() if v and not k.startswith("memory")), None)


def rate_line(tokens: int, seconds: float) -> str:
    """``N tokens in S s (R tok/s)``."""
    rate = tokens / seconds if seconds > 0 else 0.0
    return f"{tokens} tokens in {seconds:.1f} s ({rate:.1f} tok/s)"


def run_line(
    tokens: int, seconds: float, consumers: dict[str, dict[str, Any]], proofs: dict[str, str]
) -> str:
    """``N tokens in S s (R tok/s); esamp rows_guided=..., stats bundles=...``."""
    parts = []
    for name, counters in consumers.items():
        found = proof_counter(counters, proofs.get(name, ""))
        parts.append(f"{name} {found[0]}={found[1]:g}" if found else f"{name}: no work")
    return rate_line(tokens, seconds) + ("; " + ", ".join(parts) if parts else "")


def call_consumer(cls: type | None, method: str, name: str, counters: Any, result: Any) -> list:
    """``cls.method(counters, result)`` as a list; a failing one is logged and returns none."""
    fn = getattr(cls, method, None)
    if fn is None:
        return []
    try:
        return list(fn(counters, result) or [])
    except Exception as e:  # noqa: BLE001
        log.warning("tllm: %s.%s failed: %s: %s", name, method, type(e).__name__, e)
        return []


def error_text(error: Any) -> str:
    """A consumer error of a report as one line (the one that switched it off says so)."""
    if not isinstance(error, dict):  # a report file may be anyone's
        return str(error)
    text = str(error.get("error", error))
    said = error.get("disabled") and "switched off" not in text  # the watchdog's says so
    return text + (" (switched off for the rest of the run)" if said else "")


def text_so_far(partial: Any, i: int, j: int) -> str:
    """Sample ``j`` of prompt ``i`` in a run's ``partial_outputs`` (the text it had when cut
    short), or "" (none, or not a list of lists of texts: a report file may be anyone's)."""
    try:
        text = partial[i][j]
    except (TypeError, IndexError, KeyError):
        return ""
    return text if isinstance(text, str) else ""


def runtime_warnings(
    runtime: dict[str, Any], names: list[str], errors: list[dict[str, Any]] = ()
) -> list[str]:
    """Warnings from the runtime's counters (docs/counters.md); ``errors`` (the report's) name
    the consumers switched off."""
    out = []
    off = sorted(
        {str(e.get("consumer")) for e in errors if isinstance(e, dict) and e.get("disabled")}
    )
    for name in names:
        for key, what in (
            ("consumer_errors", "callback error(s) (see the errors above)"),
            ("bundles_dropped", "bundle(s) dropped (its queue was full)"),
        ):
            if runtime.get(f"{key}.{name}", 0):
                out.append(f"consumer {name!r}: {runtime[f'{key}.{name}']} {what}")
        if runtime.get(f"callbacks_hung.{name}", 0):
            abandoned = runtime.get(f"bundles_abandoned.{name}", 0)
            out.append(
                f"consumer {name!r}: a callback passed its deadline (see the errors above)"
                + (f"; {abandoned} queued bundle(s) dropped" if abandoned else "")
            )
    for key, text in (
        (
            "consumers_disabled",
            "{} consumer(s) switched off after repeated failures"
            + (f": {', '.join(map(repr, off))}" if off else ""),
        ),
        (
            "steps_greedy",
            "{} step(s) sampled every row greedily (temperature 0): vLLM calls no guide then, "
            "so guiding consumers left those steps alone (sample with temperature > 0 to guide "
            "them)",
        ),
        (
            "rows_without_candidates",
            "{} sampling row(s) left with nothing to draw from after the guides (every logit "
            "-inf, or a NaN): vLLM drew an arbitrary token for each",
        ),
        ("stale_captures", "{} stale capture(s): those reads were not delivered"),
        ("flush_timeouts", "{} waits for a background consumer timed out (flush_timeouts)"),
        (
            "close_timeouts",
            "{} background consumer thread(s) did not stop in time (close_timeouts)",
        ),
    ):
        if runtime.get(key, 0):
            out.append(text.format(runtime[key]))
    return out


def summarize(report: dict[str, Any], lookup: Lookup | None = None) -> Summary:
    """The summary of ``report`` (``TllmLLM.close()`` plus ``run``, or the ``--json`` object)."""
    if "consumers" not in report and "counters" in report:  # the --json form
        counters = dict(report["counters"])
        runtime = counters.pop("runtime", {})
        report = {**report, "runtime": runtime, "consumers": counters}
    lookup = lookup or registry_lookup()
    consumers: dict[str, dict[str, Any]] = report.get("consumers", {})
    run, runtime = report.get("run", {}), report.get("runtime", {})
    out = Summary(rate_line(run.get("tokens", 0), run.get("seconds", 0.0)))
    cut = run.get("summary", "")
    if run.get("interrupted") and cut.startswith(("interrupted", "the engine died")):
        out.head = f"{cut.split('; ', 1)[0]}; {out.head}"
    for name, counters in consumers.items():
        cls = lookup(name)
        result = report.get("results", {}).get(name)
        if isinstance(result, list) and "ranks" in report:  # data parallel: the first engine's
            result = next((r for r in result if r is not None), None)
        lines = [str(x) for x in call_consumer(cls, "summary", name, counters, result)]
        calls = runtime.get(f"consumer_calls.{name}", 0)
        if not lines:  # the proof counter, or that it did no work
            found = proof_counter(counters, getattr(cls, "proof_counter", ""))
            if found is not None:
                lines = [f"{name}: {found[0]} {count_text(found[1])}"]
            elif calls:
                lines = [f"{name}: called {calls} time(s), no result"]
            else:
                lines = [f"{name}: no work"]
        elif not lines[0].startswith(f"{name}:"):
            lines = [f"{name}: {lines[0]}", *lines[1:]]
        out.lines += lines
        if proof_counter(counters) is None:  # called and produced nothing, or never called
            if calls:
                idle = f"was called {count_text(calls)} time(s) but produced no result"
            elif any(k.startswith("consumer_calls.") for k in runtime):
                idle = "was never called"
            else:
                idle = "did no work"  # an older report
            out.warnings.append(f"consumer {name!r} {idle} (all its counters are zero)")
        warnings = call_consumer(cls, "summary_warnings", name, counters, result)
        out.warnings += [f"{name}: {w}" for w in warnings]
    out.warnings += runtime_warnings(runtime, list(consumers), report.get("errors") or [])
    return out
