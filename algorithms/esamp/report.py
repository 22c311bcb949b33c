"""What a person reads of an ESamp run: summary lines, warnings and the report's plots."""

from __future__ import annotations

from typing import Any

from tllm_core import Plot, Series


def _n(counters: dict[str, Any], key: str) -> int:
    return int(counters.get(key, 0) or 0)


def _f(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) else "n/a"


def sampled_rows(counters: dict[str, Any]) -> int:
    """Sampler rows ESamp saw: visited (predicted for) plus skipped (every reason)."""
    return _n(counters, "rows_visited") + _n(counters, "rows_skipped")


def summary(counters: dict[str, Any], result: Any) -> list[str]:
    seen, guided = sampled_rows(counters), _n(counters, "rows_guided")
    share = f" ({100 * guided / seen:.0f}%)" if seen else ""
    lines = [f"esamp: guided {guided} of {seen} sampled rows{share}"]
    if not (steps := _n(counters, "optimizer_steps")):
        lines.append("esamp: the distiller did not train (0 optimizer steps)")
        return lines
    rows = _n(counters, "rows_trained")
    train = f"esamp: distiller trained {steps} optimizer steps on {rows} rows"
    loss = f"loss {_f(counters.get('loss_first'))} → {_f(counters.get('loss_last'))}"
    groups = _n(counters, "groups_created")
    if groups > 1 and isinstance(result, dict):
        first, last = result.get("group_loss_first_mean"), result.get("group_loss_last_mean")
        if first is not None and last is not None:
            loss = f"loss {_f(first)} → {_f(last)} (mean over {groups} groups)"
    lines.append(f"{train}, {loss}")
    return lines


def warnings(counters: dict[str, Any], result: Any) -> list[str]:
    out = []
    if cap := _n(counters, "candidates_over_cap"):
        out.append(
            f"{cap} candidate logits past cuda_max_candidates were dropped "
            "(a top-k filter; raise cuda_max_candidates for wide top-p)"
        )
    guide_cap, train_cap = _n(counters, "rows_skipped_cap"), _n(counters, "train_rows_skipped_cap")
    if guide_cap or train_cap:
        out.append(
            f"{guide_cap} rows not guided and {train_cap} not trained: their group had no "
            "distiller (max_groups or cuda_capacity reached)"
        )
    if bad := _n(counters, "nonfinite_losses_skipped"):
        out.append(f"{bad} non-finite losses skipped (those updates were not applied)")
    if failures := _n(counters, "graph_failures"):
        out.append(f"{failures} CUDA graph failures (updates ran eagerly)")
    return out


def _curve(points: Any, col: int = 1) -> tuple[list[float], list[float]]:
    rows = [p for p in points or [] if isinstance(p, (list, tuple)) and len(p) > col]
    return [float(p[0]) for p in rows], [float(p[col]) for p in rows]


def _by_step(name: str, title: str, ylabel: str, *series: Series, **kw: Any) -> Plot:
    """A line plot over a group's optimizer steps."""
    return Plot(name, title, "optimizer step within a group", ylabel, series, **kw)


def plots(counters: dict[str, Any], result: Any) -> list[Plot]:
    res = result if isinstance(result, dict) else {}
    out = []
    x, y = _curve(res.get("loss_curve"))
    if x:
        groups = res["loss_curve"][0][2] if len(res["loss_curve"][0]) > 2 else None
        caption = (
            "the loss at each of a group's optimizer steps, averaged over the groups that "
            "reached it"
            + (f" ({groups} group(s) at step 0)" if groups else "")
            + "; falling: the distiller learns the familiar continuation"
        )
        title = "ESamp distiller loss by optimizer step"
        series = Series("mean over groups", x, y)
        out.append(_by_step("loss", title, "distiller loss (MSE)", series, caption=caption))
    guided, visited = _n(counters, "rows_guided"), _n(counters, "rows_visited")
    reasons = ("prefill", "greedy", "cap", "mixed")
    labels = ["guided", "visited, unchanged", *(f"skipped: {r}" for r in reasons)]
    skipped = [_n(counters, f"rows_skipped_{r}") for r in reasons]
    if visited or _n(counters, "rows_skipped"):
        series = (Series("rows", labels, [guided, max(visited - guided, 0), *skipped]),)
        caption = (
            f"{guided} of {sampled_rows(counters)} sampled rows guided; the first token of "
            "each sample (a prefill row) is never guided"
        )
        title = "ESamp sampler rows: guided share"
        out.append(Plot("rows", title, "", "rows", series, kind="bar", caption=caption))
    x, y = _curve((res.get("diagnostics") or {}).get("rel_err_curve"))
    if x:
        title, series = "ESamp prediction error by step", Series("mean relative error", x, y)
        out.append(_by_step("rel_err", title, "‖h_L − f(h_1)‖ / ‖h_L‖", series))
    if curve := res.get("optimizer_curve"):
        x, size = _curve(curve, 3)
        _, norm = _curve(curve, 4)
        title = "ESamp optimizer: update size and gradient norm"
        sizes, norms = Series("update size |Δθ|/lr", x, size), Series("gradient norm", x, norm)
        out.append(_by_step("optimizer", title, "value (log)", sizes, norms, log_y=True))
    return out
