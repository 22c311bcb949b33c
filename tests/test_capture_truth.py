"""Captured states equal transformers' on the same tokens: compiled (default multiprocess
layout, third-party consumer from an entry point) and eager (in-process)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ENGINE_KW, cli_json, run_cli
from reference import hf_states, sequences_from_rows

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog and keeps running",
    "One two three four",
]
LAYERS = [0, 1, -1, "final"]


def check_against_hf(model: str, result: dict, num_layers: int, n: int) -> int:
    rows, sampled = result["rows"], result["sampled"]
    seqs = sequences_from_rows(rows, sampled)
    assert len(seqs) == len(PROMPTS) * n
    checked = 0
    by_key = {}
    for r in rows:
        by_key.setdefault((r["request_id"], r["sample_index"]), []).append(r)
    for key, seq in seqs.items():
        ref = hf_states(model, seq)
        for r in by_key[key]:
            pos = r["position"]
            assert r["token_id"] == seq[pos]
            for k, v in r["hidden"].items():
                got = torch.tensor(v)
                want = ref[k][pos]
                torch.testing.assert_close(
                    got, want, rtol=1e-4, atol=1e-4, msg=f"{key} pos {pos} {k}"
                )
                checked += 1
        # every position but the last (never fed) was captured exactly once
        positions = sorted(r["position"] for r in by_key[key] if not r["recomputed"])
        assert positions == list(range(len(seq) - 1)), key
    return checked


# ~50-70 s, a second compiled tllm run: in the default suite the third-party recorder runs,
# compiled in the worker process, beside the edits of
# test_compiled_edits.py::test_compiled_steering_matches_transformers_with_hooks and is
# checked there against transformers; eager capture: the in-process test below.
@pytest.mark.slow
@pytest.mark.vllm
def test_compiled_multiprocess_third_party_consumer_matches_transformers(tiny_model):
    cfg = json.dumps({"layers": LAYERS})
    args = [
        "run",
        "--compile",  # a job this small would start eager (issue 39)
        "--model",
        tiny_model,
        "--consumer",
        f"recorder:{cfg}",
        "-n",
        "2",
        "--max-tokens",
        "5",
        "--seed",
        "7",
        "--no-prefix-caching",
        "--json",
        "--max-model-len",
        "512",
        "--kv-cache-gib",
        "1",
    ]
    for p in PROMPTS:
        args += ["--prompt", p]
    proc = run_cli(*args)
    out = cli_json(proc)
    result = out["results"]["recorder"]
    # The consumer ran in vLLM's worker process, not in the front end we started.
    assert result["pid"] > 0 and result["pid"] != proc.pid
    assert out["counters"]["runtime"]["rows_captured.layer.0"] > 0
    assert out["counters"]["recorder"]["rows"] > 0
    assert check_against_hf(tiny_model, result, 4, 2) > 0


@pytest.mark.vllm
def test_eager_in_process_matches_transformers(tiny_model, engines):
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM

    llm = engines.get(
        ("truth-eager", tiny_model),
        lambda: TllmLLM(
            tiny_model,
            [{"name": "recorder", "config": {"layers": LAYERS}}],
            enable_prefix_caching=False,
            **ENGINE_KW,
        ),
    )
    llm.generate(PROMPTS, SamplingParams(n=2, max_tokens=5, seed=3), use_tqdm=False)
    report = llm.close()
    assert check_against_hf(tiny_model, report["results"]["recorder"], 4, 2) > 0
    engines.close()


@pytest.mark.vllm
def test_prefix_cached_prompt_rows_match_transformers_on_v1(tiny_model, engines):
    """A prompt longer than one KV cache block (128 tokens on CPU) twice: the second time
    its first block comes from the prefix cache and is never computed, so its rows start at
    position 128, each equal to transformers at its position. (V2: the same check in
    test_runner_v2.py's server test.)"""
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM

    llm = engines.get(
        ("truth-prefix-cache", tiny_model),
        lambda: TllmLLM(
            tiny_model, [{"name": "recorder", "config": {"layers": [0, "final"]}}], **ENGINE_KW
        ),
    )
    prompt = {"prompt_token_ids": list(range(20, 150))}
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for _ in range(2):  # one after the other: the first fills the cache
        llm.generate([prompt], params, use_tqdm=False)
    rows = llm.close()["results"]["recorder"]["rows"]
    engines.close()
    by = {}
    for r in rows:
        by.setdefault(r["request_id"], []).append(r)
    first, second = (sorted(r["position"] for r in v) for v in by.values())
    assert first == list(range(131)) and second == list(range(128, 131)), (first, second)
    seq = [*range(20, 150), next(r["token_id"] for r in rows if r["position"] == 130)]
    ref = hf_states(tiny_model, seq)
    for r in rows:
        assert r["token_id"] == seq[r["position"]], r["position"]
        for k, v in r["hidden"].items():
            want = ref[k][r["position"]]
            torch.testing.assert_close(torch.tensor(v), want, rtol=1e-4, atol=1e-4, msg=k)
