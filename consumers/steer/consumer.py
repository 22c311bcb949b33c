"""``steer``: add, ablate or clamp vectors in the residual stream at chosen layers, optionally
gated by a probe. A running server registers vectors (``POST /tllm/consumers/steer/control``):
the front end checks the request (:func:`check_control`), the engine applies it (``control``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from consumers.steer.config import SteerConfig, SteerRequest, SteerVector, forget, keep
from consumers.steer.vectors import check_vector, load_vector
from tllm_core import (
    Consumer,
    ConsumerContext,
    ControlError,
    Edit,
    EditPlan,
    HiddenStates,
    RequestInfo,
    ResidualEdit,
    RowInfo,
    WritePort,
)

log = logging.getLogger("tllm")


class SteerTransform(torch.nn.Module):
    """An edit that depends on the row's own value (a clamp, a probe gate), run inside the
    forward: tensor operations on buffers only, so it traces into vLLM's compiled graph.
    ``gated`` counts the rows it edited, on the device."""

    def __init__(self, entry: SteerVector, vector: torch.Tensor, probe: torch.Tensor | None):
        super().__init__()
        v = vector.float()
        self.mode, self.lo, self.hi, self.target = entry.mode, entry.lo, entry.hi, entry.target
        gate = entry.gate
        self.threshold = float(gate.threshold) if gate is not None else 0.0
        self.above = gate.above if gate is not None else True
        self.register_buffer("vector", v * entry.scale if self.mode == "add" else v / v.norm())
        self.register_buffer("probe", None if probe is None else probe.float().to(v.device))
        self.register_buffer("gated", torch.zeros(1, dtype=torch.int64, device=v.device))

    def edited(self, x: torch.Tensor) -> torch.Tensor:
        """The edit on float32 rows ``x`` ``[n, H]``, ungated."""
        if self.mode == "add":
            return x + self.vector
        u = self.vector
        p = x @ u
        if self.mode == "ablate":
            return x - p[:, None] * u
        if self.target is not None:
            q = torch.full_like(p, self.target)
        else:
            q = torch.clamp(p, min=self.lo, max=self.hi)
        return x + (q - p)[:, None] * u

    def fires(self, x: torch.Tensor) -> torch.Tensor:
        if self.probe is None:
            return torch.ones(x.shape[0], 1, dtype=torch.bool, device=x.device)
        score = x @ self.probe
        hit = score > self.threshold if self.above else score < self.threshold
        return hit[:, None]

    def forward(self, s: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x = s.float()
        fire = self.fires(x) & rows
        self.gated.add_(fire.sum())
        return torch.where(fire, self.edited(x), x).to(s.dtype)


# Scaled vectors kept per steer for scale overrides (one per distinct override and vector).
KEEP_SCALED = 64


@dataclass(eq=False)
class _Vec:
    entry: SteerVector
    layer: int
    vector: torch.Tensor
    transform: SteerTransform | None = None  # gated or clamping: decided inside the forward
    scaled: dict[float, torch.Tensor] = field(default_factory=dict)
    largest: float = 0.0  # max |vector|: a scale past dtype max / largest overflows the edit

    def times(self, scale: float) -> torch.Tensor:
        """``vector * scale``, the same tensor for the same scale."""
        out = self.scaled.get(scale)
        if out is None:
            if len(self.scaled) >= KEEP_SCALED:
                self.scaled.pop(next(iter(self.scaled)))
            # Not an inference tensor: the edit buffers keep only values with a version.
            with torch.inference_mode(False):
                out = self.scaled[scale] = self.vector * scale
        return out


def _uses(s: SteerRequest, v: _Vec) -> bool:
    """Whether a request with settings ``s`` is steered by ``v``: the vectors it names, else
    those configured at start (a registered vector only where named)."""
    return v.entry.name in s.vectors if s.vectors is not None else not v.entry.registered


ADD_FIELDS = frozenset({"name", "layer", "vector", "scale", "mode", "normalize"})


def check_control(
    action: str, payload: dict[str, Any], config: SteerConfig
) -> tuple[SteerConfig, Any]:
    """The front end's check of a control request: ``list``, ``add`` or ``remove``."""
    if action == "list":
        shown = ("name", "layer", "mode", "scale", "registered")
        return config, [{k: getattr(v, k) for k in shown} for v in config.vectors]
    by_name = {v.name: v for v in config.vectors if v.name is not None}
    if action == "remove":
        name = payload.get("name")
        if set(payload) != {"name"} or not isinstance(name, str):
            raise ControlError('"remove" takes {"name": NAME}')
        if name not in by_name:
            raise ControlError(f"no steering vector named {name[:64]!r}", 404)  # names: <= 64
        if not by_name[name].registered:
            raise ControlError(
                f"vector {name!r} was configured at start: it cannot be removed", 409
            )
        vectors = [v for v in config.vectors if v.name != name]
        return config.model_copy(update={"vectors": vectors}), {"removed": name}
    if action != "add":
        raise ControlError(f"unknown action {action[:64]!r}; steer takes: list, add, remove")
    extra = set(payload) - ADD_FIELDS
    if extra:
        raise ControlError(
            f"unknown field(s) {', '.join(sorted(extra))}; an added vector takes: "
            f"{', '.join(sorted(ADD_FIELDS))}"
        )
    if not isinstance(payload.get("name"), str):
        raise ControlError('"add" needs a "name"')
    if payload.get("mode", "add") not in ("add", "ablate"):
        raise ControlError("a registered vector is 'add' or 'ablate' (clamps and gates are fixed)")
    if not isinstance(payload.get("vector"), list):
        raise ControlError('"add" needs the vector inline: "vector": [numbers]')
    try:
        entry = SteerVector.model_validate({**payload, "registered": True})
    except ValidationError as e:
        raise ControlError(f"invalid vector: {e}") from None
    if entry.name in by_name:
        raise ControlError(f"a vector named {entry.name!r} exists: remove it first", 409)
    layers = sorted(set(config.open_layers) | {v.layer for v in config.vectors if not v.registered})
    if entry.layer not in layers:
        raise ControlError(
            f"layer {entry.layer} is not open for registered vectors; this engine's: "
            f"{', '.join(map(str, layers)) or '(none)'} (steer's open_layers)"
        )
    registered = [v for v in config.vectors if v.registered]
    if len(registered) >= config.max_registered:
        raise ControlError(
            f"{len(registered)} vectors registered: at most {config.max_registered}", 413
        )
    floats = sum(len(v.vector or ()) for v in registered) + len(entry.vector or ())
    if floats * 4 > config.max_registered_mib * (1 << 20):
        raise ControlError(
            f"registered vectors would hold {floats * 4 / (1 << 20):.1f} MiB: at most "
            f"{config.max_registered_mib:g} MiB (steer's max_registered_mib)",
            413,
        )
    return config.model_copy(update={"vectors": [*config.vectors, entry]}), {"added": entry.name}


class SteerConsumer(Consumer):
    name = "steer"
    proof_counter = "rows_selected"
    description = (
        "Activation steering: add scale*vector to, ablate a direction from, or clamp a "
        "projection of the residual stream after chosen layers, optionally gated by a probe."
    )
    Config = SteerConfig
    Request = SteerRequest

    config: SteerConfig

    def __init__(self, config: SteerConfig, context: ConsumerContext):
        super().__init__(config, context)
        self.vectors: list[_Vec] = []
        for i, entry in enumerate(config.vectors):  # each checked against those before it
            self.vectors.append(self._build(entry, f"vectors[{i}]"))
        try:
            opened = {context.resolve_layer(layer) for layer in config.open_layers}
        except ValueError as e:
            raise ValueError(f"steer: open_layers: {e}") from None
        self.layers = sorted({v.layer for v in self.vectors} | opened)
        self._req_cache: dict[str, SteerRequest | None] = {}

    def _build(self, entry: SteerVector, what: str) -> _Vec:
        hidden = int(self.context.model.hidden_size)
        try:
            layer = self.context.resolve_layer(entry.layer)
        except ValueError as e:
            raise ValueError(f"steer: {what}.layer: {e}") from None
        vec = _vector(entry.path, entry.vector, hidden, what)
        norm = float(vec.norm())
        if (entry.mode != "add" or entry.normalize) and norm == 0.0:
            raise ValueError(
                f"steer: {what} is all zeros: 'ablate', 'clamp' and normalize=true "
                f"need a non-zero direction"
            )
        for j, other in enumerate(self.vectors):
            if other.layer != layer:
                continue
            if entry.mode == "ablate" and entry.gate is None and other.entry.mode == "ablate":
                if other.transform is None:
                    raise ValueError(
                        f"steer: vectors[{j}] and {what} both ablate at layer {layer}; one "
                        f"ablation direction per layer is supported"
                    )
            if entry.in_graph and other.transform is not None:
                raise ValueError(
                    f"steer: vectors[{j}] and {what} are both gated or clamping at layer "
                    f"{layer}; one such vector per layer is supported"
                )
        if entry.mode == "ablate" or entry.normalize:
            vec = vec / norm
        device = self.context.model.device
        transform = probe = None
        if entry.gate is not None:
            probe = _vector(entry.gate.path, entry.gate.vector, hidden, f"{what}.gate")
            pnorm = float(probe.norm())
            if pnorm == 0.0:
                raise ValueError(f"steer: {what}.gate: the probe direction is all zeros")
            if entry.gate.normalize:
                probe = probe / pnorm
        largest = float(vec.abs().max())
        if entry.mode == "add" and (why := self._overflow(entry.scale, largest)):
            raise ValueError(f"steer: {what}: scale {why}")
        if entry.in_graph:
            with torch.inference_mode(False):
                transform = SteerTransform(entry, vec.to(device), probe)
        return _Vec(entry, layer, vec.to(device), transform, largest=largest)

    def _overflow(self, scale: float, largest: float) -> str | None:
        """Why ``scale`` times a vector whose largest entry is ``largest`` is past the model's
        dtype (the edited rows would be inf, then NaN), or None."""
        dtype = self.context.model.dtype
        top = torch.finfo(dtype).max if dtype.is_floating_point else float("inf")
        if abs(scale) * largest <= top:
            return None
        return (
            f"{scale:g} times the vector's largest entry {largest:g} is past {dtype}'s "
            f"largest value {top:g}"
        )

    @staticmethod
    def _scale_of(s: SteerRequest, v: _Vec) -> float | None:
        """The scale request settings ``s`` give vector ``v`` in place of its own, or None."""
        if v.entry.mode != "add" or v.transform is not None:
            return None
        scale = s.vectors.get(v.entry.name) if s.vectors is not None else None
        return s.scale if scale is None else scale

    def writes(self) -> list[WritePort]:
        graph = {v.layer: v.transform for v in self.vectors if v.transform is not None}
        return [
            Edit(HiddenStates(layer), transform=graph[layer])
            if layer in graph
            else ResidualEdit(layer)
            for layer in self.layers
        ]

    def _request_state(self, req: RequestInfo) -> SteerRequest | None:
        """``req``'s settings; None: not steered (a per-request steer it did not name)."""
        if req.engine_id not in self._req_cache:
            state = None
            if self.acts_on(req):
                try:  # checked at admission; a vector removed since then fails here
                    state = req.settings(self)
                    for v in self.vectors:  # the model's dtype is known here only
                        scale = self._scale_of(state, v) if _uses(state, v) else None
                        if scale is not None and (why := self._overflow(scale, v.largest)):
                            raise ValueError(f"vector {v.entry.name or '(unnamed)'}: scale {why}")
                except ValueError as e:  # that request unsteered, the others as asked
                    state = None
                    self.counters.add("invalid_request_settings")
                    log.warning("steer: request %r: %s; not steered", req.request_id, e)
            self._req_cache[req.engine_id] = state
        return self._req_cache[req.engine_id]

    def edit(self, rows: RowInfo, plan: EditPlan) -> None:
        n = len(rows)
        base = np.ones(n, np.bool_)
        if self.config.positions != "all":
            dec = np.asarray(rows.is_decode, np.bool_)
            base = dec if self.config.positions == "generated" else ~dec
        masks = [base.copy() for _ in self.vectors]
        # Per vector: each row's scale, once a request overrides it ('add' outside the graph).
        scales: list[np.ndarray | None] = [None] * len(self.vectors)
        for req, start, stop in rows.runs():
            s = self._request_state(req)
            for j, v in enumerate(self.vectors):
                if s is None or not _uses(s, v):
                    masks[j][start:stop] = False
                    continue
                if (scale := self._scale_of(s, v)) is not None:
                    if scales[j] is None:
                        scales[j] = np.full(n, v.entry.scale)
                    scales[j][start:stop] = scale  # type: ignore[index]
        per_layer: dict[int, set[int]] = {}
        for v, mask, sc in zip(self.vectors, masks, scales, strict=True):
            idx = np.nonzero(mask)[0].astype(np.int64)
            if idx.size == 0:
                continue
            per_layer.setdefault(v.layer, set()).update(idx.tolist())
            if v.transform is not None:
                plan.transform(v.layer, idx)
            elif v.entry.mode == "ablate":
                plan.ablate(v.layer, idx, v.vector)
            elif sc is None or np.all(sc[idx] == sc[idx[0]]):
                plan.add(v.layer, idx, v.times(v.entry.scale if sc is None else float(sc[idx[0]])))
            else:  # per-row values: made (and on a GPU copied) every step
                row_scales = torch.from_numpy(sc[idx].astype(np.float32)).to(v.vector.device)
                plan.add(v.layer, idx, row_scales[:, None] * v.vector)
        for layer, sel in per_layer.items():
            self.counters.add("rows_selected", len(sel), of=f"layer.{layer}")

    def on_request_finished(self, request: RequestInfo) -> None:
        self._req_cache.pop(request.engine_id, None)

    check_control = staticmethod(check_control)

    def control(self, action: str, payload: dict[str, Any]) -> Any:
        new, reply = check_control(action, payload, self.config)
        if action == "add":
            entry = new.vectors[-1]
            try:
                vec = self._build(entry, repr(entry.name))
            except ValueError as e:
                raise ControlError(str(e), 409 if "both" in str(e) else 400) from None
            if vec.layer not in self.layers:
                raise ControlError(f"layer {vec.layer} has no edit port in this engine")
            self.vectors.append(vec)
            if self.config.keep_dir is not None:
                keep(self.config.keep_dir, entry.name or "", vec.vector, payload)
        elif action == "remove":
            self.vectors = [v for v in self.vectors if v.entry.name != payload["name"]]
            if self.config.keep_dir is not None:
                forget(self.config.keep_dir, payload["name"])
        self.config = new  # requests are validated against its names
        return reply

    def result(self) -> dict[str, Any]:
        gated = [
            (v.layer, t)
            for v in self.vectors
            if (t := v.transform) is not None and t.probe is not None
        ]
        for layer, t in gated:  # the forwards' counts into the counters
            n = int(t.gated.item())
            t.gated.zero_()
            self.counters.add("rows_gated", n, of=f"layer.{layer}")
        out: dict[str, Any] = {
            "layers": self.layers,
            "rows_selected": int(self.counters.get("rows_selected")),
        }
        if gated:
            out["rows_gated"] = int(self.counters.get("rows_gated"))
        return out


def _vector(path: str | None, inline: list[float] | None, hidden: int, what: str) -> torch.Tensor:
    if path is not None:
        try:
            return load_vector(path, hidden)
        except ValueError as e:
            raise ValueError(f"steer: {what}.path: {e}") from None
    try:
        return check_vector(torch.tensor(inline, dtype=torch.float32), hidden, f"{what}.vector")
    except ValueError as e:
        raise ValueError(f"steer: {e}") from None
