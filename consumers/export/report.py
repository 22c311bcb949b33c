"""An export's summary line, "not complete" warning and report plots (read back from it)."""

from __future__ import annotations

import itertools
import math
from typing import Any

from tllm_core import Plot, Series

# Records read back for the plots: enough for the shape of the norms, bounded.
MAX_RECORDS = 256


def summary(counters: dict[str, Any], result: Any) -> list[str]:
    out = result.get("out", "?") if isinstance(result, dict) else "?"
    return [
        f"export: {counters.get('rows_exported', 0)} rows, "
        f"{counters.get('bytes_written', 0) / 1e6:.1f} MB in "
        f"{counters.get('shards_written', 0)} shard(s) written to {out}"
    ]


def warnings(counters: dict[str, Any], result: Any) -> list[str]:
    # Rows lost to dropped bundles are the runtime's own warning; an open export is no warning.
    if isinstance(result, dict) and result.get("error"):
        where = (
            "the manifest says complete: false"
            if result.get("manifest", True)
            else "no manifest: nothing in the folder is an export"
        )
        return [f"not complete: {result['error']} ({where})"]
    cut = counters.get("requests_cut_short", 0)
    if cut and isinstance(result, dict) and result.get("complete") is False:
        return [
            f"not complete ({cut} request(s) cut short; "
            "see 'losses' and each request's 'finished' in the manifest)"
        ]
    return []


def layer_order(key: str) -> tuple[int, float, str]:
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
    keys = sorted(per_key, key=layer_order)
    if not keys:
        return []
    mean = [sum(per_key[k]) / len(per_key[k]) for k in keys]
    series = [
        Series(k, sorted(by_pos[k]), [sum(v) / len(v) for _, v in sorted(by_pos[k].items())])
        for k in keys
    ]
    return [
        Plot(
            name="norms",
            title="Exported hidden states: mean L2 norm per layer",
            xlabel="port",
            ylabel="mean ‖h‖₂ over rows",
            kind="bar",
            series=(Series("mean norm", keys, mean),),
            caption=f"from the export's first {MAX_RECORDS} records at most",
        ),
        Plot(
            name="norms_by_position",
            title="Exported hidden states: mean L2 norm by position",
            xlabel="token position",
            ylabel="mean ‖h‖₂",
            series=tuple(series),
            log_y=True,
        ),
    ]
