"""MoE routing ports (issue 27): ``router.{i}`` (router logits before softmax and top-k),
``router_topk.{i}`` and ``router_weights.{i}`` (the chosen experts and their weights) equal
transformers' on tiny random Qwen3-MoE (``norm_topk_prob``) and OLMoE (no renormalisation)
models, and an edit of the router logits (suppress one expert) changes which experts vLLM runs
exactly as the same edit in transformers' gate does.

Per family, one in-process engine (eager, fp32) runs two greedy requests in one batch: one
plain, one with the edit (docs/ports.md's ``suppress_expert`` consumer, per request: ``-inf``
added to one expert's router logit in layer 0 at every row); the architecture matrix's probe
records the ports and the built-in ``export`` consumer writes ``router*.1`` (read back with
``read_export``). The reference is transformers' forward on the generated tokens, with a
forward hook on each layer's gate reading (and, for the edited request, editing) the logits.
The ``tllm export`` command (V1, V2, compiled) is checked the same way, marked slow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ENGINE_KW, MODEL_CACHE, registered_plugin
from test_arch_matrix import Probe
from tiny_models import build_tiny_model

from tllm_core import Consumer, hookimpl

LAYERS = 2
HIDDEN = 128
EXPERTS = 4
PROMPTS = ["The quick brown fox jumps", "One two three"]
MAX_TOKENS = 3
EDIT_LAYER = 0
TOL = 1e-5  # fp32 on both sides
EXPORTED = ["router.1", "router_topk.1", "router_weights.1"]  # what the export consumer writes


def _doc_consumer() -> type[Consumer]:
    """The ``suppress_expert.py`` consumer of docs/ports.md, run as the page shows it."""
    from test_docs import DOCS, doc_blocks

    namespace: dict = {}
    code = doc_blocks(DOCS / "ports.md")["suppress_expert.py"]
    exec(compile(code, "suppress_expert.py", "exec"), namespace)  # noqa: S102 - our own docs
    return namespace["SuppressExpert"]


SuppressExpert = _doc_consumer()


class _Plugin:
    @hookimpl
    def tllm_consumers(self):
        return [Probe, SuppressExpert]


@pytest.fixture(scope="module")
def consumers_registered():
    with registered_plugin(_Plugin(), "router-test"):
        yield


def _ports() -> list[str]:
    kinds = ("router", "router_topk", "router_weights")
    return [f"{k}.{i}" for k in kinds for i in range(LAYERS)]


@torch.no_grad()
def _reference(path: str, token_ids: list[int], offset: torch.Tensor | None) -> dict:
    """transformers' router logits, chosen experts and weights per layer, and the logits; with
    ``offset`` added to layer EDIT_LAYER's router logits by a forward hook on its gate, which
    then picks the experts from the edited logits as the gate itself does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got: dict[str, torch.Tensor] = {}

    def hook(i):
        def run(gate, _args, out):
            logits, weights, ids = out
            if offset is not None and i == EDIT_LAYER:
                logits = logits + offset
                probs = torch.softmax(logits, dim=-1, dtype=torch.float)
                weights, ids = probs.topk(gate.top_k, dim=-1)
                # gpt-oss's router: softmax over the top-k logits, i.e. renormalised
                if getattr(gate, "norm_topk_prob", True):
                    weights = weights / weights.sum(dim=-1, keepdim=True)
            got[f"router.{i}"], got[f"router_topk.{i}"] = logits, ids
            got[f"router_weights.{i}"] = weights
            return logits, weights, ids

        return run

    gates = [getattr(layer.mlp, "gate", None) or layer.mlp.router for layer in model.model.layers]
    handles = [gate.register_forward_hook(hook(i)) for i, gate in enumerate(gates)]
    try:
        got["logits"] = model(torch.tensor([token_ids])).logits[0]
    finally:
        for h in handles:
            h.remove()
    return got


@pytest.mark.vllm
@pytest.mark.parametrize(
    "arch", ["qwen3_moe", "olmoe", pytest.param("gpt_oss", marks=pytest.mark.slow)]
)
def test_router_ports_and_edit_match_transformers(arch, engines, consumers_registered, tmp_path):
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM

    path = str(build_tiny_model(MODEL_CACHE, arch=arch, num_layers=LAYERS, hidden=HIDDEN))
    # The expert to suppress: the one transformers' layer-EDIT_LAYER router picks first for the
    # edited prompt's first token (so the edit changes the routing there).
    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = tok(PROMPTS[1])["input_ids"]
    top = _reference(path, prompt_ids, None)[f"router_topk.{EDIT_LAYER}"]
    expert = int(top[0, 0])
    offset = torch.zeros(EXPERTS)
    offset[expert] = float("-inf")
    consumers = [
        {"name": "archprobe", "config": {"ports": _ports()}},
        {
            "name": "suppress_expert",
            "config": {"layer": EDIT_LAYER, "expert": expert},
            "per_request": True,
        },
        {"name": "export", "config": {"out": str(tmp_path / "x"), "layers": EXPORTED}},
    ]
    llm = engines.get(
        ("moe-router", arch),
        lambda: TllmLLM(path, consumers, enable_prefix_caching=False, **ENGINE_KW),
    )
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [
        SamplingParams(**greedy),
        SamplingParams(**greedy, extra_args={"tllm_consumers": "suppress_expert"}),
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    report = llm.close()
    engines.close()
    assert not report.get("errors"), report["errors"]
    assert report["runtime"][f"rows_edited.router.{EDIT_LAYER}"] > 0
    rows = report["results"]["archprobe"]["rows"]
    for o, edited in zip(outs, (False, True), strict=True):
        seq = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        ref = _reference(path, seq, offset if edited else None)
        by_pos = rows[(o.request_id, 0)]
        assert sorted(by_pos) == list(range(len(seq) - 1))
        for pos, got in by_pos.items():
            at = f"{arch} {'edited' if edited else 'plain'} pos {pos}"
            for key, value in got.items():
                want = ref[key][pos]
                if key.startswith("router_topk"):  # (the probe keeps floats)
                    assert value.tolist() == want.tolist(), at
                else:
                    tol = 1e-4 if key == "logits" else TOL
                    torch.testing.assert_close(
                        value[: want.shape[-1]], want, rtol=tol, atol=tol, msg=f"{at} {key}"
                    )
        if edited:  # the edit reached vLLM's expert selection: the suppressed expert never ran
            chosen = torch.stack([g[f"router_topk.{EDIT_LAYER}"] for g in by_pos.values()])
            assert expert not in chosen.flatten().tolist(), (arch, expert, chosen)
    edited_id = outs[1].request_id
    _check_export(path, tmp_path / "x", lambda rid: offset if rid == edited_id else None)


def _check_export(path: str, out, offset_of) -> None:
    """The export under ``out`` (the ``EXPORTED`` keys, both requests) equals transformers':
    each key keeps its width and dtype (ids int64) and the reader reads it back."""
    from consumers.export import read_export

    records = list(read_export(out, verify=True))
    assert records
    for rec in records:
        ref = _reference(path, rec.token_ids.tolist(), offset_of(rec.request_id))
        assert rec.hidden["router_topk.1"].dtype == torch.int64
        assert rec.hidden["router.1"].shape == (len(rec.positions), EXPERTS)
        for key in EXPORTED:
            want = ref[key][rec.positions]
            torch.testing.assert_close(rec.hidden[key], want, rtol=TOL, atol=TOL, msg=key)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(("runner", "eager"), [("V1", True), ("V2", True), ("V1", False)])
def test_export_command_writes_router_ports(runner, eager, tmp_path):
    """``tllm export --layers router.1,router_topk.1,router_weights.1`` (the command's engine,
    its own process; V2 under the test fixture, docs/runners.md; compiled: the gate hook
    traced by Dynamo) equals transformers'."""
    from cli_util import v2_env
    from conftest import cli_json, run_cli

    path = str(build_tiny_model(MODEL_CACHE, arch="qwen3_moe", num_layers=LAYERS, hidden=HIDDEN))
    out = tmp_path / "x"
    args = ["export", "--model", path, "--layers", ",".join(EXPORTED), "--out", str(out)]
    args += ["--max-tokens", "3", "--no-chat", "--json", "--max-model-len", "512"]
    args += ["--enforce-eager"] if eager else ["--compile"]  # small jobs default to eager
    env = v2_env() if runner == "V2" else None
    done = cli_json(run_cli(*args, "--prompt", PROMPTS[0], timeout=900, env=env))
    assert done["run"]["runner"].startswith(f"{runner} runner"), done["run"]["runner"]
    _check_export(path, out, lambda _rid: None)


# -- without an engine -----------------------------------------------------------------------
def _layer(**children) -> torch.nn.Module:
    layer = torch.nn.Module()
    for name, child in children.items():
        setattr(layer, name, child)
    return layer


def _moe_block(gate_name: str = "gate") -> torch.nn.Module:
    block = torch.nn.Module()
    setattr(block, gate_name, torch.nn.Linear(3, EXPERTS, bias=False))
    block.experts = torch.nn.Module()
    return block


def _dense_mlp() -> torch.nn.Module:
    mlp = torch.nn.Module()
    mlp.gate_up_proj = torch.nn.Linear(3, 8)
    return mlp


@pytest.mark.parametrize(
    ("layer", "words"),
    [
        (_layer(mlp=_dense_mlp()), ("dense MLP", "no router gate")),
        (_layer(mamba=torch.nn.Linear(3, 3)), ("no MLP / MoE block",)),
    ],
)
def test_router_is_refused_where_there_is_no_moe_block(layer, words):
    from tllm_core.vllm_bridge.errors import UnsupportedEngineError
    from tllm_core.vllm_bridge.sites import tap_info

    with pytest.raises(UnsupportedEngineError) as info:
        tap_info(torch.nn.ModuleList([layer]), "router", 0, model="ToyForCausalLM")
    msg = str(info.value)
    for word in ("'router'", "decoder layer 0", "ToyForCausalLM", *words):
        assert word in msg, (word, msg)


@pytest.mark.parametrize("gate_name", ["gate", "router"])
def test_router_tap_captures_and_edits_through_a_hook_on_the_gate(gate_name):
    """The hook sees every caller of the gate (vLLM's MoE runner holds its own reference),
    captures the logits and hands on the edited ones; unedited rows stay bit for bit."""
    from tllm_core.api.edits import EditBuffers
    from tllm_core.vllm_bridge.sites import TapBuffers, install_tap, tap_info

    block = _moe_block(gate_name)
    runner_ref = getattr(block, gate_name)  # e.g. MoERunner.gate: the same module object
    layers = torch.nn.ModuleList([_layer(mlp=block)])
    info = tap_info(layers, "router", 0)
    assert info["width"] == EXPERTS and info["dtype"] == torch.float32
    one = torch.zeros(1, dtype=torch.long)
    edit = EditBuffers(3, EXPERTS, torch.float32, torch.device("cpu"))
    buffers = TapBuffers(torch.zeros(3, EXPERTS), edit, one, one.clone(), one.clone())
    install_tap(layers, "router", 0, buffers)
    edit.mask[1] = True
    edit.add[1, 2] = float("-inf")
    x = torch.randn(3, 3)
    plain = x @ runner_ref.weight.T
    out = runner_ref(x)
    torch.testing.assert_close(out[[0, 2]], plain[[0, 2]], rtol=0, atol=0)
    assert out[1, 2] == float("-inf") and torch.equal(out[1, :2], plain[1, :2])
    assert torch.equal(buffers.capture, out) and int(buffers.edited) == 1


def test_chosen_experts_follow_the_router_settings():
    from producers.router import chosen_experts

    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    ids, w = chosen_experts(logits, {"routing": "softmax_topk", "top_k": 2, "renormalize": False})
    p = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[2, 3]]
    torch.testing.assert_close(w[0], p[[2, 3]])
    _, w = chosen_experts(logits, {"routing": "softmax_topk", "top_k": 2, "renormalize": True})
    torch.testing.assert_close(w[0], p[[2, 3]] / p[[2, 3]].sum())
    with pytest.raises(ValueError, match=r"GroupedTopKRouter \(sigmoid\)"):
        chosen_experts(logits, {"routing": "GroupedTopKRouter (sigmoid)", "top_k": 2})


def test_only_the_router_logits_are_editable():
    from producers.router import RouterLogits, RouterProducer, RouterTopK

    producer = RouterProducer()
    assert producer.edit_tap(RouterLogits(1)).key == "router.1"
    with pytest.raises(ValueError, match=r"RouterTopK \(router_topk.1\) cannot be edited"):
        producer.edit_tap(RouterTopK(1))


def test_edit_plan_sizes_a_router_edit_by_the_number_of_experts():
    from tllm_core.api.edits import EditPlan

    class Rows:
        def __len__(self):
            return 2

    plan = EditPlan(
        Rows(), {"router.1": "router.1", "layer.1": "residual.1"}, 8, widths={"router.1": 4}
    )
    assert plan.width("router.1") == 4 and plan.width(1) == 8
    plan.add("router.1", np.array([0, 1]), torch.zeros(4))
    with pytest.raises(ValueError, match=r"'router.1' has size 8, the tapped tensor's width is 4"):
        plan.add("router.1", np.array([0]), torch.zeros(8))


@pytest.mark.vllm
@pytest.mark.slow  # ~36 s; the one-line refusal: test_arch_matrix.test_cli_refusal_is_one_line_naming_the_model_class
def test_cli_refusal_at_engine_start_is_one_line(tiny_model, tmp_path):
    """The router asked of a dense model is refused where the layers are known, in the
    engine; vLLM's own error there says only "see root cause above". The command ends with
    tllm's one line naming the site, the layer and why, and exit 2."""
    from conftest import run_cli

    proc = run_cli(
        "export", "--model", tiny_model, "--layers", "router.1", "--out", str(tmp_path / "x"),
        "--enforce-eager", "--prompt", "Hi", "--max-tokens", "2", timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tllm: the engine refused to start: tap site 'router' is not "), last
    assert "decoder layer 1 (LlamaDecoderLayer)" in last and "dense MLP" in last, last
