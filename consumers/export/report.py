"""What a person reads and sees of an export: the summary line, "not complete" and the
report's per-layer norm plots, read back from the export itself
(``ExportConsumer.summary`` / ``summary_warnings`` / ``report_plots``)."""

from __future__ import annotations

import itertools
import math
from typing import Any

from tllm_core import Plot, Series

# Records read back for the plots: enough for the shape of the norms, bounded for a large
# export.
MAX_RECORDS = 256


def summary(counters: dict[str, Any], result: Any) -> list[str]:
    out = result.get("out", "?") if isinstance(result, dict) else "?"
    return [
        f"export: {counters.get('rows_exported', 0)} rows, "
        f"{counters.get('bytes_written', 0) / 1e6:.1f} MB in "
        f"{counters.get('shards_written', 0)} shard(s) written to {out}"
    ]


def warnings(counters: dict[str, Any], result: Any) -> list[str]:
    # Requests cut short make an export incomplete; rows lost to dropped bundles are the
    # runtime's own warning. (An open export, e.g. a server's before shutdown, is not
    # complete yet either: that is no warning.)
    if isinstance(result, dict) and result.get("error"):
        return [f"not complete: {result['error']} (the manifest says complete: false)"]
    cut = counters.get("requests_cut_short", 0)
    if cut and isinstance(result, dict) and result.get("complete") is False:
        return [
            f"not complete ({cut} request(s) cut short; "
            "see 'losses' and each request's 'finished' in the manifest)"
        ]
    return []


def _layer_order(key: str) -> tuple[int, float, str]:
    """``layer.3`` < ``layer.10`` < ``attn.*`` ... < ``final``."""
    kind, _, index = key.partition(".")
    try:
        i = float(index)
    except ValueError:
        i = math.inf
    return (2 if key == "final" else 1 if kind != "layer" else 0, i, key)


def norms(path: str) -> tuple[dict[str, list[float]], dict[str, dict[int, list[float]]]]:
    """Per key, the L2 norms of the rows (first :data:`MAX_RECORDS` records), and by position."""
    from consumers.export import read_export

    per_key: dict[str, list[float]] = {}
    by_pos: dict[str, dict[int, list[float]]] = {}
    for rec in itertools.islice(read_export(path), MAX_RECORDS):
        for key, h in rec.hidden.items():
            n = h.float().norm(dim=-1).tolist()
            per_key.setdefault(key, []).extend(n)
            acc = by_pos.setdefault(key, {})
            for p, v in zip(rec.positions.tolist(), n, strict=False):
                acc.setdefault(int(p), []).append(v)
    return per_key, by_pos


def plots(counters: dict[str, Any], result: Any) -> list[Plot]:
    if not isinstance(result, dict) or not result.get("out") or not result.get("rows"):
        return []
    per_key, by_pos = norms(result["out"])
    keys = sorted(per_key, key=_layer_order)
    if not keys:
        return []
    mean = [sum(per_key[k]) / len(per_key[k]) for k in keys]
    out = [
        Plot(
            name="norms",
            title="Exported hidden states: mean L2 norm per layer",
            xlabel="port",
            ylabel="mean ‖h‖₂ over rows",
            kind="bar",
            series=(Series("mean norm", keys, mean),),
            caption=f"from the export's first {MAX_RECORDS} records at most",
        )
    ]
    series = []
    for k in keys:
        pos = sorted(by_pos[k])
        series.append(Series(k, pos, [sum(by_pos[k][p]) / len(by_pos[k][p]) for p in pos]))
    out.append(
        Plot(
            name="norms_by_position",
            title="Exported hidden states: mean L2 norm by position",
            xlabel="token position",
            ylabel="mean ‖h‖₂",
            series=tuple(series),
            log_y=True,
        )
    )
    return out
