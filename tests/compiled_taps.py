"""tllm's taps in a compiled, graph-captured forward: a toy decoder whose layers have vLLM's
decoder-layer signature ``(positions, hidden_states, residual) -> (hidden_states,
residual)`` (Llama-style: the next layer's add-norm adds them), with the bridge's own
residual taps (``sites.install_tap``: capture, stamp, edit count, ``edits.apply_edit``) on
every layer, as vLLM's compiler would trace them.

``run(device)`` compares, for three steps whose edit buffers and step clock the host
rewrites in place between calls (as the runtime does), the eager forward with the
``torch.compile``'d one and, on CUDA, with a CUDA graph of the compiled forward captured once
and replayed: outputs, captured rows, stamps and edit counts. Used by
``benchmarks/gpu_smoke.py`` and ``tests/test_benchmarks.py``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from tllm_core.api.edits import EditBuffers
from tllm_core.testing.fake_cuda import is_cuda
from tllm_core.vllm_bridge.sites import TapBuffers, install_tap

ROWS, HIDDEN, LAYERS = 8, 64, 3


class ToyLayer(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.mlp = nn.Linear(hidden, hidden, bias=False)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
        else:
            residual = hidden_states + residual
        h = self.mlp(self.norm(residual)) * torch.cos(positions.float())[:, None]
        return h, residual


class ToyDecoder(nn.Module):
    def __init__(self, hidden: int = HIDDEN, layers: int = LAYERS):
        super().__init__()
        self.layers = nn.ModuleList(ToyLayer(hidden) for _ in range(layers))

    def forward(self, positions, x):
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return x + residual


def _build(device: torch.device) -> tuple[ToyDecoder, list[TapBuffers], torch.Tensor]:
    torch.manual_seed(0)
    model = ToyDecoder().to(device)
    clock = torch.zeros(1, dtype=torch.long, device=device)
    taps = []
    for i in range(LAYERS):
        b = TapBuffers(
            capture=torch.zeros(ROWS, HIDDEN, device=device),
            edit=EditBuffers(ROWS, HIDDEN, torch.float32, device),
            clock=clock,
            stamp=torch.zeros(1, dtype=torch.long, device=device),
            edited=torch.zeros(1, dtype=torch.long, device=device),
        )
        install_tap(model.layers, "residual", i, b)
        taps.append(b)
    return model, taps, clock


def _write_step(taps: list[TapBuffers], clock: torch.Tensor, step: int) -> None:
    """What the runtime does before a step: the clock, and different edits each step (in
    place: the compiled code and the graph read these storages)."""
    g = torch.Generator().manual_seed(step)
    clock.fill_(step)
    for i, t in enumerate(taps):
        e = t.edit
        rows = torch.rand(ROWS, 1, generator=g) < 0.5
        e.mask.copy_(rows)
        e.keep.copy_(torch.where(rows, 0.5 * (i + 1), 1.0))
        e.add.copy_(torch.randn(ROWS, HIDDEN, generator=g) * rows)
        u = torch.randn(ROWS, HIDDEN, generator=g)
        e.dir.copy_(u / u.norm(dim=-1, keepdim=True) * rows * (step % 2))


def _state(out: torch.Tensor, taps: list[TapBuffers]) -> list[torch.Tensor]:
    return [out.clone()] + [x.clone() for t in taps for x in (t.capture, t.stamp, t.edited)]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True))


def run(device: torch.device, steps: int = 3) -> dict[str, Any]:
    """Max abs differences of each step against eager (see the module docstring)."""
    model, taps, clock = _build(device)
    g = torch.Generator().manual_seed(99)
    x = torch.randn(ROWS, HIDDEN, generator=g).to(device)
    positions = torch.arange(ROWS, device=device)
    eager = []
    for s in range(1, steps + 1):
        _write_step(taps, clock, s)
        with torch.no_grad():
            eager.append(_state(model(positions, x), taps))
    out: dict[str, Any] = {
        "rows_edited_eager": [int(e[3 + 3 * i]) for e in eager for i in range(LAYERS)],
    }
    t0 = time.time()
    compiled = torch.compile(model, dynamic=False)
    diffs = []
    for s in range(1, steps + 1):
        _write_step(taps, clock, s)
        with torch.no_grad():
            diffs.append(_max_diff(_state(compiled(positions, x), taps), eager[s - 1]))
    out["compiled_max_abs_diff"] = diffs
    out["compile_seconds"] = time.time() - t0
    if not is_cuda(device):
        out["cuda_graph"] = {"skipped": "no CUDA"}
        return out
    static_x, static_pos = x.clone(), positions.clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            compiled(static_pos, static_x)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_out = compiled(static_pos, static_x)
    diffs = []
    for s in range(1, steps + 1):
        _write_step(taps, clock, s)
        graph.replay()
        torch.cuda.synchronize(device)
        diffs.append(_max_diff(_state(static_out, taps), eager[s - 1]))
    out["cuda_graph"] = {"replay_max_abs_diff": diffs}
    return out


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu"))))
