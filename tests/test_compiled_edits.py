"""Edits proven under compilation: ``tllm export`` in vLLM's default layout (multiprocess,
compiled) with ``steer`` adding a vector after layer 1 and ablating a direction after
layer 2; the exported downstream states equal transformers' with the same edits applied by
forward hooks, at every prompt and generated position. Beside them the third-party consumer
``recorder`` (tests/plugin_pkg, found through its entry point) captures the same layers in
the worker process: its rows equal transformers' too."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import cli_json, run_cli
from reference import hf_model, sequences_from_rows

pytestmark = pytest.mark.vllm

HIDDEN = 128  # tests/tiny_models.py default


def _vectors() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    v = torch.randn(HIDDEN, generator=g)
    u = torch.randn(HIDDEN, generator=g)
    return v / v.norm() * 8.0, u / u.norm()


@torch.no_grad()
def _hf_edited(path: str, token_ids: list[int], v: torch.Tensor, u: torch.Tensor) -> dict:
    model = hf_model(path)
    layers = model.model.layers
    out = {}

    def add(_m, _i, o):
        h = o[0] if isinstance(o, tuple) else o
        h = h + v
        return (h, *o[1:]) if isinstance(o, tuple) else h

    def ablate(_m, _i, o):
        h = o[0] if isinstance(o, tuple) else o
        h = h - (h @ u)[..., None] * u
        return (h, *o[1:]) if isinstance(o, tuple) else h

    def keep(name):
        def hook(_m, _i, o):
            out[name] = (o[0] if isinstance(o, tuple) else o)[0]

        return hook

    handles = [
        layers[1].register_forward_hook(add),
        layers[2].register_forward_hook(ablate),
        layers[2].register_forward_hook(keep("layer.2")),
        layers[3].register_forward_hook(keep("layer.3")),
    ]
    try:
        model(torch.tensor([token_ids]))
    finally:
        for h in handles:
            h.remove()
    return out


def test_compiled_steering_matches_transformers_with_hooks(tiny_model, tmp_path):
    from consumers.export import read_export

    v, u = _vectors()
    steer = {
        "vectors": [
            {"layer": 1, "vector": v.tolist(), "scale": 1.0},
            {"layer": 2, "vector": u.tolist(), "mode": "ablate"},
        ]
    }
    out = tmp_path / "steered"
    args = ["export", "--model", tiny_model, "--layers", "2,3", "--out", str(out)]
    args += ["--consumer", f"steer:{json.dumps(steer)}", "-n", "2", "--max-tokens", "5"]
    args += ["--seed", "4", "--no-chat", "--json", "--dtype", "float32", "--max-model-len", "512"]
    args += ["--compile"]  # a job this small would start eager (issue 39)
    args += ["--prompt", "The weather today", "--prompt", "Count: one two three four five"]
    args += ["--consumer", 'recorder:{"layers": [2, 3]}']
    proc = run_cli(*args, timeout=900)
    report = cli_json(proc)
    rt = report["counters"]["runtime"]
    records = list(read_export(out, verify=True))
    assert len(records) == 4
    rows = sum(len(r.positions) for r in records)
    # every fed row was changed by both edits, as the taps counted inside the compiled forward
    assert rt["rows_edited.layer.1"] == rt["rows_edited.layer.2"] == rows
    assert rt.get("stale_captures", 0) == 0
    for rec in records:
        ref = _hf_edited(tiny_model, rec.token_ids.tolist(), v, u)
        for key in ("layer.2", "layer.3"):
            torch.testing.assert_close(
                rec.hidden[key], ref[key][rec.positions], rtol=1e-4, atol=1e-4, msg=key
            )
        # the ablated direction is gone from the stream after layer 2
        assert rec.hidden["layer.2"].float().matmul(u).abs().max() < 1e-3

    # The third-party consumer ran in vLLM's worker process, not in the front end we started,
    # and captured every fed position once, equal to transformers' with the same edits.
    result = report["results"]["recorder"]
    assert result["pid"] > 0 and result["pid"] != proc.pid
    assert report["counters"]["recorder"]["rows"] > 0
    seqs = sequences_from_rows(result["rows"], result["sampled"])
    assert len(seqs) == 4
    checked = 0
    for key, seq in seqs.items():
        ref = _hf_edited(tiny_model, seq, v, u)
        rows = [r for r in result["rows"] if (r["request_id"], r["sample_index"]) == key]
        fresh = sorted(r["position"] for r in rows if not r["recomputed"])
        assert fresh == list(range(len(seq) - 1)), key
        for r in rows:
            assert r["token_id"] == seq[r["position"]]
            for k, got in r["hidden"].items():
                want = ref[k][r["position"]]
                torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-4, msg=k)
                checked += 1
    assert checked > 0
