"""The attention- and MLP-output ports (``attn.{i}`` / ``mlp.{i}``) equal transformers'
``self_attn`` / ``mlp`` forward-hook outputs at every prompt and generated position:
compiled (``tllm export`` in vLLM's default multiprocess layout) and eager (in-process),
on a Llama and a Qwen2 tiny model."""

from __future__ import annotations

import pytest
import torch
from conftest import ENGINE_KW, cli_json, run_cli
from reference import hf_states

pytestmark = pytest.mark.vllm

PROMPTS = ["Hi there", "One two three four five six seven"]
PORTS = ["attn.0", "mlp.0", "attn.-1", "mlp.-1", "1"]


def _check(model: str, out, num_layers: int, n: int) -> int:
    from consumers.export import read_export

    def absolute(name: str) -> str:
        if name.lstrip("-").isdigit():
            return f"layer.{int(name) % num_layers}"
        site, layer = name.split(".")
        return f"{site}.{int(layer) % num_layers}"

    records = list(read_export(out, verify=True))
    assert len(records) == len(PROMPTS) * n
    checked = 0
    for rec in records:
        seq = rec.token_ids.tolist()
        assert rec.positions.tolist() == list(range(len(seq) - 1))
        ref = hf_states(model, seq)
        for name in PORTS:
            key = absolute(name)
            torch.testing.assert_close(
                rec.hidden[key], ref[key][rec.positions], rtol=1e-4, atol=1e-4, msg=key
            )
            checked += 1
    return checked


@pytest.mark.slow  # compiled (~35 s); block ports eager below, compiled taps in test_capture_truth
def test_compiled_export_of_block_outputs_matches_transformers(tiny_model, tmp_path):
    out = tmp_path / "blocks"
    args = ["export", "--model", tiny_model, "--layers", ",".join(PORTS), "--out", str(out)]
    args += ["-n", "2", "--max-tokens", "4", "--seed", "3", "--no-chat", "--json"]
    args += ["--dtype", "float32", "--max-model-len", "512", "--compile"]  # small: else eager
    for p in PROMPTS:
        args += ["--prompt", p]
    report = cli_json(run_cli(*args, timeout=900))
    assert report["counters"]["runtime"]["rows_captured.attn.0"] > 0
    assert report["counters"]["runtime"]["rows_captured.mlp.3"] > 0
    assert report["counters"]["runtime"].get("stale_captures", 0) == 0
    assert _check(tiny_model, out, 4, 2) == len(PROMPTS) * 2 * len(PORTS)


def test_eager_block_outputs_match_transformers_qwen2(tiny_qwen, engines, tmp_path):
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM

    out = tmp_path / "qblocks"
    spec = {"name": "export", "config": {"out": str(out), "layers": PORTS}}
    llm = engines.get(
        ("blocks", str(out)),
        lambda: TllmLLM(tiny_qwen, [spec], enable_prefix_caching=False, **ENGINE_KW),
    )
    llm.generate(PROMPTS, SamplingParams(n=2, max_tokens=4, seed=7), use_tqdm=False)
    report = llm.close()
    engines.close()
    assert report["runtime"]["rows_captured.attn.2"] > 0
    assert _check(tiny_qwen, out, 3, 2) == len(PROMPTS) * 2 * len(PORTS)
