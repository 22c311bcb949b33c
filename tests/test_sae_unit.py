"""Unit tests of the ``sae`` consumer (no vLLM): loader, math, clamp, records, callbacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from consumers.export import format as fmt
from consumers.sae import SAEFileError, load_sae, read_features, save_sae, top_features
from consumers.sae.config import SaeRequest, parse_site
from consumers.sae.consumer import SaeConsumer
from consumers.sae.features import FeatureWriter
from consumers.sae.model import SparseAutoencoder
from consumers.sae.steer import FeatureSteer, clamp_delta
from tllm_core.api.bundles import Bundle
from tllm_core.api.consumer import ConsumerContext, ModelInfo
from tllm_core.api.edits import EditPlan
from tllm_core.api.ports import resolve_layer
from tllm_core.api.request_settings import parse_request_settings
from tllm_core.api.rows import RequestInfo, RowInfo

D_IN, D_SAE, LAYERS = 8, 24, 4


def random_sae(arch: str = "standard", seed: int = 0, **kw) -> SparseAutoencoder:
    g = torch.Generator().manual_seed(seed)
    return SparseAutoencoder(
        W_enc=torch.randn(D_IN, D_SAE, generator=g),
        b_enc=torch.randn(D_SAE, generator=g) * 0.5,
        W_dec=torch.randn(D_SAE, D_IN, generator=g),
        b_dec=torch.randn(D_IN, generator=g) * 0.3,
        architecture=arch,
        threshold=torch.rand(D_SAE, generator=g) if arch == "jumprelu" else None,
        k=5 if arch == "topk" else None,
        **kw,
    )


def reference_encode(sae: SparseAutoencoder, x: torch.Tensor) -> torch.Tensor:
    """Row by row, feature by feature: the SAELens definitions written out plainly."""
    out = torch.zeros(x.shape[0], sae.d_sae, dtype=torch.float64)
    W_enc, b_enc = sae.W_enc.double(), sae.b_enc.double()
    for r in range(x.shape[0]):
        v = x[r].double()
        if sae.normalize_activations == "layer_norm":
            mu = v.mean()
            sd = ((v - mu) ** 2).sum().div(v.numel() - 1).sqrt()
            v = (v - mu) / (sd + 1e-5)
        elif sae.normalize_activations == "constant_norm_rescale":
            v = v * (sae.d_in**0.5) / v.norm()
        if sae.apply_b_dec_to_input:
            v = v - sae.b_dec.double()
        pre = [float(v @ W_enc[:, j] + b_enc[j]) for j in range(sae.d_sae)]
        if sae.architecture == "topk" and sae.rescale_acts_by_decoder_norm:
            pre = [p * float(sae.W_dec[j].double().norm()) for j, p in enumerate(pre)]
        if sae.architecture == "standard":
            acts = [max(p, 0.0) for p in pre]
        elif sae.architecture == "jumprelu":
            acts = [p if p > float(sae.threshold[j]) and p > 0 else 0.0 for j, p in enumerate(pre)]
        else:
            top = sorted(range(sae.d_sae), key=lambda j: -pre[j])[: sae.k]
            acts = [max(pre[j], 0.0) if j in top else 0.0 for j in range(sae.d_sae)]
        out[r] = torch.tensor(acts, dtype=torch.float64)
    return out


CASES = [
    ("standard", {}),
    ("standard", {"apply_b_dec_to_input": False}),
    ("standard", {"normalize_activations": "layer_norm"}),
    ("jumprelu", {}),
    ("jumprelu", {"normalize_activations": "constant_norm_rescale"}),
    ("topk", {}),
    ("topk", {"rescale_acts_by_decoder_norm": True}),
]


@pytest.mark.parametrize("arch,kw", CASES)
def test_encode_matches_a_plain_reference_and_decode_round_trips_through_disk(arch, kw, tmp_path):
    sae = random_sae(arch, **kw)
    x = torch.randn(7, D_IN, generator=torch.Generator().manual_seed(3)) * 2
    acts, state = sae.encode(x)
    torch.testing.assert_close(acts.double(), reference_encode(sae, x), rtol=1e-5, atol=1e-5)
    assert (acts > 0).any() and (acts == 0).any()
    if arch == "topk":
        assert ((acts > 0).sum(-1) <= 5).all()
    # decode: W_dec, b_dec, the per-row normalization undone
    y = acts.double() / (
        sae.W_dec.double().norm(dim=-1) if kw.get("rescale_acts_by_decoder_norm") else 1
    )
    y = y @ sae.W_dec.double() + sae.b_dec.double()
    if sae.normalize_activations == "layer_norm":
        mu, sd = x.double().mean(-1, keepdim=True), x.double().std(-1, keepdim=True)
        y = y * (sd + 1e-5) + mu
    elif sae.normalize_activations == "constant_norm_rescale":
        y = y * x.double().norm(dim=-1, keepdim=True) / sae.d_in**0.5
    torch.testing.assert_close(sae.decode(acts, state).double(), y, rtol=1e-5, atol=1e-5)
    # the same SAE after save_sae / load_sae
    loaded = load_sae(save_sae(sae, tmp_path / "sae"), d_model=D_IN)
    assert loaded.architecture == arch and loaded.k == sae.k
    assert loaded.normalize_activations == sae.normalize_activations
    torch.testing.assert_close(loaded.encode(x)[0], acts)


def test_top_features_sorted_with_unused_slots_marked():
    acts = torch.tensor([[0.0, 3.0, 0.0, 1.0, 2.0], [0.0, 0.0, 0.5, 0.0, 0.0]])
    idx, val = top_features(acts, 3)
    assert idx.dtype == torch.int32 and idx.tolist() == [[1, 4, 3], [2, -1, -1]]
    assert val.tolist() == [[3.0, 2.0, 1.0], [0.5, 0.0, 0.0]]
    idx, val = top_features(acts, 7)  # more slots than features: padded
    assert idx.shape == (2, 7) and idx[0, 3:].tolist() == [-1] * 4


# -- loader: bad files ---------------------------------------------------------------------
def write_folder(tmp_path: Path, arch: str = "jumprelu", **kw) -> Path:
    return Path(save_sae(random_sae(arch, **kw), tmp_path / "sae"))


def edit_cfg(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "cfg.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "cfg.json").write_text(json.dumps(cfg))


def edit_weights(folder: Path, drop: str | None = None, **replace) -> None:
    t = load_file(folder / "sae_weights.safetensors")
    if drop:
        del t[drop]
    t.update(replace)
    save_file(t, folder / "sae_weights.safetensors")


BAD = [
    ("missing cfg", lambda f: os.remove(f / "cfg.json"), ["cfg.json is missing"]),
    ("missing weights", lambda f: os.remove(f / "sae_weights.safetensors"), ["sae_weights"]),
    ("not json", lambda f: (f / "cfg.json").write_text("{"), ["not valid JSON"]),
    (
        "missing threshold",
        lambda f: edit_weights(f, drop="threshold"),
        ["missing tensor", "threshold"],
    ),
    ("missing W_dec", lambda f: edit_weights(f, drop="W_dec"), ["missing tensor", "W_dec"]),
    (
        "wrong shape",
        lambda f: edit_weights(f, W_enc=torch.zeros(D_IN, D_SAE + 1)),
        ["W_enc", f"[{D_IN}, {D_SAE + 1}]", f"expected [{D_IN}, {D_SAE}]"],
    ),
    (
        "nan",
        lambda f: edit_weights(f, b_dec=torch.full((D_IN,), float("nan"))),
        ["b_dec", "non-finite"],
    ),
    (
        "bad arch",
        lambda f: edit_cfg(f, architecture="gated"),
        ["'architecture'", "gated", "jumprelu"],
    ),
    ("no d_in", lambda f: edit_cfg(f, d_in=None), ["'d_in'", "positive integer"]),
    (
        "unfolded norm",
        lambda f: edit_cfg(f, normalize_activations="expected_average_only_in"),
        ["'normalize_activations'", "expected_average_only_in", "fold"],
    ),
    ("hook_z", lambda f: edit_cfg(f, reshape_activations="hook_z"), ["'reshape_activations'"]),
]


@pytest.mark.parametrize("name,break_it,words", BAD, ids=[b[0] for b in BAD])
def test_bad_sae_folders_fail_naming_what_is_wrong(name, break_it, words, tmp_path):
    folder = write_folder(tmp_path)
    load_sae(folder, d_model=D_IN)  # fine before breaking it
    break_it(folder)
    with pytest.raises(SAEFileError) as e:
        load_sae(folder, d_model=D_IN)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_wrong_d_in_and_topk_without_k(tmp_path):
    folder = write_folder(tmp_path, "standard")
    with pytest.raises(
        SAEFileError, match=rf"d_in={D_IN} does not match the model's hidden size 16"
    ):
        load_sae(folder, d_model=16)
    folder = write_folder(tmp_path / "t", "topk")
    edit_cfg(folder, k=None)
    with pytest.raises(SAEFileError, match="'k' must be a positive integer"):
        load_sae(folder)


def test_pre_6_config_names_and_log_threshold_are_read(tmp_path):
    folder = write_folder(tmp_path, "topk")
    edit_cfg(
        folder, architecture=None, k=None, activation_fn_str="topk", activation_fn_kwargs={"k": 3}
    )
    assert load_sae(folder).k == 3 and load_sae(folder).architecture == "topk"
    folder = write_folder(tmp_path / "j", "jumprelu")
    thr = load_file(folder / "sae_weights.safetensors")["threshold"]
    edit_weights(folder, drop="threshold", log_threshold=thr.log())
    torch.testing.assert_close(load_sae(folder).threshold, thr)


# -- clamp ---------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["none", "layer_norm"])
def test_clamp_delta_is_the_difference_of_two_decodes(norm):
    sae = random_sae("standard", normalize_activations=norm)
    x = torch.randn(6, D_IN, generator=torch.Generator().manual_seed(1)) * 2
    acts, _ = sae.encode(x)
    f = int(acts.sum(0).argmax())  # a feature that fires somewhere
    delta = clamp_delta(sae, x, [(f, 4.0)])
    # independent reference: decoding is linear in a_f, so the change is (v - a_f) W_dec[f],
    # rescaled by the row's layer-norm std when the SAE normalizes its input
    expect = (4.0 - acts[:, f : f + 1]) * sae.W_dec[f]
    if norm == "layer_norm":
        expect = expect * (x.std(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(delta, expect, rtol=1e-4, atol=1e-5)
    # clamping to the value a row already has changes nothing
    same = clamp_delta(sae, x[:1], [(f, float(acts[0, f]))])
    assert float(same.abs().max()) < 1e-5
    assert clamp_delta(sae, x, []).abs().max() == 0


def test_feature_steer_entries_need_exactly_one_kind():
    FeatureSteer(feature=1, scale=0.0)
    for bad in (
        {"feature": 1},
        {"feature": 1, "scale": 1, "clamp": 2},
        {"feature": -1, "scale": 1},
    ):
        with pytest.raises(ValueError):
            FeatureSteer.model_validate(bad)
    with pytest.raises(ValueError, match="finite"):
        FeatureSteer(feature=1, scale=float("inf"))


def test_site_parsing():
    assert str(parse_site(2)) == "layer.2" and parse_site("-1").layer == -1
    assert str(parse_site("attn.3")) == "attn.3" and parse_site("mlp.-2").prefix == "mlp"
    assert parse_site("layer.4").short() == "4" and parse_site("attn.4").short() == "attn.4"
    for bad in ("final", "attn", "resid.1", "1.5", True):
        with pytest.raises(ValueError, match="attn"):
            parse_site(bad)


# -- records: writer / reader ----------------------------------------------------------------
def req(i: int, n_prompt: int = 3, **extra) -> RequestInfo:
    return RequestInfo(
        engine_id=f"{i}-abc",
        request_id=str(i),
        prompt_index=i,
        sample_index=0,
        num_prompt_tokens=n_prompt,
        extra_args=dict(extra),
    )


def test_feature_records_round_trip_across_shards(tmp_path):
    out = tmp_path / "feat"
    w = FeatureWriter(str(out), 3, "float16", 4, False, lambda: {"site": "1"})
    a, b = req(0), req(1)
    g = torch.Generator().manual_seed(0)
    expected = {}
    for rs, pos in [([a, a, a, b, b], [0, 1, 2, 0, 1]), ([a, b], [3, 2])]:
        n = len(rs)
        idx = torch.randint(0, 50, (n, 3), generator=g, dtype=torch.int64).to(torch.int32)
        val = torch.rand(n, 3, generator=g).half()
        toks = np.array([10 * r.prompt_index + p for r, p in zip(rs, pos, strict=True)])
        w.append(rs, np.array(pos), toks, np.array(pos) >= 3, idx, val)
        for j, r in enumerate(rs):
            expected[(r.request_id, pos[j])] = (idx[j].tolist(), val[j].tolist())
    w.note_tokens([a], np.array([4]), np.array([99]))  # a sampled token, never fed
    w.finished(a)
    w.close()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "tllm-sae-features" and len(manifest["shards"]) == 2
    recs = {r.request_id: r for r in read_features(out, verify=True)}
    assert recs["0"].token_ids.tolist() == [0, 1, 2, 3, 99] and recs["0"].finished
    assert recs["1"].token_ids.tolist() == [10, 11, 12] and not recs["1"].finished
    for r in recs.values():
        assert r.indices.dtype == torch.int32 and r.values.dtype == torch.float16
        assert r.positions.tolist() == sorted(r.positions.tolist())
        for j, p in enumerate(r.positions.tolist()):
            assert (r.indices[j].tolist(), r.values[j].tolist()) == expected[(r.request_id, p)]
    assert sum(len(r.positions) for r in recs.values()) == 7


# -- the consumer's callbacks (hand-made bundles) ----------------------------------------------
def ctx(hidden: int = D_IN) -> ConsumerContext:
    model = ModelInfo(
        hidden_size=hidden,
        num_layers=LAYERS,
        vocab_size=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
        lm_head=lambda h: h,
        lm_head_weight=None,
    )
    return ConsumerContext(model, lambda i: resolve_layer(i, LAYERS))


def make(tmp_path, **cfg) -> SaeConsumer:
    folder = tmp_path / "sae"
    if not folder.exists():
        save_sae(random_sae("standard"), folder)
    return SaeConsumer(SaeConsumer.Config(path=str(folder), **cfg), ctx())


def rows_of(reqs: list[RequestInfo], positions: list[int]) -> RowInfo:
    n = len(reqs)
    return RowInfo(
        row=np.arange(n),
        requests=reqs,
        position=np.array(positions),
        is_decode=np.array(
            [p >= r.num_prompt_tokens for r, p in zip(reqs, positions, strict=True)]
        ),
        recomputed=np.zeros(n, np.bool_),
        token_ids=torch.arange(n) + 5,
    )


def test_summary_counters_and_records_equal_the_sae_on_the_rows(tmp_path):
    c = make(
        tmp_path, site=1, top_k=4, out=str(tmp_path / "f"), watch=[0, 3], values_dtype="float32"
    )
    sae = load_sae(tmp_path / "sae")
    a, b = req(0), req(1)
    rows = rows_of([a, a, b], [0, 1, 0])
    x = torch.randn(3, D_IN, generator=torch.Generator().manual_seed(2)) * 2
    c.on_bundle(Bundle(step=0, rows=rows, hidden={"layer.1": x}))
    c.close()
    acts, st = sae.encode(x)
    snap = c.counters.snapshot()
    assert snap["rows_encoded"] == 3 and snap["rows_recorded"] == 3
    assert snap["active_features"] == int((acts > 0).sum())
    for f in (0, 3):
        assert snap.get(f"watch_fired.{f}", 0) == int((acts[:, f] > 0).sum())
    res = c.result()
    rel = float(((x - sae.decode(acts, st)) ** 2).sum() / (x**2).sum())
    assert res["relative_mse"] == pytest.approx(rel, rel=1e-5)
    assert res["mean_l0"] == pytest.approx(float((acts > 0).sum()) / 3)
    # 4 x (int32 + fp32) + row tensors (3 x int64 + bool), against 8 x fp32 + row tensors
    assert res["bytes_per_row"] == {"features": 4 * 8 + 25, "dense_float32": 8 * 4 + 25}
    recs = {r.request_id: r for r in read_features(tmp_path / "f")}
    idx, val = top_features(acts, 4)
    assert recs["0"].indices.tolist() == idx[:2].tolist()
    torch.testing.assert_close(recs["1"].values, val[2:])


def test_decode_phase_records_carry_the_whole_token_sequence(tmp_path):
    """Only decode rows are encoded and recorded, yet each record's token ids are the whole
    sequence: prompt ids come from the (unrecorded) prefill rows, the last one from the
    sampled token of the final step."""
    c = make(tmp_path, site=1, top_k=2, out=str(tmp_path / "f"), phase="decode")
    a, b = req(0, n_prompt=2), req(1, n_prompt=2)
    g = torch.Generator().manual_seed(1)

    def step(i, reqs, positions, fed, sampled):
        rows = rows_of(reqs, positions)
        rows.token_ids = torch.tensor(fed)
        last = [j for j in range(len(reqs)) if j == len(reqs) - 1 or reqs[j + 1] is not reqs[j]]
        c.on_bundle(
            Bundle(
                step=i,
                rows=rows,
                hidden={"layer.1": torch.randn(len(reqs), D_IN, generator=g)},
                sampled_rows=rows.take(np.array(last)),
                per_sample={"sampled": torch.tensor(sampled)},
            )
        )

    step(0, [a, a, b, b], [0, 1, 0, 1], [10, 11, 20, 21], [12, 22])  # prefill
    step(1, [a, b], [2, 2], [12, 22], [13, 23])
    step(2, [a, b], [3, 3], [13, 23], [14, 24])
    c.close()
    assert c.counters.get("rows_recorded") == 4  # decode rows only
    recs = {r.request_id: r for r in read_features(tmp_path / "f")}
    assert recs["0"].token_ids.tolist() == [10, 11, 12, 13, 14]
    assert recs["1"].token_ids.tolist() == [20, 21, 22, 23, 24]
    assert recs["0"].positions.tolist() == [2, 3]


def test_steering_plans_scale_times_decoder_row_and_per_request_settings(tmp_path):
    c = make(tmp_path, site=-2, steer=[{"feature": 3, "scale": 2.0}])
    sae = load_sae(tmp_path / "sae")
    off = req(1, tllm_sae_steer="[]")
    other = req(2, tllm_sae_steer=json.dumps([{"feature": 5, "scale": -1.0}]))
    bad = req(3, tllm_sae_steer=[{"feature": D_SAE, "scale": 1.0}])
    rows = rows_of([req(0), req(0), off, other, bad], [0, 1, 0, 0, 0])
    rows.requests[1] = rows.requests[0]
    plan = EditPlan(rows, {"layer.2": "residual.2"}, D_IN)
    c.edit(rows, plan)
    ((r, kind, value),) = plan.ops["layer.2"]
    assert kind == "add" and r.tolist() == [0, 1, 3]
    torch.testing.assert_close(value[0], 2.0 * sae.W_dec[3])
    torch.testing.assert_close(value[2], -1.0 * sae.W_dec[5])
    snap = c.counters.snapshot()
    assert snap["rows_selected_steer"] == 3 and snap["invalid_request_settings"] == 1
    assert c.writes()[0].layer == 2


def test_a_steered_requests_first_edit_does_not_wait_for_the_device(tmp_path):
    """A request's steering vector is made at its first edit, inside the engine's step: on the
    fake CUDA device that edit reads nothing back and copies nothing from pageable memory
    (the vector, and whether it is all zeros, come from the SAE's host copy)."""
    from tllm_core.testing.fake_cuda import FakeCuda

    c = make(tmp_path, site=-2, steer=[{"feature": 3, "scale": 2.0}])
    own = req(1, tllm_sae_steer=json.dumps([{"feature": 5, "scale": -1.0}]))
    zero = req(2, tllm_sae_steer=json.dumps([{"feature": 5, "scale": 0.0}]))
    with FakeCuda() as fc:
        c.sae_dev = c.sae.to(fc.device)  # as on a GPU (a meta model is the front end's dry build)
        c._config_vector = c._vector(c.config.steer)
        rows = rows_of([req(0), own, zero], [0, 0, 0])
        plan = EditPlan(rows, {"layer.2": "residual.2"}, D_IN)
        with fc.step():
            c.edit(rows, plan)
    assert fc.findings(kind="host_wait") == fc.findings(kind="pageable_copy") == []
    ((r, kind, value),) = plan.ops["layer.2"]
    assert r.tolist() == [0, 1] and value.device == fc.device  # the all-zero one: not planned


CONFIG_ERRORS = [
    ({"site": 9}, "out of range"),
    ({"steer": [{"feature": D_SAE, "scale": 1.0}]}, f"the SAE has {D_SAE} features"),
    ({"watch": [-1]}, "watch[0]"),
]


@pytest.mark.parametrize("cfg,words", CONFIG_ERRORS)
def test_bad_config_fails_at_construction(cfg, words, tmp_path):
    with pytest.raises(ValueError) as e:
        make(tmp_path, **cfg)
    assert words in str(e.value)


def test_sae_for_another_hidden_size_fails_at_construction(tmp_path):
    save_sae(random_sae(), tmp_path / "sae")
    with pytest.raises(ValueError, match="d_in=8 does not match the model's hidden size 16"):
        SaeConsumer(SaeConsumer.Config(path=str(tmp_path / "sae")), ctx(hidden=16))


# -- interop with SAELens itself ---------------------------------------------------------------
SAE_LENS_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from sae_lens import (JumpReLUSAE, JumpReLUSAEConfig, StandardSAE, StandardSAEConfig,
                          TopKSAE, TopKSAEConfig, SAE)
    out = sys.argv[1]
    torch.manual_seed(0)
    x = torch.randn(9, 16) * 3
    cases = {
        "standard": StandardSAE(StandardSAEConfig(d_in=16, d_sae=40)),
        "jumprelu": JumpReLUSAE(JumpReLUSAEConfig(d_in=16, d_sae=40)),
        "topk": TopKSAE(TopKSAEConfig(d_in=16, d_sae=40, k=6, rescale_acts_by_decoder_norm=True)),
        "layer_norm": StandardSAE(StandardSAEConfig(d_in=16, d_sae=40, normalize_activations="layer_norm",
                                                    apply_b_dec_to_input=False)),
    }
    res = {"x": x.tolist()}
    for name, sae in cases.items():
        with torch.no_grad():
            for p in sae.parameters():
                p.copy_(torch.randn_like(p) * 0.5)
            if name == "jumprelu":
                sae.threshold.copy_(torch.rand_like(sae.threshold))
            sae.save_model(f"{out}/{name}")
            acts = sae.encode(x)
            res[name] = {"acts": acts.tolist(), "recon": sae.decode(acts).tolist()}
    # and the other way round: SAELens loads a folder written by tllm
    ours = SAE.load_from_disk(f"{out}/ours")
    res["ours"] = ours.encode(x).tolist()
    json.dump(res, open(f"{out}/result.json", "w"))
    """
)


# Where ``install.sh --test`` puts SAELens (a side environment that sees this one's torch).
SAE_LENS_ENV = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tllm" / "sae-lens-venv"
)


def _sae_lens_python() -> str | None:
    """An interpreter with SAELens: $TLLM_SAE_LENS_PYTHON, install.sh's side environment,
    or this one."""
    env = os.environ.get("TLLM_SAE_LENS_PYTHON")
    if env:
        return env
    side = SAE_LENS_ENV / "bin" / "python"
    if side.exists():
        return str(side)
    try:
        import sae_lens  # noqa: F401
    except ImportError:
        return None
    return sys.executable


def test_saes_written_by_sae_lens_load_and_encode_identically(tmp_path):
    python = _sae_lens_python()
    if python is None:
        msg = f"sae-lens not installed (bash install.sh --test puts it in {SAE_LENS_ENV})"
        if os.environ.get("CI"):  # CI installs it: there a missing SAELens is a failure
            pytest.fail(msg)
        pytest.skip(msg)
    ours = random_sae("jumprelu")
    ours.W_enc = torch.randn(16, 40)
    ours.W_dec = torch.randn(40, 16)
    ours.b_dec = torch.randn(16)
    ours.b_enc = torch.randn(40)
    ours.threshold = torch.rand(40)
    save_sae(ours, tmp_path / "ours")
    proc = subprocess.run(
        [python, "-c", SAE_LENS_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "result.json").read_text())
    x = torch.tensor(res["x"])
    for name in ("standard", "jumprelu", "topk", "layer_norm"):
        sae = load_sae(tmp_path / name, d_model=16)
        acts, st = sae.encode(x)
        assert (acts > 0).any()
        torch.testing.assert_close(acts, torch.tensor(res[name]["acts"]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            sae.decode(acts, st), torch.tensor(res[name]["recon"]), rtol=1e-5, atol=1e-4
        )
    torch.testing.assert_close(ours.encode(x)[0], torch.tensor(res["ours"]), rtol=1e-5, atol=1e-5)


def test_clamp_runs_in_the_tap_and_sets_the_feature(tmp_path):
    """A config clamp is an in-graph transform on the site's tap: selected rows get the
    decoded difference of setting the feature; other rows are untouched."""
    from tllm_core.api.edits import EditBuffers
    from tllm_core.vllm_bridge.sites import OutputTap, TapBuffers

    c = make(tmp_path, site=2, steer=[{"feature": 3, "clamp": 2.5}])
    (port,) = c.writes()
    assert port.transform is not None
    req = RequestInfo("r-abcdefgh", "r", 0, 0, 2)
    plain = RequestInfo("p-abcdefgh", "p", 1, 0, 2, extra_args={"tllm_sae_steer": "[]"})
    rows = rows_of([req, req, plain], [0, 1, 0])
    plan = EditPlan(rows, {"layer.2": "residual.2"}, D_IN, transforms={"layer.2"})
    c.edit(rows, plan)
    assert c.counters.get("rows_clamped") == 0  # planned is not done
    buf = EditBuffers(3, D_IN, torch.float32, torch.device("cpu"))
    buf.add_transform("sae", port.transform)
    buf.write(plan.ops["layer.2"], "sae")
    tap = TapBuffers(
        None, buf, torch.tensor([1]), torch.tensor([0]), torch.zeros(1, dtype=torch.int64)
    )
    x = torch.randn(3, D_IN, generator=torch.Generator().manual_seed(5))
    y = OutputTap(torch.nn.Identity(), tap)(x)
    # encode, set feature 3 to 2.5, add the decoded difference (a plain reference)
    acts, state = c.sae.encode(x[:2])
    target = acts.clone()
    target[:, 3] = 2.5
    want = x[:2] + c.sae.decode(target, state) - c.sae.decode(acts, state)
    torch.testing.assert_close(y[:2], want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(y[:2], x[:2])
    assert torch.equal(y[2], x[2])  # the request that turned steering off
    c.result()  # the consumer reads the forward's own count between forwards
    assert c.counters.get("rows_clamped") == 2 and tap.edited.item() == 2
    with pytest.raises(ValueError, match="config 'steer' only"):
        parse_request_settings(
            "sae", SaeRequest, {"tllm_sae_steer": '[{"feature": 3, "clamp": 1}]'}, config=c.config
        )


def test_request_feature_out_of_range_is_refused_by_the_front_end_check(tmp_path):
    """The one validation the server (HTTP 400) and TllmLLM run: it reads d_sae from the
    SAE folder the consumer's config names, so a bad index never reaches the engine."""
    from tllm_core.api.consumer_spec import ConsumerSpec
    from tllm_core.plugins.registry import Registry
    from tllm_core.serving.keys import EngineConsumers, validate_extra_args

    folder = tmp_path / "sae"
    save_sae(random_sae("standard"), folder)
    spec = ConsumerSpec(name="sae", config={"path": str(folder)})
    registry = Registry()
    engine = EngineConsumers.of([spec], registry.check([spec]), registry)
    good = json.dumps([{"feature": D_SAE - 1, "scale": 1.0}])
    validate_extra_args({"tllm_sae_steer": good}, engine)
    bad = json.dumps([{"feature": D_SAE, "scale": 1.0}])
    with pytest.raises(ValueError, match=rf"tllm_sae_steer.*{D_SAE}.*valid: 0\.\.{D_SAE - 1}"):
        validate_extra_args({"tllm_sae_steer": bad}, engine)
    # the engine's own parse (a request that bypassed the front end) refuses it the same way
    c = make(tmp_path)
    r = req(1, tllm_sae_steer=bad)
    with pytest.raises(ValueError, match="valid: 0"):
        r.settings(c)
    # recording asked for where the config gives no folder to record into
    with pytest.raises(ValueError, match="tllm_sae_record.*no 'out' folder"):
        validate_extra_args({"tllm_sae_record": "true"}, engine)
    validate_extra_args({"tllm_sae_record": "false"}, engine)


@pytest.mark.parametrize("arch", ["standard", "jumprelu", "topk"])
def test_sparse_decode_equals_dense_decode(arch):
    sae = random_sae(arch, seed=4, normalize_activations="layer_norm")
    x = torch.randn(6, D_IN, generator=torch.Generator().manual_seed(2))
    acts, state = sae.encode(x)
    sparse = torch.zeros_like(acts)
    sparse[:, 3] = 1.5  # one of D_SAE features active (at most 1/16): the CSR path
    for a in (acts, sparse):
        torch.testing.assert_close(sae.decode_sparse(a, state), sae.decode(a, state))


@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("top_k", [3, 5, 9])
def test_topk_codes_equal_the_dense_activations(rescale, top_k):
    """The consumer's top-k path (codes, never a dense [R, d_sae] tensor) gives what the
    dense definitions give: activations, reconstruction, recorded top features, counters."""
    from consumers.sae.consumer import _Codes
    from consumers.sae.model import top_codes

    sae = random_sae(
        "topk", seed=6, normalize_activations="layer_norm", rescale_acts_by_decoder_norm=rescale
    )
    x = torch.randn(7, D_IN, generator=torch.Generator().manual_seed(3))
    acts, state = sae.encode(x)
    idx, vals, st = sae.encode_codes(x)
    dense = torch.zeros_like(acts).scatter_(-1, idx, vals)
    torch.testing.assert_close(dense, acts)
    torch.testing.assert_close(sae.decode_codes(idx, vals, st), sae.decode(acts, state))
    i_ref, v_ref = top_features(acts, top_k)
    i, v = top_codes(idx, vals, top_k)
    assert torch.equal(i, i_ref) and torch.equal(v, v_ref)

    watch = [int(idx[0, 0]), int(idx[1, 2]), D_SAE - 1]
    fast = _Codes.encode(sae, x, watch)
    assert fast.dense is None  # the codes path was taken
    active = acts > 0
    want = [active.sum(), ((x - sae.decode(acts, state)) ** 2).sum(), (x**2).sum()]
    want += [active[:, f].sum() for f in watch]
    torch.testing.assert_close(fast.stats, torch.stack([w.float() for w in want]))
    rows = np.array([1, 4, 6])
    i, v = fast.top(top_k, rows)
    i_ref, v_ref = top_features(acts[rows], top_k)
    assert torch.equal(i, i_ref) and torch.equal(v, v_ref)


def test_feature_records_say_when_they_are_not_complete(tmp_path):
    """A request cut short (aborted) or a dropped bundle: ``complete: false`` with the losses;
    the reader warns. All requests finished on their own: complete."""
    from consumers.export import IncompleteExportWarning

    def run(name, cut_short=False, drop=False):
        w = FeatureWriter(str(tmp_path / name), 2, "float32", 4, False, lambda: {})
        a, b = req(0), req(1)
        idx, val = torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2)
        w.append([a, a, b], np.array([0, 1, 0]), np.array([5, 6, 7]), np.zeros(3, bool), idx, val)
        b.cut_short = cut_short
        if drop:
            w.dropped([b])
        w.finished(a)
        w.finished(b)
        w.close()
        return json.loads((tmp_path / name / "manifest.json").read_text())

    m = run("whole")
    assert m["complete"] is True and not any(m["losses"].values())
    m = run("cut", cut_short=True)
    assert m["complete"] is False and m["losses"]["requests_unfinished"] == 1
    table = fmt.request_table(str(tmp_path / "cut"), m)
    assert [r["finished"] for r in table] == [True, False]
    m = run("drop", drop=True)
    assert m["complete"] is False and m["losses"]["bundles_dropped"] == 1
    with pytest.warns(IncompleteExportWarning, match="bundles_dropped: 1"):
        list(read_features(tmp_path / "drop"))


def test_a_bundle_without_the_site_fails_naming_it(tmp_path):
    """A tap the step did not write leaves its port out of the bundle (see StaleTapError)."""
    c = make(tmp_path, site=1, top_k=4)
    with pytest.raises(ValueError, match=r"sae: bundle lacks 'layer.1' \(has \['layer.0'\]\)"):
        c.on_bundle(
            Bundle(step=0, rows=rows_of([req(0)], [0]), hidden={"layer.0": torch.zeros(1, D_IN)})
        )
