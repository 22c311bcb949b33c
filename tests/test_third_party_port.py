"""Third-party ports from tests/plugin_pkg, found through its entry point and served inside one
real engine: ``rnorm.{i}`` (a producer over a built-in site) equals the norm of transformers'
residual stream, and ``postnorm.{i}`` (a tap site the plugin adds through the
``tllm_architectures`` hook) equals transformers' ``post_attention_layernorm`` output, read
and edited."""

from __future__ import annotations

import pytest
import torch
from conftest import ENGINE_KW
from reference import hf_model

pytestmark = pytest.mark.vllm

ADD = 0.5  # siterec adds it to postnorm.1 of prompt 1's rows


@pytest.fixture(scope="module")
def run(tiny_model, engines):
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM

    consumers = ["normrec", f'siterec:{{"layer": 1, "add": {ADD}}}']
    llm = engines.get(
        ("normrec+siterec", tiny_model),
        lambda: TllmLLM(tiny_model, consumers, enable_prefix_caching=False, **ENGINE_KW),
    )
    outs = llm.generate(["Hello there", "A B C D"], SamplingParams(n=2, max_tokens=4, seed=1))
    report = llm.collect()
    engines.close()
    return outs, report


def _sequences(outs):
    """``(output, completion, token ids, add)``: prompt 1's rows carry siterec's edit."""
    for k, o in enumerate(outs):
        for c in o.outputs:
            yield o, c, list(o.prompt_token_ids) + list(c.token_ids), ADD if k == 1 else 0.0


def test_third_party_port_matches_transformers(tiny_model, run):
    outs, report = run
    res = report["results"]["normrec"]
    assert res["key"] == "rnorm.3" and report["runtime"]["rows_captured.rnorm.3"] > 0
    checked = 0
    for o, c, seq, add in _sequences(outs):
        norms = res["norms"][f"{o.request_id}/{c.index}"]
        assert sorted(int(p) for p in norms) == list(range(len(seq) - 1))
        want = _hf_post_norm(tiny_model, seq, add)["layer.3"].norm(dim=-1)
        got = torch.tensor(
            [norms[str(p)] if str(p) in norms else norms[p] for p in range(len(seq) - 1)]
        )
        torch.testing.assert_close(got, want[: len(seq) - 1], rtol=1e-4, atol=1e-4)
        checked += 1
    assert checked == 4


@torch.no_grad()
def _hf_post_norm(path: str, token_ids: list[int], add: float) -> dict[str, torch.Tensor]:
    """transformers' ``post_attention_layernorm`` output of layer 1 (``add`` added by a forward
    hook, as siterec's edit does) and the residual stream after the last layer."""
    model = hf_model(path)
    layers = model.model.layers
    seen = {}

    def norm_hook(_m, _i, out):
        seen["postnorm.1"] = out[0] + add
        return out + add

    def last_hook(_m, _i, out):
        seen["layer.3"] = (out[0] if isinstance(out, tuple) else out)[0]

    handles = [
        layers[1].post_attention_layernorm.register_forward_hook(norm_hook),
        layers[-1].register_forward_hook(last_hook),
    ]
    try:
        model(torch.tensor([token_ids]))
    finally:
        for h in handles:
            h.remove()
    return seen


def test_plugin_site_is_read_and_edited_like_transformers(tiny_model, run):
    outs, report = run
    assert report["runtime"]["rows_captured.postnorm.1"] > 0
    values = report["results"]["siterec"]["values"]
    checked = 0
    for o, c, seq, add in _sequences(outs):
        rows = values[f"{o.request_id}/{c.index}"]
        want = _hf_post_norm(tiny_model, seq, add)
        for key in ("postnorm.1", "layer.3"):
            got = torch.tensor([(rows.get(str(p)) or rows[p])[key] for p in range(len(seq) - 1)])
            torch.testing.assert_close(got, want[key][: len(seq) - 1], rtol=1e-4, atol=1e-4)
        checked += 1
    assert checked == 4
    # the edit moved the stream: prompt 1's last layer differs from an unedited forward
    o = outs[1]
    seq = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
    plain = _hf_post_norm(tiny_model, seq, 0.0)["layer.3"]
    assert not torch.allclose(plain, _hf_post_norm(tiny_model, seq, ADD)["layer.3"], atol=1e-3)
