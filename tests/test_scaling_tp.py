"""Tensor parallel 2 on real vLLM (CPU): one rank per core, tiny Llama with 2 heads and 2 KV
heads (the embedded SmolLM2 has 9 heads and cannot be split). See docs/scaling.md."""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch
from conftest import ENGINE_KW, MODEL_CACHE, cli_json, run_cli
from reference import hf_states, sequences_from_rows

pytestmark = pytest.mark.vllm

TP_KW = dict(ENGINE_KW, tensor_parallel_size=2, enable_prefix_caching=False, max_model_len=256)
PROMPTS = ["Hello there, how are", "The cat sat on", "One two three", "Four"]
EXTRAS = [
    {},  # untouched: ESamp at beta 0 visits it, nothing edits it
    {"tllm_consumers": "steer"},  # steered (scale 4)
    {"tllm_consumers": "steer", "tllm_steer_scale": 0.0},  # steered with scale 0
    {"tllm_esamp_beta": 0.5},  # ESamp guides this one
]
LAYERS = [0, 1, -1, "final"]


@pytest.fixture(scope="module")
def even_model() -> str:
    from tiny_models import build_tiny_model

    return str(build_tiny_model(MODEL_CACHE, arch="llama", heads=2, kv_heads=2))


def _params():
    from vllm import SamplingParams

    return [
        SamplingParams(n=2, max_tokens=8, seed=20 + i, temperature=1.0, extra_args=dict(e))
        for i, e in enumerate(EXTRAS)
    ]


def _tokens(outputs):
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def plain_tp2(even_model, engines):
    from vllm import LLM

    from tllm_core.vllm_bridge.parallel import cpu_thread_binding

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(2, os.sched_getaffinity(0))
    try:
        llm = engines.get(("plain-tp2", even_model), lambda: LLM(even_model, **TP_KW))
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
    return _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False))


@pytest.mark.slow  # ~3 min on an idle 2-core machine (two TP=2 engines), 8 min loaded
def test_tp2_captures_edits_guidance_and_counters(even_model, engines, plain_tp2):
    from tllm_core.app.engine import TllmLLM

    steer = {"vectors": [{"layer": 1, "vector": [0.5] * 128, "scale": 4.0}]}
    consumers = [
        {"name": "recorder", "config": {"layers": LAYERS}},
        {"name": "steer", "config": steer, "per_request": True},
        'esamp:{"beta": 0.0}',
        'crasher:{"after": 3}',
    ]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # TllmLLM binds the ranks itself
    llm = engines.get(
        ("tllm-tp2", even_model),
        lambda: TllmLLM(even_model, consumers, raise_on_disabled=False, **TP_KW),
    )
    assert llm.status["rank"] == {
        "tp_rank": 0, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1,
        "leader": True,
    }  # fmt: skip
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    toks = _tokens(outs)
    rep = llm.close()

    # Text: untouched (ESamp beta 0) and scale-0 requests equal plain TP=2 vLLM; steering
    # and ESamp with beta > 0 change it.
    assert toks[0] == plain_tp2[0]
    assert toks[2] == plain_tp2[2], "steering with scale 0 must leave the text unchanged"
    assert toks[1] != plain_tp2[1], "steering must change the text"
    assert toks[3] != plain_tp2[3], "ESamp with beta 0.5 must change the text"

    # Counters are the leader's only: every token row once (no prefix caching: each of the
    # n samples computes its prompt), from the outputs, not from another counter.
    rt = rep["runtime"]
    rows = sum(len(o.prompt_token_ids) + len(c.token_ids) - 1 for o in outs for c in o.outputs)
    assert rt["rows_seen"] == rows and rt["rows_captured.layer.0"] == rows
    assert rt["requests_finished"] == 2 * len(PROMPTS)
    assert rt["rows_edited.layer.1"] > 0
    es = rep["consumers"]["esamp"]
    assert es["optimizer_steps"] > 0 and es["rows_trained"] > 0
    # only request 3 (2 samples) is guided, on its decode rows
    assert 0 < es["rows_guided"] <= 2 * 7 and rt["rows_guided"] == es["rows_guided"]
    # the failing consumer is reported from the leader only (its first error, then the one
    # that switched it off after 3 in a row), and isolated
    assert rt["consumer_errors"] == 3
    assert [(e["consumer"], e["tp_rank"]) for e in rep["errors"]] == [("crasher", 0)] * 2

    # Captured states equal transformers' at every position and layer asked for.
    result = rep["results"]["recorder"]
    assert result["pid"] != os.getpid()
    seqs = sequences_from_rows(result["rows"], result["sampled"])
    assert len(seqs) == 2 * len(PROMPTS)
    by_key = defaultdict(list)
    for r in result["rows"]:
        by_key[(r["request_id"], r["sample_index"])].append(r)
    checked = expected = 0
    for key, seq in seqs.items():
        extra = EXTRAS[by_key[key][0]["prompt_index"]]
        steered = "tllm_consumers" in extra and extra.get("tllm_steer_scale") != 0.0
        expected += len(by_key[key]) * (1 if steered else len(LAYERS))
        ref = hf_states(even_model, seq)
        for r in by_key[key]:
            for k, v in r["hidden"].items():
                if steered and k != "layer.0":
                    continue  # edited at layer 1: later states differ from transformers'
                torch.testing.assert_close(
                    torch.tensor(v), ref[k][r["position"]], rtol=1e-4, atol=1e-4, msg=f"{key} {k}"
                )
                checked += 1
        assert sorted(r["position"] for r in by_key[key]) == list(range(len(seq) - 1))
    assert checked == expected > 0
    engines.close()


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_cli_export_with_esamp_at_tp2_round_trips(even_model, tmp_path, runner):
    from cli_util import v2_env

    from consumers.export import read_export

    out = tmp_path / "exp"
    proc = run_cli(
        "export", "--model", even_model, "--tensor-parallel-size", "2",
        "--layers", "0,-1,final,attn.1,mlp.1",
        "--out", str(out), "--consumer", "esamp", "--prompt", "Hello there", "--prompt", "The cat",
        "-n", "2", "--max-tokens", "6", "--seed", "3", "--no-chat", "--json",
        "--max-model-len", "256", "--kv-cache-gib", "1", "--enforce-eager",
        env=v2_env() if runner == "v2" else None,
    )  # fmt: skip
    rep = cli_json(proc)
    assert rep["run"]["runner"].startswith(f"{runner.upper()} runner"), rep["run"]["runner"]
    assert rep["errors"] == []
    assert rep["counters"]["esamp"]["optimizer_steps"] > 0
    assert rep["counters"]["esamp"]["rows_guided"] > 0
    records = list(read_export(out, verify=True))
    assert len(records) == 4
    for rec in records:
        ref = hf_states(even_model, rec.token_ids.tolist())
        # attn/mlp: the blocks' outputs are all-reduced inside vLLM's row-parallel projections,
        # so the leader's copy is whole
        for key in ("layer.0", "layer.3", "final", "attn.1", "mlp.1"):
            torch.testing.assert_close(
                rec.hidden[key], ref[key][rec.positions], rtol=1e-4, atol=1e-4
            )


@pytest.mark.slow  # ~3 min: one TP=2 engine on two cores
def test_tp2_window_and_results_with_the_completion(even_model, tmp_path):
    """A capture window and results with the completion at TP=2: the export keeps the first
    two generated tokens' rows only (equal to transformers on its record's tokens), and each
    request gets the same rows back with its completion."""
    import json

    import numpy as np

    import tllm_core
    from consumers.export import read_export

    out = tmp_path / "x"
    spec = {"out": str(out), "layers": [0, -1], "phase": "generated[0:2]"}
    proc = run_cli(
        "run", "--model", even_model, "--tensor-parallel-size", "2",
        "--consumer", f"export:{json.dumps(spec)}", "--results", "export",
        "--prompt", "Hello there", "--prompt", "The cat", "-n", "1", "--max-tokens", "4",
        "--temperature", "0", "--no-chat", "--json",
        "--max-model-len", "256", "--kv-cache-gib", "1", "--enforce-eager",
    )  # fmt: skip
    rep = cli_json(proc)
    assert rep["errors"] == []
    records = sorted(read_export(out, verify=True), key=lambda r: r.prompt_index)
    assert len(records) == 2
    for rec, per_prompt in zip(records, rep["request_results"], strict=True):
        n = rec.num_prompt_tokens
        assert rec.positions.tolist() == [n, n + 1]
        ref = hf_states(even_model, rec.token_ids.tolist())
        rows = tllm_core.decode_results(per_prompt[0])["export"]
        assert rows["positions"].tolist() == [n, n + 1]
        for key in ("layer.0", "layer.3"):
            torch.testing.assert_close(
                rec.hidden[key], ref[key][rec.positions], rtol=1e-4, atol=1e-4
            )
            np.testing.assert_array_equal(rows[key], rec.hidden[key].numpy())


@pytest.mark.slow  # ~30 s: one TP=2 engine (the default suite has the fake executor's test)
def test_tp2_a_failed_tllm_call_leaves_no_answer_for_the_next(even_model):
    """vLLM's ``collective_rpc`` raises at the first rank's error and leaves the other ranks'
    answers queued; the next call would read them as its own. Every rank answers a failed tllm
    call (``worker_ext.checked``), so the calls after it get their own answers."""
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM
    from tllm_core.vllm_bridge.errors import EngineCallFailed

    llm = TllmLLM(even_model, ["stats"], **TP_KW)
    try:
        for _ in range(2):  # a wait of "soon" fails float() on every rank
            with pytest.raises(EngineCallFailed, match="tllm_take_results: ValueError"):
                llm._workers("tllm_take_results", ["r1"], "soon")
        ranks = [a["rank"]["tp_rank"] for a in llm._workers("tllm_collect")]
        assert ranks == [0, 1]
        params = SamplingParams(n=2, max_tokens=4, seed=1, temperature=1.0)
        outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        rep = llm.close()
        rows = sum(len(o.prompt_token_ids) + len(c.token_ids) - 1 for o in outs for c in o.outputs)
        assert rep["runtime"]["rows_seen"] == rows
    finally:
        llm.shutdown()
