"""The ``sae`` consumer through the two front doors users take: ``tllm run --consumer
'sae:{...}'`` and ``tllm serve --consumer sae:... --per-request`` (steering and recording
chosen per request, a feature out of range answered with HTTP 400)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import cli_json, run_cli
from serve_util import get_json, tllm_serve

from consumers.sae import SparseAutoencoder, read_features, save_sae

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
D_IN, D_SAE, SITE, TOP_K = 128, 256, 1, 8


def _sae(folder: Path, d_in: int = D_IN, d_sae: int = D_SAE) -> str:
    """A random ReLU SAE for a residual stream of width ``d_in`` (the tiny model's: 128):
    enough features fire on every row for recording, and a decoder row big enough to steer
    greedy text."""
    g = torch.Generator().manual_seed(3)
    sae = SparseAutoencoder(
        W_enc=torch.randn(d_in, d_sae, generator=g) / d_in**0.5,
        b_enc=torch.zeros(d_sae),
        W_dec=torch.randn(d_sae, d_in, generator=g),
        b_dec=torch.zeros(d_in),
        architecture="standard",
    )
    return save_sae(sae, folder)


@pytest.mark.slow  # ~34 s; SAE records and steering in-process: tests/test_sae_e2e.py
def test_tllm_run_with_sae_records_summarises_and_steers(tiny_model, tmp_path):
    path = _sae(tmp_path / "sae")
    out = tmp_path / "feats"
    config = {
        "path": path,
        "site": SITE,
        "top_k": TOP_K,
        "out": str(out),
        "steer": [{"feature": 7, "scale": 4.0}],
        "watch": [7, 11],
        "phase": "decode",
    }
    prompts, n, max_tokens = ["Hello there", "The sea is"], 2, 6
    args = ["run", "--model", tiny_model, "--consumer", f"sae:{json.dumps(config)}"]
    for p in prompts:
        args += ["--prompt", p]
    args += ["-n", str(n), "--max-tokens", str(max_tokens), "--ignore-eos", "--seed", "1"]
    args += ["--enforce-eager", "--max-model-len", "512", "--kv-cache-gib", "1", "--json"]
    report = cli_json(run_cli(*args, timeout=900))
    res = report["results"]["sae"]
    decode_rows = len(prompts) * n * (max_tokens - 1)  # the last sampled token is never fed back
    assert res["rows_encoded"] == decode_rows
    assert res["rows_recorded"] == decode_rows
    assert 0 < res["mean_l0"] <= D_SAE and 0 < res["relative_mse"]
    assert set(res["watch"]) == {"7", "11"} and all(0 <= v <= 1 for v in res["watch"].values())
    assert res["rows_selected_steer"] > 0
    assert report["counters"]["runtime"]["rows_edited"] > 0
    assert res["bytes_per_row"]["features"] < res["bytes_per_row"]["dense_float32"]
    records = list(read_features(out))
    assert len(records) == len(prompts) * n
    for rec in records:
        assert rec.indices.shape == (max_tokens - 1, TOP_K) == rec.values.shape
        assert ((rec.indices >= 0) & (rec.indices < D_SAE)).all()
    assert report["errors"] == []


# ~35-45 s (a server start); in the default suite: SAE records, feature steering and clamps
# against transformers in-process (test_sae_e2e.py), the per-request keys and their refusal
# (test_sae_unit.py), per-request consumers served (test_serving.py, test_serve_command.py)
@pytest.mark.slow
def test_tllm_serve_sae_per_request_steers_records_and_refuses_bad_features(tiny_model, tmp_path):
    import openai

    path = _sae(tmp_path / "sae")
    out = tmp_path / "feats"
    config = {"path": path, "site": SITE, "top_k": TOP_K, "out": str(out), "phase": "decode"}
    err_path = tmp_path / "serve.err"
    args = ["--model", tiny_model, "--consumer", f"sae:{json.dumps(config)}", "--per-request"]
    args += ["--max-model-len", "512", "--kv-cache-gib", "1", "--", "--enforce-eager"]
    with tllm_serve(args, err_path) as url:
        assert "tllm_sae_steer" in err_path.read_text()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)

        def complete(xargs: dict | None) -> str:
            r = client.completions.create(
                model="default",
                prompt="The lighthouse keeper",
                max_tokens=8,
                temperature=0.0,
                extra_body={"vllm_xargs": xargs} if xargs else {},
            )
            return r.choices[0].text

        plain = complete(None)
        c0 = get_json(f"{url}/tllm/counters")["consumers"].get("sae", {})
        assert c0.get("rows_encoded", 0) == 0  # a request that did not ask
        recorded = complete({"tllm_consumers": "sae"})
        assert recorded == plain  # recording alone leaves the text alone
        c1 = get_json(f"{url}/tllm/counters")["consumers"]["sae"]
        assert c1["rows_recorded"] == 7 and c1.get("rows_selected_steer", 0) == 0
        steer = json.dumps([{"feature": 5, "scale": 40.0}])
        steered = complete(
            {"tllm_consumers": "sae", "tllm_sae_steer": steer, "tllm_sae_record": "false"}
        )
        assert steered != plain
        c2 = get_json(f"{url}/tllm/counters")["consumers"]["sae"]
        assert c2["rows_selected_steer"] > 0 and c2["rows_recorded"] == 7  # not recorded

        bad = json.dumps([{"feature": D_SAE, "scale": 1.0}])
        with pytest.raises(openai.BadRequestError) as ei:
            complete({"tllm_consumers": "sae", "tllm_sae_steer": bad})
        assert ei.value.status_code == 400
        assert "tllm_sae_steer" in ei.value.message and f"0..{D_SAE - 1}" in ei.value.message
        c3 = get_json(f"{url}/tllm/counters")["consumers"]["sae"]
        assert c3.get("invalid_request_settings", 0) == 0  # refused before the engine
    log = err_path.read_text()
    assert "Traceback" not in log, log[-4000:]
    records = list(read_features(out))  # the server flushed its records when it stopped
    assert len(records) == 1 and records[0].indices.shape == (7, TOP_K)


@pytest.mark.slow
def test_tllm_serve_sae_per_request_on_the_embedded_model(tmp_path):
    """The issue's "done when" on the embedded SmolLM2-135M-Instruct (no --model): chat
    requests record features, steer by a feature, and a bad feature is an HTTP 400."""
    import openai

    d_sae = 1152
    path = _sae(tmp_path / "sae", d_in=576, d_sae=d_sae)
    out = tmp_path / "feats"
    config = {"path": path, "site": 1, "top_k": TOP_K, "out": str(out), "phase": "decode"}
    err_path = tmp_path / "serve.err"
    args = ["--consumer", f"sae:{json.dumps(config)}", "--per-request"]
    args += ["--max-model-len", "512", "--kv-cache-gib", "1", "--", "--enforce-eager"]
    with tllm_serve(args, err_path, ready_timeout=600) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)

        def chat(xargs: dict | None) -> str:
            r = client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": "Tell me about lighthouses."}],
                max_tokens=8,
                temperature=0.0,
                extra_body={"ignore_eos": True, **({"vllm_xargs": xargs} if xargs else {})},
            )
            return r.choices[0].message.content

        plain = chat(None)
        assert chat({"tllm_consumers": "sae"}) == plain  # recording leaves the text alone
        c1 = get_json(f"{url}/tllm/counters")["consumers"]["sae"]
        assert c1["rows_recorded"] == 7 and c1["rows_encoded"] == 7
        steer = json.dumps([{"feature": 5, "scale": 40.0}])
        steered = chat(
            {"tllm_consumers": "sae", "tllm_sae_steer": steer, "tllm_sae_record": "false"}
        )
        assert steered != plain
        runtime = get_json(f"{url}/tllm/counters")["runtime"]
        assert runtime["rows_edited"] > 0  # the edit ran in the forward
        bad = json.dumps([{"feature": d_sae, "scale": 1.0}])
        with pytest.raises(openai.BadRequestError) as ei:
            chat({"tllm_consumers": "sae", "tllm_sae_steer": bad})
        assert ei.value.status_code == 400 and f"0..{d_sae - 1}" in ei.value.message
    assert "Traceback" not in err_path.read_text()
    (record,) = read_features(out)
    assert record.indices.shape == (7, TOP_K) and (record.indices < d_sae).all()
