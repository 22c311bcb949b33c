"""``steer``'s clamp (a projection clipped to [lo, hi] or set to a target) and gate (a vector
applied only where a probe's score at that layer crosses a threshold), decided inside the
forward; named vectors a request chooses. Checked against transformers with the same edit
written out in forward hooks: in the consumer kit, on vLLM's V1 runner eager and compiled,
and on V2; ``rows_gated`` equals the rows where the probe fires in transformers."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import cli_in_process, cli_json, run_cli
from reference import hf_model

from consumers.steer.consumer import SteerConfig, SteerRequest
from tllm_core import Consumer, HiddenStates, Phase

HIDDEN = 128  # tests/tiny_models.py default
# The tiny model's layer-1 projections on u are about -0.15..-0.04: the clamp moves most rows.
LO, HI = -0.02, 0.02
PROMPTS = ["The weather today", "Count: one two three four five"]


def _directions() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    u, d = torch.randn(HIDDEN, generator=g), torch.randn(HIDDEN, generator=g)
    return u / u.norm(), d / d.norm()


def _config(u, d, threshold: float) -> dict:
    return {
        "vectors": [
            {
                "name": "cap",
                "layer": 1,
                "vector": u.tolist(),
                "mode": "clamp",
                "lo": LO,
                "hi": HI,
                "gate": {"vector": d.tolist(), "threshold": threshold},
            }
        ]
    }


@torch.no_grad()
def _hf(path: str, ids: list[int], u, d, threshold: float) -> tuple[dict, torch.Tensor]:
    """transformers with the edit written out: layer 1's output, where (h . d) > threshold,
    gets its projection on u clipped to [LO, HI]; the downstream states and, per position,
    whether the probe fired."""
    model = hf_model(path)
    out, fired = {}, []

    def edit(_m, _i, o):
        h = o[0] if isinstance(o, tuple) else o
        x = h.float()
        fire = (x @ d) > threshold
        p = x @ u
        new = x + (p.clamp(LO, HI) - p)[..., None] * u
        fired.append(fire[0])
        h = torch.where(fire[..., None], new, x).to(h.dtype)
        return (h, *o[1:]) if isinstance(o, tuple) else h

    def keep(name):
        def hook(_m, _i, o):
            out[name] = (o[0] if isinstance(o, tuple) else o)[0]

        return hook

    layers = model.model.layers
    hs = [layers[1].register_forward_hook(edit)]
    hs += [layers[i].register_forward_hook(keep(f"layer.{i}")) for i in (1, 2)]
    try:
        model(torch.tensor([ids]))
    finally:
        for h in hs:
            h.remove()
    return out, fired[0]


@torch.no_grad()
def _threshold(path: str, u) -> float:
    """A threshold where the probe fires on some rows of layer 1 and not on others."""
    _, d = _directions()
    model = hf_model(path)
    tok_ids = [list(range(3, 12)), list(range(20, 30))]
    scores = []
    for ids in tok_ids:
        h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[2][0]
        scores.append(h.float() @ d)
    # Midway between the two middle scores: a threshold equal to a row's score (the median of
    # an odd count) would gate that row by rounding (one thread or two decide it).
    s = torch.cat(scores).sort().values
    return float(s[len(s) // 2 - 1 : len(s) // 2 + 1].mean())


# -- config and request validation (no model) ----------------------------------------------
def test_clamp_and_gate_settings_are_checked_with_clear_errors():
    v = [0.0] * 4 + [1.0]
    with pytest.raises(ValueError, match="'clamp' needs 'target', or 'lo' and/or 'hi'"):
        SteerConfig(vectors=[{"layer": 0, "vector": v, "mode": "clamp"}])
    with pytest.raises(ValueError, match=r"lo \(2.0\) is above hi \(1.0\)"):
        SteerConfig(vectors=[{"layer": 0, "vector": v, "mode": "clamp", "lo": 2, "hi": 1}])
    with pytest.raises(ValueError, match="for mode 'clamp', not 'add'"):
        SteerConfig(vectors=[{"layer": 0, "vector": v, "hi": 1}])
    with pytest.raises(ValueError, match="'cap' given twice"):
        SteerConfig(vectors=[{"layer": 0, "vector": v, "name": n} for n in ("cap", "cap")])
    cfg = SteerConfig(
        vectors=[
            {"layer": 0, "vector": v, "name": "calm"},
            {"layer": 1, "vector": v, "name": "cap", "mode": "clamp", "target": 0},
        ]
    )
    ok = SteerRequest.model_validate({"vectors": "calm=2, cap"}, context={"config": cfg})
    assert ok.vectors == {"calm": 2.0, "cap": None}
    with pytest.raises(ValueError, match="no steering vector named 'happy'.*calm, cap"):
        SteerRequest.model_validate({"vectors": "happy"}, context={"config": cfg})
    with pytest.raises(ValueError, match="'cap' is 'clamp': it takes no scale"):
        SteerRequest.model_validate({"vectors": "cap=1"}, context={"config": cfg})


# -- the kit: tllm's runtime on transformers ------------------------------------------------
class _Keep(Consumer):
    name = "keep"

    def __init__(self, config, context):
        super().__init__(config, context)
        self.rows: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def reads(self):
        return [HiddenStates(1, Phase.ALL), HiddenStates(2, Phase.ALL)]

    def on_bundle(self, bundle):
        for key, h in bundle.hidden.items():
            for i, req in enumerate(bundle.rows.requests):
                pos = int(bundle.rows.position[i])
                self.rows.setdefault((req.request_id, pos), {})[key] = h[i].clone()


def test_clamp_gated_by_a_probe_equals_transformers_in_the_kit(tiny_model):
    from tllm_core.testing import ConsumerKit

    u, d = _directions()
    thr = _threshold(tiny_model, u)
    kit = ConsumerKit(tiny_model, [{"name": "steer", "config": _config(u, d, thr)}, _Keep])
    ids = [list(range(3, 12)), list(range(20, 30))]
    out = kit.generate(ids, max_tokens=4, temperature=0.0)
    keep = kit.consumer("keep")
    report = kit.close()
    fired_ref = 0
    for p, (prompt, gen) in enumerate(zip(ids, out, strict=True)):
        seq = prompt + gen[0][:-1]  # the last token is sampled, never fed
        ref, fired = _hf(tiny_model, seq, u, d, thr)
        fired_ref += int(fired.sum())
        got = torch.stack([keep.rows[(str(p), pos)]["layer.2"] for pos in range(len(seq))])
        torch.testing.assert_close(got, ref["layer.2"], rtol=1e-4, atol=1e-4)
        l1 = torch.stack([keep.rows[(str(p), pos)]["layer.1"] for pos in range(len(seq))])
        torch.testing.assert_close(l1, ref["layer.1"], rtol=1e-4, atol=1e-4)
    counters = report["consumers"]["steer"]
    assert 0 < fired_ref < sum(len(p) + 3 for p in ids)  # the gate splits the rows
    assert counters["rows_gated"] == fired_ref
    assert report["results"]["steer"]["rows_gated"] == fired_ref


# -- vLLM: V1 eager and compiled, and V2 -----------------------------------------------------
def _export(tiny_model, tmp_path, u, d, thr, *extra: str, env=None) -> tuple[dict, list]:
    from consumers.export import read_export

    out = tmp_path / "steered"
    args = ["export", "--model", tiny_model, "--layers", "1,2", "--out", str(out)]
    args += ["--consumer", f"steer:{json.dumps(_config(u, d, thr))}", "--max-tokens", "4"]
    args += ["--temperature", "0", "-n", "1", "--no-chat", "--max-model-len", "512"]
    for p in PROMPTS:
        args += ["--prompt", p]
    if env is None and "--compile" not in extra:  # the engine's processes are not the point
        report = cli_in_process(*args, *extra)
    else:
        report = cli_json(run_cli(*args, *extra, "--json", env=env, timeout=900))
    return report, list(read_export(out, verify=True))


def _check(tiny_model, report, records, u, d, thr) -> None:
    fired_ref = 0
    for rec in records:
        ref, fired = _hf(tiny_model, rec.token_ids.tolist(), u, d, thr)
        fired_ref += int(fired[rec.positions].sum())  # the rows the engine fed
        for key in ("layer.1", "layer.2"):
            torch.testing.assert_close(
                rec.hidden[key], ref[key][rec.positions], rtol=1e-4, atol=1e-4, msg=key
            )
    assert fired_ref > 0
    assert report["counters"]["steer"]["rows_gated"] == fired_ref
    assert report["counters"]["runtime"]["rows_edited.layer.1"] <= fired_ref


@pytest.mark.vllm
@pytest.mark.parametrize(
    "mode",
    ["eager", pytest.param("compiled", marks=pytest.mark.slow)],  # compiling: ~45 s
)
def test_clamp_gated_by_a_probe_equals_transformers_on_v1(tiny_model, tmp_path, mode):
    u, d = _directions()
    thr = _threshold(tiny_model, u)
    flag = "--enforce-eager" if mode == "eager" else "--compile"
    report, records = _export(tiny_model, tmp_path, u, d, thr, flag)
    assert report["run"]["runner"].startswith("V1"), report["run"]["runner"]
    _check(tiny_model, report, records, u, d, thr)


@pytest.mark.vllm
@pytest.mark.slow
def test_clamp_gated_by_a_probe_equals_transformers_on_v2(tiny_model, tmp_path):
    from cli_util import v2_env

    u, d = _directions()
    thr = _threshold(tiny_model, u)
    report, records = _export(
        tiny_model, tmp_path, u, d, thr, "--enforce-eager", "--kv-cache-gib", "1", env=v2_env()
    )
    assert report["run"]["runner"].startswith("V2"), report["run"]["runner"]
    _check(tiny_model, report, records, u, d, thr)


def test_a_request_chooses_named_vectors_and_their_scales(tiny_model):
    from tllm_core.testing import ConsumerKit

    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(HIDDEN, generator=g), torch.randn(HIDDEN, generator=g)
    cfg = {
        "vectors": [
            {"name": "a", "layer": 1, "vector": a.tolist()},
            {"name": "b", "layer": 1, "vector": b.tolist()},
        ]
    }
    kit = ConsumerKit(tiny_model, [{"name": "steer", "config": cfg}, _Keep])
    plain = ConsumerKit(tiny_model, [_Keep])
    ids = [3, 4, 5, 6]
    kit.generate([ids], max_tokens=1, extra_args={"tllm_steer_vectors": "b=2"})
    plain.generate([ids], max_tokens=1)
    got = torch.stack([kit.consumer("keep").rows[("0", p)]["layer.1"] for p in range(4)])
    base = torch.stack([plain.consumer("keep").rows[("0", p)]["layer.1"] for p in range(4)])
    torch.testing.assert_close(got, base + 2.0 * b, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="no steering vector named 'c'"):
        kit.generate([ids], max_tokens=1, extra_args={"tllm_steer_vectors": "c=1"})
    kit.close()
    plain.close()
