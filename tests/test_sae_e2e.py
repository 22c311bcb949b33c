"""The ``sae`` consumer inside real vLLM (CPU): features against transformers' hidden states
encoded by the same SAE, and steering by feature (scale 0 is plain vLLM, scale > 0 adds
``scale * W_dec[f]`` at the site, seen in an export of the site and of the next layer)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ENGINE_KW
from reference import hf_model, hf_states

from consumers.sae import load_sae, read_features, save_sae, top_features
from consumers.sae.train import activations_from_export, train_sae

pytestmark = pytest.mark.vllm

SITE = 1
TOP_K = 8
TRAIN_PROMPTS = [
    "The lighthouse keeper",
    "Rain on the roof",
    "Write a poem about the sea",
    "Tell me about cats",
    "One two three four",
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
]
PROMPTS = ["Hi there", "The quick brown fox jumps over the lazy dog", "Numbers: 1, 2, 3"]


@pytest.fixture(scope="module")
def saes(tiny_model, engines, tmp_path_factory):
    """SAEs trained on layer-1 activations exported by the export consumer."""
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM

    root = tmp_path_factory.mktemp("sae")
    spec = {"name": "export", "config": {"out": str(root / "acts"), "layers": [SITE]}}
    llm = engines.get(("sae-train", str(root)), lambda: TllmLLM(tiny_model, [spec], **ENGINE_KW))
    llm.generate(TRAIN_PROMPTS, SamplingParams(n=4, max_tokens=24, seed=1), use_tqdm=False)
    llm.close()
    engines.close()
    x = activations_from_export(root / "acts", f"layer.{SITE}")
    assert x.shape[0] > 500 and x.shape[1] == 128
    out = {}
    for arch, k in (("jumprelu", None), ("topk", 16)):
        sae = train_sae(x, 512, arch, k=k, steps=300, seed=0)
        out[arch] = save_sae(sae, root / arch)
    return out, x


def check_features_against_transformers(tiny_model, sae_path, records, only=None) -> dict:
    """Compare records with the SAE applied to transformers' states; returns totals."""
    sae = load_sae(sae_path)
    checked, rows, active, err, norm = 0, 0, 0, 0.0, 0.0
    for rec in records:
        if only is not None and (rec.request_id, rec.sample_index) not in only:
            continue
        seq = rec.token_ids.tolist()
        assert rec.positions.tolist() == list(range(len(seq) - 1))
        ref = hf_states(tiny_model, seq)[f"layer.{SITE}"][rec.positions]
        acts, st = sae.encode(ref)
        rows += len(ref)
        active += int((acts > 0).sum())
        err += float(((ref - sae.decode(acts, st)) ** 2).sum())
        norm += float((ref**2).sum())
        idx, val = top_features(acts, TOP_K)
        torch.testing.assert_close(rec.values.float(), val, rtol=1e-3, atol=1e-4)
        # indices must agree wherever the reference's values are clearly separated
        full = acts.sort(dim=-1, descending=True).values[:, : TOP_K + 1]
        gap_prev = torch.cat([torch.full((len(full), 1), float("inf")), full[:, :-1]], 1) - full
        gap_next = full - torch.cat([full[:, 1:], torch.zeros(len(full), 1)], 1)
        clear = (gap_prev[:, :TOP_K] > 1e-3) & (gap_next[:, :TOP_K] > 1e-3)
        assert clear.float().mean() > 0.5
        assert torch.equal(rec.indices[clear], idx[clear])
        checked += int(clear.sum())
    return {"checked": checked, "rows": rows, "mean_l0": active / rows, "relative_mse": err / norm}


def test_jumprelu_features_equal_transformers_reference(tiny_model, engines, saes, tmp_path):
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM

    paths, _ = saes
    out = tmp_path / "feat"
    spec = {
        "name": "sae",
        "config": {
            "path": str(paths["jumprelu"]),
            "site": SITE,
            "top_k": TOP_K,
            "out": str(out),
            "values_dtype": "float32",
            "watch": [0, 1],
            "shard_rows": 32,
            "delivery": "background",  # the other tests here encode at the end of the step
        },
    }
    llm = engines.get(("sae-jr", str(out)), lambda: TllmLLM(tiny_model, [spec], **ENGINE_KW))
    outs = llm.generate(PROMPTS, SamplingParams(n=2, max_tokens=12, seed=3), use_tqdm=False)
    report = llm.close()
    engines.close()
    assert report["errors"] == []
    assert report["runtime"]["background_threads"] == 1  # encoded on a consumer thread
    c, res = report["consumers"]["sae"], report["results"]["sae"]
    records = list(read_features(out, verify=True))
    assert len(records) == 6 and res["shards"] > 1
    rows = sum(len(r.positions) for r in records)
    assert c["rows_encoded"] == rows == c["rows_recorded"]
    for rec in records:
        o = outs[rec.prompt_index]
        assert rec.token_ids.tolist() == list(o.prompt_token_ids) + list(
            o.outputs[rec.sample_index].token_ids
        )
    ref = check_features_against_transformers(tiny_model, paths["jumprelu"], records)
    assert ref["checked"] > 100 and ref["rows"] == rows
    # the summary counters agree with the same SAE applied to transformers' states
    assert 0 < res["mean_l0"] == pytest.approx(ref["mean_l0"], abs=0.05)
    assert 0 < res["relative_mse"] == pytest.approx(ref["relative_mse"], rel=1e-3)


def _tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@torch.no_grad()
def hf_steered_layer(path: str, seq: list[int], layer: int, vec: torch.Tensor, read: int):
    """transformers' residual stream after layer ``read`` when ``vec`` is added after ``layer``."""
    model = hf_model(path)

    def add(_m, _i, out):
        if isinstance(out, tuple):
            return (out[0] + vec,) + tuple(out[1:])
        return out + vec

    h = model.model.layers[layer].register_forward_hook(add)
    try:
        hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    finally:
        h.remove()
    return hs[read + 1][0]


def test_topk_features_and_feature_steering(tiny_model, engines, saes, tmp_path):
    from vllm import LLM, SamplingParams

    from consumers.export import read_export
    from tllm_core.app.engine import TllmLLM

    paths, x = saes
    sae = load_sae(paths["topk"])
    acts, _ = sae.encode(x)
    feature = int((acts > 0).float().mean(0).argmax())  # the most frequent feature
    direction = sae.W_dec[feature]
    scale = 6.0 * float(x.norm(dim=-1).mean()) / float(direction.norm())

    def params(extra=None):
        return SamplingParams(n=2, max_tokens=10, seed=21, temperature=1.0, extra_args=extra)

    plain = engines.get(("plain", tiny_model), lambda: LLM(tiny_model, **ENGINE_KW))
    plain_tokens = _tokens(plain.generate(PROMPTS, [params()] * 3, use_tqdm=False))

    feat, exp = tmp_path / "feat", tmp_path / "exp"
    specs = [
        {
            "name": "sae",
            "config": {"path": str(paths["topk"]), "site": SITE, "top_k": TOP_K, "out": str(feat)},
        },
        {"name": "export", "config": {"out": str(exp), "layers": [SITE, SITE + 1]}},
    ]
    llm = engines.get(
        ("sae-topk", str(feat)),
        lambda: TllmLLM(tiny_model, specs, enable_prefix_caching=False, **ENGINE_KW),
    )

    def steer(s):
        return {"tllm_sae_steer": json.dumps([{"feature": feature, "scale": s}])}

    outs = llm.generate(
        PROMPTS, [params(), params(steer(0.0)), params(steer(scale))], use_tqdm=False
    )
    report = llm.close()
    engines.close()
    assert report["errors"] == []
    toks = _tokens(outs)
    assert toks[0] == plain_tokens[0], "an unsteered request must be identical to plain vLLM"
    assert toks[1] == plain_tokens[1], "feature steering with scale 0 must be plain vLLM"
    assert toks[2] != plain_tokens[2], "feature steering must change the text"
    c = report["consumers"]["sae"]
    # rows of the request steered with scale > 0 (scale 0 changes nothing, counts nothing)
    steered_rows = sum(
        len(outs[2].prompt_token_ids) + len(c.token_ids) - 1 for c in outs[2].outputs
    )
    assert c["rows_selected_steer"] == steered_rows == report["runtime"]["rows_edited"]
    assert "invalid_request_settings" not in c

    # the unsteered prompt's features equal the reference (top-k architecture)
    records = list(read_features(feat))
    only = {(outs[0].request_id, i) for i in range(2)}
    assert (
        check_features_against_transformers(tiny_model, paths["topk"], records, only)["checked"]
        > 20
    )

    # at the hook: the site's state is h + scale * W_dec[f]; the next layer agrees with
    # transformers run with the same addition
    vec = scale * direction
    checked = 0
    for rec in read_export(exp):
        if rec.request_id != outs[2].request_id:
            continue
        seq = rec.token_ids.tolist()
        ref = hf_states(tiny_model, seq)[f"layer.{SITE}"][rec.positions]
        torch.testing.assert_close(rec.hidden[f"layer.{SITE}"], ref + vec, rtol=1e-4, atol=1e-4)
        nxt = hf_steered_layer(tiny_model, seq, SITE, vec, SITE + 1)[rec.positions]
        torch.testing.assert_close(rec.hidden[f"layer.{SITE + 1}"], nxt, rtol=1e-4, atol=1e-4)
        unsteered_next = hf_states(tiny_model, seq)[f"layer.{SITE + 1}"][rec.positions]
        assert not torch.allclose(rec.hidden[f"layer.{SITE + 1}"], unsteered_next, atol=1e-2)
        checked += 1
    assert checked == 2


def _clamp_target(paths, x) -> tuple[object, int, float]:
    """The jumprelu SAE, its most often active feature, and a clamp value far above its range."""
    sae = load_sae(paths["jumprelu"])
    acts, _ = sae.encode(x)
    feature = int((acts > 0).float().mean(0).argmax())
    return sae, feature, 4.0 * float(acts[:, feature].max())


def _check_clamp(tiny_model, sae, feature: int, value: float, exp) -> int:
    """Each exported record's site state is h + decode(a with a_f = v) - decode(a), from
    transformers' h with the same SAE, and the next layer equals transformers' with that
    per-row edit added after the site. Returns the records checked."""
    from consumers.export import read_export

    checked = 0
    for rec in read_export(exp):
        seq = rec.token_ids.tolist()
        h = hf_states(tiny_model, seq)[f"layer.{SITE}"]
        a, state = sae.encode(h)
        target = a.clone()
        target[:, feature] = value
        delta = sae.decode(target, state) - sae.decode(a, state)
        p = rec.positions
        torch.testing.assert_close(
            rec.hidden[f"layer.{SITE}"], (h + delta)[p], rtol=1e-4, atol=1e-4
        )
        nxt = hf_steered_layer(tiny_model, seq, SITE, delta, SITE + 1)[p]
        torch.testing.assert_close(rec.hidden[f"layer.{SITE + 1}"], nxt, rtol=1e-4, atol=1e-4)
        checked += 1
    return checked


@pytest.mark.parametrize("eager", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_feature_clamp_sets_the_feature_in_the_forward(tiny_model, engines, saes, tmp_path, eager):
    """A config clamp runs in the forward: the site's state is h + decode(a with a_f = v) -
    decode(a) on every row, computed from transformers' h with the same SAE, and the next
    layer equals transformers' with that per-row edit added after the site."""
    from vllm import LLM, SamplingParams

    from tllm_core.app.engine import TllmLLM

    paths, x = saes
    sae, feature, value = _clamp_target(paths, x)
    params = SamplingParams(n=2, max_tokens=10, seed=21, temperature=1.0)
    kw = {**ENGINE_KW, "enforce_eager": eager}

    plain = engines.get(("plain", tiny_model, eager), lambda: LLM(tiny_model, **kw))
    plain_tokens = _tokens(plain.generate(PROMPTS[:2], params, use_tqdm=False))
    exp = tmp_path / "exp"
    specs = [
        {
            "name": "sae",
            "config": {
                "path": str(paths["jumprelu"]),
                "site": SITE,
                "steer": [{"feature": feature, "clamp": value}],
            },
        },
        {"name": "export", "config": {"out": str(exp), "layers": [SITE, SITE + 1]}},
    ]
    llm = engines.get(
        ("sae-clamp", str(exp)),
        lambda: TllmLLM(tiny_model, specs, enable_prefix_caching=False, **kw),
    )
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    report = llm.close()
    engines.close()
    assert report["errors"] == []
    rows = sum(len(o.prompt_token_ids) + len(c.token_ids) - 1 for o in outs for c in o.outputs)
    assert report["consumers"]["sae"]["rows_clamped"] == rows
    assert report["runtime"]["rows_edited"] == rows

    assert _check_clamp(tiny_model, sae, feature, value, exp) == 4
    assert _tokens(outs) != plain_tokens, "clamping a feature far above its range must change text"


@pytest.mark.slow  # ~50 s (V2 interpreted); V2 edits in the default suite: test_runner_v2
def test_feature_clamp_on_model_runner_v2_matches_transformers(tiny_model, saes, tmp_path):
    """The same clamp on vLLM's V2 runner (``tllm run`` under the V2 test fixture), with
    the attention and MLP outputs of the clamped layer checked against transformers too."""
    from cli_util import v2_env
    from conftest import cli_json, run_cli

    from consumers.export import read_export

    paths, x = saes
    sae, feature, value = _clamp_target(paths, x)
    exp = tmp_path / "exp"
    clamp = {
        "path": str(paths["jumprelu"]),
        "site": SITE,
        "steer": [{"feature": feature, "clamp": value}],
    }
    # attn/mlp of the clamp's layer come before the clamp (it edits the layer's output)
    export = {"out": str(exp), "layers": [SITE, SITE + 1, f"attn.{SITE}", f"mlp.{SITE}"]}
    args = ["run", "--model", tiny_model, "--consumer", f"sae:{json.dumps(clamp)}"]
    args += ["--consumer", f"export:{json.dumps(export)}", "-n", "2", "--max-tokens", "4"]
    args += ["--seed", "21", "--temperature", "1.0", "--no-prefix-caching", "--no-chat"]
    args += ["--enforce-eager", "--max-model-len", "512", "--kv-cache-gib", "1", "--json"]
    for p in PROMPTS[:2]:
        args += ["--prompt", p]
    out = cli_json(run_cli(*args, env=v2_env()))
    assert out["run"]["runner"].startswith("V2 runner"), out["run"]["runner"]
    assert out["counters"]["runtime"]["rows_edited"] == out["counters"]["sae"]["rows_clamped"] > 0
    assert _check_clamp(tiny_model, sae, feature, value, exp) == 4
    for rec in read_export(exp):
        ref = hf_states(tiny_model, rec.token_ids.tolist())
        for key in (f"attn.{SITE}", f"mlp.{SITE}"):
            torch.testing.assert_close(
                rec.hidden[key], ref[key][rec.positions], rtol=1e-4, atol=1e-4, msg=key
            )
