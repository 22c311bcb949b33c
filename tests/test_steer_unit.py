"""Unit tests of the ``steer`` consumer and ``load_vector`` (no vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from consumers.steer import load_vector
from consumers.steer.consumer import SteerConfig, SteerConsumer
from tllm_core.api.consumer import ConsumerContext, ModelInfo
from tllm_core.api.edits import EditBuffers, EditPlan
from tllm_core.api.ports import ResidualEdit, resolve_layer
from tllm_core.api.rows import RequestInfo, RowInfo

H = 8
NUM_LAYERS = 4


def context(device: str = "cpu", per_request: bool = False) -> ConsumerContext:
    info = ModelInfo(
        hidden_size=H,
        num_layers=NUM_LAYERS,
        vocab_size=64,
        dtype=torch.float32,
        device=torch.device(device),
        lm_head=lambda h: h,
        lm_head_weight=None,
    )
    return ConsumerContext(
        model=info,
        resolve_layer=lambda i: resolve_layer(i, NUM_LAYERS),
        per_request=per_request,
    )


def steer(device: str = "cpu", per_request: bool = False, **cfg) -> SteerConsumer:
    return SteerConsumer(SteerConfig(**cfg), context(device, per_request))


def vec(seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, generator=g).tolist()


def request(i: int, n_prompt: int, **extra) -> RequestInfo:
    return RequestInfo(
        engine_id=f"e{i}",
        request_id=f"r{i}",
        prompt_index=i,
        sample_index=0,
        num_prompt_tokens=n_prompt,
        extra_args=dict(extra),
    )


def make_rows(spec: list[tuple[RequestInfo, list[int]]]) -> RowInfo:
    reqs, pos = [], []
    for req, positions in spec:
        reqs += [req] * len(positions)
        pos += positions
    p = np.array(pos, np.int64)
    n_prompt = np.array([r.num_prompt_tokens for r in reqs], np.int64)
    return RowInfo(
        row=np.arange(len(pos), dtype=np.int64),
        requests=reqs,
        position=p,
        is_decode=p >= n_prompt,
        recomputed=np.zeros(len(pos), bool),
        token_ids=torch.zeros(len(pos), dtype=torch.int64),
    )


def plan_for(c: SteerConsumer, rows: RowInfo) -> EditPlan:
    layers = {w.layer for w in c.writes() if isinstance(w, ResidualEdit)}
    plan = EditPlan(rows, {f"layer.{i}": f"residual.{i}" for i in layers}, H)
    c.edit(rows, plan)
    return plan


def rows_in(plan: EditPlan, layer: int) -> list[int]:
    return sorted({int(r) for rows, _, _ in plan.ops.get(f"layer.{layer}", []) for r in rows})


# rows 0-2: prompt of r0 (prefill), row 3: decode of r1, row 4: decode of r2, rows 5-6: prompt of r3
def mixed_rows(extras: dict[int, dict] | None = None) -> RowInfo:
    extras = extras or {}
    r = [request(i, n, **extras.get(i, {})) for i, n in enumerate([3, 2, 2, 5])]
    return make_rows([(r[0], [0, 1, 2]), (r[1], [4]), (r[2], [2]), (r[3], [0, 1])])


# -- load_vector -------------------------------------------------------------------------------
def test_load_vector_formats(tmp_path):
    v = torch.arange(H, dtype=torch.float32)
    save_file({"v": v}, str(tmp_path / "one.safetensors"))
    save_file({"a": v, "b": 2 * v}, str(tmp_path / "two.safetensors"))
    torch.save(v.double(), tmp_path / "t.pt")
    torch.save({"dir": v}, tmp_path / "d.pt")
    torch.save({"x": v, "y": -v}, tmp_path / "dd.pth")
    np.save(tmp_path / "n.npy", v.numpy().astype(np.float16))
    for p in ["one.safetensors", "two.safetensors::b", "t.pt", "d.pt", "dd.pth::y", "n.npy"]:
        out = load_vector(str(tmp_path / p), H)
        assert out.dtype == torch.float32 and out.shape == (H,)
    torch.testing.assert_close(load_vector(str(tmp_path / "two.safetensors::b"), H), 2 * v)
    torch.testing.assert_close(load_vector(tmp_path / "dd.pth::y", H), -v)


def test_load_vector_errors(tmp_path):
    v = torch.ones(H)
    save_file({"a": v, "b": v.clone()}, str(tmp_path / "two.safetensors"))
    save_file({"m": torch.ones(2, H)}, str(tmp_path / "mat.safetensors"))
    np.save(tmp_path / "short.npy", np.ones(H - 1, np.float32))
    np.save(tmp_path / "nan.npy", np.full(H, np.nan, np.float32))
    torch.save(v, tmp_path / "t.pt")
    (tmp_path / "v.txt").write_text("1 2 3")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    cases = [
        ("missing.safetensors", "does not exist"),
        ("two.safetensors", r"holds 2 tensors \(a, b\).*PATH::KEY"),
        ("two.safetensors::c", "no tensor named 'c'.*a, b"),
        ("mat.safetensors", r"1-D vector of size 8.*\(2, 8\)"),
        ("short.npy", r"size 8.*\(7,\)"),
        ("nan.npy", "NaN"),
        ("t.pt::k", "not a dict"),
        ("short.npy::k", "needs a .safetensors or .pt"),
        ("v.txt", "unsupported file type '.txt'"),
        ("bad.safetensors", "cannot read"),
    ]
    for name, msg in cases:
        with pytest.raises(ValueError, match=msg):
            load_vector(str(tmp_path / name), H)
    with pytest.raises(ValueError, match="is not a file"):
        load_vector(str(tmp_path), H)


# -- config ------------------------------------------------------------------------------------
def test_config_validation(tmp_path):
    np.save(tmp_path / "v.npy", np.ones(H, np.float32))
    np.save(tmp_path / "w.npy", np.ones(H + 1, np.float32))
    c = steer(vectors=[{"layer": -1, "path": str(tmp_path / "v.npy"), "scale": 0.0}])
    assert c.writes() == [ResidualEdit(NUM_LAYERS - 1)]
    with pytest.raises(ValueError, match=r"vectors\[0\].layer.*out of range"):
        steer(vectors=[{"layer": NUM_LAYERS, "vector": vec()}])
    with pytest.raises(ValueError, match=r"vectors\[0\].path.*size 8"):
        steer(vectors=[{"layer": 0, "path": str(tmp_path / "w.npy")}])
    with pytest.raises(ValueError, match="does not exist"):
        steer(vectors=[{"layer": 0, "path": str(tmp_path / "nope.npy")}])
    with pytest.raises(ValueError, match="size 8"):
        steer(vectors=[{"layer": 0, "vector": [1.0, 2.0]}])
    with pytest.raises(ValidationError, match="exactly one of"):
        SteerConfig(vectors=[{"layer": 0}])
    with pytest.raises(ValidationError, match="exactly one of"):
        SteerConfig(vectors=[{"layer": 0, "vector": vec(), "path": "x.npy"}])
    with pytest.raises(ValidationError):
        SteerConfig(vectors=[{"layer": 0, "vector": vec(), "mode": "subtract"}])
    with pytest.raises(ValidationError):
        SteerConfig(vectors=[{"layer": 0, "vector": vec(), "sclae": 2}])
    with pytest.raises(ValidationError):
        SteerConfig(vectors=[])
    with pytest.raises(ValidationError):
        SteerConfig(vectors=[{"layer": 0, "vector": vec()}], positions="decode")
    with pytest.raises(ValueError, match="both ablate at layer 1"):
        steer(
            vectors=[
                {"layer": 1, "vector": vec(), "mode": "ablate"},
                {"layer": -3, "vector": vec(1), "mode": "ablate"},
            ]
        )
    with pytest.raises(ValueError, match="all zeros"):
        steer(vectors=[{"layer": 1, "vector": [0.0] * H, "mode": "ablate"}])
    # The dry build runs on the meta device: vectors stay usable.
    steer(device="meta", vectors=[{"layer": 1, "vector": vec()}]).close()


# -- edit selection --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "positions,want",
    [("all", [0, 1, 2, 3, 4, 5, 6]), ("prompt", [0, 1, 2, 5, 6]), ("generated", [3, 4])],
)
def test_positions_select_rows(positions, want):
    c = steer(
        vectors=[
            {"layer": 1, "vector": vec(), "scale": 2.0},
            {"layer": 3, "vector": vec(1), "mode": "ablate"},
        ],
        positions=positions,
    )
    plan = plan_for(c, mixed_rows())
    assert rows_in(plan, 1) == want and rows_in(plan, 3) == want
    ((_, kind, value),) = plan.ops["layer.1"]
    assert kind == "add"
    torch.testing.assert_close(value, 2.0 * torch.tensor(vec()))
    ((_, kind, value),) = plan.ops["layer.3"]
    assert kind == "ablate"
    torch.testing.assert_close(value.norm(), torch.tensor(1.0))
    snap = c.counters.snapshot()
    assert snap["rows_selected.layer.1"] == snap["rows_selected.layer.3"] == len(want)
    assert snap["rows_selected"] == 2 * len(want)


def test_per_request_steer_and_scale_override():
    # A per-request steer (spec "per_request": true) acts on requests naming it.
    c = steer(vectors=[{"layer": 2, "vector": vec(), "scale": 1.5}], per_request=True)
    rows = mixed_rows(
        {
            0: {"tllm_consumers": "steer"},
            1: {"tllm_consumers": "esamp"},
            2: {"tllm_consumers": "esamp,steer", "tllm_steer_scale": -4},
            3: {},
        }
    )
    plan = plan_for(c, rows)
    assert rows_in(plan, 2) == [0, 1, 2, 4]
    ((idx, kind, value),) = plan.ops["layer.2"]
    v = torch.tensor(vec())
    assert kind == "add" and value.shape == (4, H)  # per-row scales: 1.5 x3, then -4
    torch.testing.assert_close(value, torch.tensor([1.5, 1.5, 1.5, -4.0])[:, None] * v)
    assert c.counters.get("rows_selected") == 4


def test_scale_override_without_per_request_and_bad_override():
    c = steer(vectors=[{"layer": 0, "vector": vec(), "scale": 1.0}])
    rows = mixed_rows({1: {"tllm_steer_scale": "0.5"}})
    plan = plan_for(c, rows)
    assert rows_in(plan, 0) == [0, 1, 2, 3, 4, 5, 6]
    ((_, _, value),) = plan.ops["layer.0"]
    scales = torch.tensor([1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0])
    torch.testing.assert_close(value, scales[:, None] * torch.tensor(vec()))
    # A bad value (the front end refuses it before the engine; here it got past): that
    # request runs unsteered, named in the log and counted; the others are steered.
    bad = steer(vectors=[{"layer": 0, "vector": vec()}])
    plan = plan_for(bad, mixed_rows({2: {"tllm_steer_scale": "lots"}}))
    assert rows_in(plan, 0) == [0, 1, 2, 3, 5, 6]  # not row 4, the request that set it
    assert bad.counters.get("invalid_request_settings") == 1
    with pytest.raises(ValueError, match="steer's config.per_request was removed"):
        SteerConfig(vectors=[{"layer": 0, "vector": vec()}], per_request=True)


def test_scale_zero_is_valid_and_still_selects_rows():
    c = steer(vectors=[{"layer": 1, "vector": vec(), "scale": 0.0}], positions="generated")
    rows = mixed_rows()
    plan = plan_for(c, rows)
    assert rows_in(plan, 1) == [3, 4]
    buf = EditBuffers(len(rows), H, torch.float32, torch.device("cpu"))
    buf.write(plan.ops["layer.1"])
    assert int(buf.mask.sum()) == c.counters.get("rows_selected.layer.1") == 2
    assert torch.count_nonzero(buf.add) == 0


def test_runtime_edit_count_matches_rows_selected():
    c = steer(
        vectors=[
            {"layer": 0, "vector": vec(), "scale": 3.0},
            {"layer": 0, "vector": vec(2), "scale": -1.0},
            {"layer": 2, "vector": vec(1), "mode": "ablate"},
        ],
        per_request=True,
    )
    total = {0: 0, 2: 0}
    for step in range(3):
        rows = mixed_rows(
            {0: {"tllm_consumers": "steer"}, 3: {"tllm_consumers": "" if step % 2 else "steer"}}
        )
        plan = plan_for(c, rows)
        for layer in (0, 2):
            buf = EditBuffers(len(rows), H, torch.float32, torch.device("cpu"))
            buf.write(plan.ops.get(f"layer.{layer}", []))
            total[layer] += int(buf.mask.sum())
        # Two add vectors on layer 0 compose.
        buf = EditBuffers(len(rows), H, torch.float32, torch.device("cpu"))
        buf.write(plan.ops["layer.0"])
        torch.testing.assert_close(buf.add[0], 3.0 * torch.tensor(vec()) - torch.tensor(vec(2)))
    snap = c.counters.snapshot()
    assert snap["rows_selected.layer.0"] == total[0] and snap["rows_selected.layer.2"] == total[2]
    assert snap["rows_selected"] == total[0] + total[2]
    # The flag is read once per request (cached until it finishes): request 3 kept step 0's value.
    assert total[0] == 3 * 5


def test_no_rows_and_finished_requests():
    c = steer(vectors=[{"layer": 0, "vector": vec()}])
    plan = plan_for(c, make_rows([]))
    assert plan.ops == {}
    rows = mixed_rows()
    plan_for(c, rows)
    for r in {id(r): r for r in rows.requests}.values():
        c.on_request_finished(r)
    assert c._req_cache == {}
    assert c.result()["rows_selected"] == 7


def test_steer_on_a_real_model_with_the_kit_equals_a_transformers_hook(tiny_model):
    """The consumer test kit (tllm_core.testing): steer's edits on a real model's rows, checked
    against transformers with the same vector added by a forward hook on layer 1, on the
    generated prompt-only rows (positions "prompt") and greedy tokens."""
    from tllm_core.testing import ConsumerKit

    vec = torch.linspace(-1, 1, 128)
    steer = {"vectors": [{"layer": 1, "vector": vec.tolist(), "scale": 3.0}], "positions": "prompt"}
    kit = ConsumerKit(tiny_model, [{"name": "steer", "config": steer}, 'stats:{"layers": [2]}'])
    prompt = kit.tokenize("The lighthouse keeper saw")
    out = kit.generate([prompt], max_tokens=4, temperature=0)[0][0]
    report = kit.close()
    assert report["consumers"]["steer"]["rows_selected"] == len(prompt)
    assert report["runtime"]["rows_edited.layer.1"] == len(prompt)

    layer = kit.hf.model.layers[1]
    handle = layer.register_forward_hook(
        lambda _m, _i, o: o + 3.0 * vec * (torch.arange(o.shape[1]) < len(prompt))[None, :, None]
    )
    try:
        with torch.no_grad():
            ref = kit.hf(torch.tensor([prompt + out[:-1]]), output_hidden_states=True)
    finally:
        handle.remove()
    assert out == ref.logits[0, len(prompt) - 1 :].argmax(-1).tolist()
    want = ref.hidden_states[3][0].norm(dim=-1).mean()  # after layer 2, every fed row
    got = report["results"]["stats"]["0/0"]["layer.2"]
    assert got["rows"] == len(prompt) + len(out) - 1
    assert got["mean_norm"] == pytest.approx(float(want), rel=1e-4)
