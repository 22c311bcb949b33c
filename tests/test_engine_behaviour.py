"""Real vLLM (CPU, in-process): non-intrusion, failure isolation, ESamp end to end."""

from __future__ import annotations

import pytest
from conftest import ENGINE_KW

pytestmark = pytest.mark.vllm

VOCAB = 49152  # the tiny models' tokenizer (SmolLM2)
PROMPTS = ["Write a poem about the sea.", "Tell me a story", "List three colours and explain"]


def _params():
    from vllm import SamplingParams

    return [
        SamplingParams(n=3, max_tokens=12, seed=11, temperature=1.0, min_p=0.1),
        SamplingParams(n=2, max_tokens=12, seed=12, temperature=1.0),  # no filter: full vocab
        SamplingParams(n=2, max_tokens=12, seed=13, temperature=0.8, top_k=20, top_p=0.9),
    ]


def _tokens(outputs):
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def _decode_rows(tokens) -> int:
    """Sampling rows of decode steps, counted from the outputs (the first token of each
    completion is sampled at the end of its prefill)."""
    return sum(max(len(c) - 1, 0) for o in tokens for c in o)


@pytest.fixture(scope="module")
def plain_tokens(tiny_model, engines):
    from vllm import LLM

    llm = engines.get(("plain", tiny_model), lambda: LLM(tiny_model, **ENGINE_KW))
    return _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False))


def _tllm(engines, model, consumers, **kw):
    from tllm_core.app.engine import TllmLLM

    return engines.get(
        ("tllm", model, repr(consumers)), lambda: TllmLLM(model, consumers, **ENGINE_KW, **kw)
    )


def test_runtime_without_consumers_is_identical_to_plain_vllm(tiny_model, engines, plain_tokens):
    llm = _tllm(engines, tiny_model, [])
    assert _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False)) == plain_tokens
    assert llm.collect()["runtime"]["engine_steps"] > 0


def test_read_only_failing_and_beta_zero_consumers_leave_output_identical(
    tiny_model, engines, plain_tokens
):
    consumers = ["stats", 'crasher:{"after": 3}', 'esamp:{"beta": 0.0}']
    # The opt-out: the disabled crasher is only reported (test_author_errors.py: raised).
    llm = _tllm(engines, tiny_model, consumers, raise_on_disabled=False)
    toks = _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False))
    assert toks == plain_tokens
    rep = llm.collect()
    rt = rep["runtime"]
    # one token per request per step: at least as many steps as the longest completion
    assert rt["engine_steps"] >= max(len(c) for o in toks for c in o)
    # the failing consumer is reported by name (its first error, then the one that switched
    # it off: it fails on every bundle, 3 in a row), counted, and switched off; others go on
    assert rt["consumer_errors"] == 3 and rt["consumer_errors.crasher"] == 3, rep["errors"]
    assert rt["consumers_disabled"] == 1
    assert [(e["consumer"], e["disabled"]) for e in rep["errors"]] == [
        ("crasher", False),
        ("crasher", True),
    ]
    assert "deliberate failure" in rep["errors"][0]["error"]
    assert rep["consumers"]["stats"]["bundles"] == rt["engine_steps"]
    # beta = 0 ran the whole guidance path (rows visited, distiller trained) and changed
    # nothing, so no row counts as guided, in ESamp's counters nor in the runtime's
    es = rep["consumers"]["esamp"]
    assert es["rows_visited"] > 0 and es["optimizer_steps"] > 0
    assert es["rows_guided"] == 0 and rt.get("rows_guided", 0) == 0
    assert rt["rows_guide_visited"] > 0
    # ESamp visits decode rows only, at most once per step: bounded by the decode rows
    # counted from the outputs (not by another counter fed from the same value)
    assert es["rows_visited"] <= _decode_rows(toks), (es["rows_visited"], _decode_rows(toks))


def test_esamp_trains_guides_and_changes_text(tiny_model, engines, plain_tokens):
    llm = _tllm(engines, tiny_model, ['esamp:{"beta": 0.5}'])
    toks = _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False))
    assert toks != plain_tokens
    rep = llm.collect()
    es = rep["consumers"]["esamp"]
    for name in (
        "optimizer_steps",
        "rows_trained",
        "rows_guided",
        "candidates_guided",
        "groups_created",
        "groups_freed",
        "rows_skipped",
    ):
        assert es[name] > 0, name
    assert es["groups_alive"] == 0 and es["groups_created"] == es["groups_freed"] == 3
    decode_rows = _decode_rows(toks)
    assert es["rows_guided"] <= decode_rows, (es["rows_guided"], decode_rows)
    # every guided row has at least one candidate, and at most the vocabulary
    assert es["rows_guided"] <= es["candidates_guided"] <= es["rows_guided"] * VOCAB
    # training ran on finite losses only: the counter must exist and be 0
    assert es["nonfinite_losses_skipped"] == 0
    assert es["optimizer_steps"] <= es["rows_trained"]
    assert rep["errors"] == []
    assert rep["runtime"]["rows_without_candidates"] == 0  # ESamp never empties a row


def test_a_guide_that_leaves_rows_nothing_to_draw_from_is_counted(tiny_model, engines):
    """``emptier`` writes -inf over every candidate of sample 1's rows: the runtime counts
    each such sampling row once (one pass over the logits after the guides, on the device)."""
    from vllm import SamplingParams

    llm = _tllm(engines, tiny_model, ["emptier"])
    params = SamplingParams(n=2, max_tokens=3, seed=5, top_k=20, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [3] * 4
    rep = llm.collect()
    emptied = rep["consumers"]["emptier"]["rows_emptied"]
    assert rep["runtime"]["rows_without_candidates"] == emptied == 2 * 3  # prompts x tokens


def test_samples_scheduled_one_at_a_time_share_one_distiller(tiny_model, engines):
    """max_num_seqs=1: each sample of the prompt waits until its sibling has finished, and
    still continues the prompt's distiller (TllmLLM tags the requests with their n)."""
    from vllm import SamplingParams

    from tllm_core.app.engine import TllmLLM

    consumers = ['esamp:{"beta": 0.5}']
    make = lambda: TllmLLM(tiny_model, consumers, max_num_seqs=1, **ENGINE_KW)  # noqa: E731
    llm = engines.get(("tllm-one-seq", tiny_model), make)
    llm.generate(PROMPTS[:1], SamplingParams(n=3, max_tokens=6, seed=3), use_tqdm=False)
    es = llm.collect()["consumers"]["esamp"]
    assert es["groups_created"] == es["groups_freed"] == 1 and es["groups_alive"] == 0
    assert es["optimizer_steps"] > 0


def test_per_request_consumer_acts_only_on_requests_that_ask(tiny_model, engines, plain_tokens):
    spec = {"name": "esamp", "config": {"beta": 1.0}, "per_request": True}
    llm = _tllm(engines, tiny_model, [spec])
    params = _params()
    params[0] = params[0].clone()
    params[0].extra_args = {"tllm_consumers": "esamp"}
    toks = _tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    assert toks[1:] == plain_tokens[1:], "requests that did not ask must be untouched"
    assert toks[0] != plain_tokens[0]
    es = llm.collect()["consumers"]["esamp"]
    assert es["groups_created"] == 1 and es["rows_guided"] > 0 and es["groups_alive"] == 0
