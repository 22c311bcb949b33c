"""A third-party producer-backed port (tests/plugin_pkg, ``rnorm.{i}``), found through its
entry point and served inside a real engine, equals the norm of transformers' residual
stream at every position."""

from __future__ import annotations

import pytest
import torch
from conftest import ENGINE_KW
from reference import hf_states

pytestmark = pytest.mark.vllm


def test_third_party_port_matches_transformers(tiny_model, engines):
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM

    llm = engines.get(
        ("normrec", tiny_model),
        lambda: TllmLLM(tiny_model, ["normrec"], enable_prefix_caching=False, **ENGINE_KW),
    )
    outs = llm.generate(["Hello there", "A B C D"], SamplingParams(n=2, max_tokens=4, seed=1))
    report = llm.collect()
    engines.close()
    res = report["results"]["normrec"]
    assert res["key"] == "rnorm.3" and report["runtime"]["rows_captured.rnorm.3"] > 0
    checked = 0
    for o in outs:
        for c in o.outputs:
            seq = list(o.prompt_token_ids) + list(c.token_ids)
            norms = res["norms"][f"{o.request_id}/{c.index}"]
            assert sorted(int(p) for p in norms) == list(range(len(seq) - 1))
            want = hf_states(tiny_model, seq)["layer.3"].norm(dim=-1)
            got = torch.tensor(
                [norms[str(p)] if str(p) in norms else norms[p] for p in range(len(seq) - 1)]
            )
            torch.testing.assert_close(got, want[: len(seq) - 1], rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked == 4
