"""The ``Logits`` port of a structured-output request is what the model computed, before
vLLM masks the tokens its grammar forbids, on both model runners (V1 reads them before
``sample_tokens`` masks them; V2 masks them inside ``runner.sample``, where tllm reports them
first). Checked against transformers; the sampled text still obeys the grammar, guided by
ESamp too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from cli_util import v2_env
from conftest import ENGINE_KW, cli_env
from reference import hf_model
from transformers import AutoTokenizer

pytestmark = pytest.mark.vllm

PROMPT = "Is the sea blue? Answer:"
CHOICES = [" yes indeed", " no"]

SCRIPT = """
import json, sys
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from tllm_core import TllmLLM

if __name__ == "__main__":
    model, prompt, choices, engine = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    rec = json.dumps({"layers": [], "logits": True})
    grammar = StructuredOutputsParams(choice=choices)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=grammar)
    drawn = SamplingParams(max_tokens=8, n=4, seed=0, structured_outputs=grammar)
    esamp = json.dumps({"beta": 2.0, "mode": "full_vocab", "mix": "latent"})
    with TllmLLM(model, consumers=[f"recorder:{rec}", f"esamp:{esamp}"], **engine) as llm:
        out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
        guided = llm.generate([prompt], drawn, use_tqdm=False)[0].outputs
        report = llm.collect()
    sampled = [s for s in report["results"]["recorder"]["sampled"] if s["request_id"] == "0"]
    print(json.dumps({"text": out.text, "token_ids": list(out.token_ids), "sampled": sampled,
                      "runner": llm.status["runner"], "guided": [o.text for o in guided],
                      "rows_guided": report["runtime"]["rows_guided"]}))
"""


@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_logits_of_a_structured_output_request_are_the_models(tiny_model, runner):
    env = cli_env(**(v2_env() if runner == "V2" else {}))
    args = [tiny_model, PROMPT, json.dumps(CHOICES), json.dumps(ENGINE_KW)]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["runner"].startswith(f"{runner} runner"), got["runner"]
    assert got["text"] in CHOICES  # the grammar was applied to what was sampled
    # ESamp recomputes the whole vocabulary's logits (latent mix): it writes candidates only
    assert got["rows_guided"] > 0 and set(got["guided"]) <= set(CHOICES), got["guided"]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt_ids = tok(PROMPT).input_ids
    with torch.no_grad():
        ref = hf_model(tiny_model)(torch.tensor([prompt_ids + got["token_ids"]])).logits[0]
    sampled = sorted(got["sampled"], key=lambda s: s["position"])
    assert [s["token_id"] for s in sampled] == got["token_ids"]
    for s in sampled:
        want = ref[s["position"]]  # unmasked: the grammar's forbidden tokens included
        assert s["logits_top_ids"][0] == int(want.argmax()), s
        torch.testing.assert_close(torch.tensor(s["logits_top"]), want.topk(8).values,
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        torch.testing.assert_close(torch.tensor(s["logits_sum"]), want.sum(), rtol=1e-3, atol=1e-2)
