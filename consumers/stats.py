"""``stats``: per-layer activation statistics per request — the smallest complete consumer."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pydantic import Field, field_validator

from consumers.export.report import layer_order
from tllm_core import (
    Bundle,
    CaptureWindow,
    Consumer,
    ConsumerConfig,
    PlannedRequest,
    Plot,
    RequestInfo,
    RequestSettings,
    Series,
    WindowSetting,
    as_selector,
    parse_port_name,
    residual_port,
)


class StatsConfig(ConsumerConfig):
    layers: list[int | str] = Field(
        default_factory=lambda: [0, -1, "final"],
        description="layer indices (negative from the end) or 'final'",
    )
    phase: CaptureWindow = Field(
        "all",
        description="rows to count: prefill, decode, all, or a capture window ('last_prompt', "
        "'generated[0:16]', ...: docs/ports.md#capture-windows)",
    )

    max_requests: int | None = Field(
        1000,
        ge=1,
        description="per-request figures are kept for at most this many requests, the oldest "
        "dropped first (counter requests_dropped): a server's result stays bounded; None "
        "keeps every request",
    )

    @field_validator("layers")
    @classmethod
    def _layer_names(cls, v: list[int | str]) -> list[int | str]:
        for item in v:
            parse_port_name(item, prefixes=(), what="layers entry")  # residual stream, final
        return v


class StatsRequest(RequestSettings):
    window: WindowSetting = Field(
        None, description="rows of this request to count, within the config's phase"
    )


def _figures(per_key: dict[str, list[float]]) -> dict[str, Any]:
    """Per port: rows, mean L2 norm and max |x| from [rows, sum of norms, max |x|]."""
    return {
        key: {"rows": int(r), "mean_norm": s / max(r, 1), "max_abs": m}
        for key, (r, s, m) in per_key.items()
    }


class StatsConsumer(Consumer):
    name = "stats"
    proof_counter = "bundles"
    description = "Per-layer activation statistics (rows, mean L2 norm, max |x|) per request."
    Config = StatsConfig
    Request = StatsRequest

    def __init__(self, config: StatsConfig, context):
        super().__init__(config, context)
        phase = as_selector(config.phase, "stats: phase")
        self._ports = [
            residual_port(str(layer), phase).resolve(context.resolve_layer)
            for layer in config.layers
        ]
        # (request_id, sample_index) -> key -> [rows, sum of norms, max |x|], oldest first
        self._acc: OrderedDict[tuple[str, int], dict[str, list[float]]] = OrderedDict()

    def reads(self):
        return self._ports

    def on_bundle(self, bundle: Bundle) -> None:
        reqs = bundle.rows.requests
        for key, h in bundle.hidden.items():
            norms = h.float().norm(dim=-1).tolist()
            maxabs = h.float().abs().amax(dim=-1).tolist()
            for req, n, m in zip(reqs, norms, maxabs, strict=False):
                acc = self._request(req.request_id, req.sample_index).setdefault(key, [0, 0.0, 0.0])
                acc[0] += 1
                acc[1] += n
                acc[2] = max(acc[2], m)
            self.counters.add(f"rows.{key}", h.shape[0])
        self.counters.add("bundles")

    def _request(self, rid: str, sample: int) -> dict[str, list[float]]:
        per_key = self._acc.get((rid, sample))
        if per_key is None:
            per_key = self._acc[(rid, sample)] = {}
            if self.config.max_requests is not None and len(self._acc) > self.config.max_requests:
                self._acc.popitem(last=False)
                self.counters.add("requests_dropped")
        return per_key

    def request_result(self, request: RequestInfo) -> dict[str, Any]:
        """This request's figures per port (rows, mean L2 norm, max |x|)."""
        return _figures(self._acc.get((request.request_id, request.sample_index), {}))

    @classmethod
    def result_bytes(cls, config: StatsConfig, request: PlannedRequest) -> int:
        return 128 * len(config.layers)  # three numbers per port

    def result(self) -> dict[str, Any]:
        return {f"{rid}/{s}": _figures(per_key) for (rid, s), per_key in sorted(self._acc.items())}

    @classmethod
    def summary(cls, counters: dict[str, Any], result: Any) -> list[str]:
        rows = ", ".join(
            f"{k.removeprefix('rows.')} {v}" for k, v in counters.items() if k.startswith("rows.")
        )
        return [f"stats: {counters.get('bundles', 0)} bundles; rows per port: {rows or 'none'}"]

    @classmethod
    def report_plots(cls, counters: dict[str, Any], result: Any) -> list[Plot]:
        if not isinstance(result, dict):
            return []
        acc: dict[str, list[float]] = {}  # key -> [rows, sum of norms, max |x|]
        for per_key in result.values():
            for key, f in per_key.items():
                a = acc.setdefault(key, [0, 0.0, 0.0])
                a[0] += f["rows"]
                a[1] += f["mean_norm"] * f["rows"]
                a[2] = max(a[2], f["max_abs"])
        keys = sorted(acc, key=layer_order)
        if not keys:
            return []
        return [
            Plot(
                name="norms",
                title="Mean L2 norm per layer",
                xlabel="port",
                ylabel="mean ‖h‖₂ over rows",
                kind="bar",
                series=(Series("mean norm", keys, [acc[k][1] / max(acc[k][0], 1) for k in keys]),),
            ),
            Plot(
                name="max_abs",
                title="Largest |x| per layer",
                xlabel="port",
                ylabel="max |x|",
                kind="bar",
                series=(Series("max |x|", keys, [acc[k][2] for k in keys]),),
            ),
        ]
