"""One report from the per-rank reports of a parallel engine (docs/scaling.md)."""

from __future__ import annotations

from typing import Any


def sum_counters(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Key-wise sum of numeric counters (a key missing in one part counts as 0)."""
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
            else:
                out.setdefault(k, v)
    return out


def _errors(report: dict[str, Any]) -> list[dict[str, Any]]:
    rank = report.get("rank")
    errors = list(report.get("errors", []))
    if rank is None:
        return errors
    where = {"tp_rank": rank.get("tp_rank", 0), "dp_rank": rank.get("dp_rank", 0)}
    return [{**e, **where} for e in errors]


def merge_reports(reports: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The engine's report from its workers' (None: a worker without tllm): the one leader's
    with every rank's errors, or several data-parallel leaders' counters summed (means and
    maxima too: read those per rank in ``ranks``) and ``results`` listed in rank order."""
    present = [r for r in reports if r is not None]
    if not present:
        raise RuntimeError("no worker of this engine returned a tllm report")
    leaders = [r for r in present if r.get("rank", {}).get("leader", True)]
    if not leaders:
        raise RuntimeError(
            f"no leader rank among the engine's tllm reports (ranks: "
            f"{[r.get('rank') for r in present]})"
        )
    leaders.sort(key=lambda r: r.get("rank", {}).get("dp_rank", 0))
    errors = [e for r in present for e in (_errors(r) if len(present) > 1 else r["errors"])]
    if len(leaders) == 1:
        return {**leaders[0], "errors": errors}
    names = list(dict.fromkeys(n for r in leaders for n in r["consumers"]))
    return {
        "runtime": sum_counters([r["runtime"] for r in leaders]),
        "consumers": {
            n: sum_counters([r["consumers"][n] for r in leaders if n in r["consumers"]])
            for n in names
        },
        "results": {n: [r["results"].get(n) for r in leaders] for n in names},
        "errors": errors,
        "ranks": [
            {"rank": r.get("rank"), "runtime": r["runtime"], "consumers": r["consumers"]}
            for r in leaders
        ],
    }
