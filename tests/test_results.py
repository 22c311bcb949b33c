"""Per-request results returned with the completion (issue 45 item 2): a request asks with
``tllm_results``; each named consumer's ``request_result`` travels back on its completion
(offline: ``completion.tllm``; the kit: ``kit.results``), bounded, validated before
generation. Values are checked against transformers on the same tokens."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import ENGINE_KW
from reference import hf_model, hf_states

from tllm_core.api.consumer_spec import ConsumerSpec
from tllm_core.api.results import decode_results, encode, json_bytes


def test_arrays_round_trip_through_json():
    import json

    value = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": [np.int64(3), np.array([1, 2], np.int64)],
        "c": torch.ones(2, dtype=torch.bfloat16),
        "text": "x",
    }
    wire = json.loads(json.dumps(encode(value)))
    back = decode_results({**wire, "spread": ["NaN", "Infinity", "-Infinity"]})  # strict JSON
    assert np.isnan(back["spread"][0]) and back["spread"][1:] == [np.inf, -np.inf]
    assert back["a"].dtype == np.float32 and back["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert back["b"][0] == 3 and back["b"][1].tolist() == [1, 2]
    assert back["c"].dtype == np.float32 and back["c"].tolist() == [1.0, 1.0]
    assert back["text"] == "x"
    assert json_bytes(encode(value)) == len(json.dumps(encode(value), separators=(",", ":")))


def test_request_rows_keep_columns_until_their_limit_and_say_why_when_not():
    from tllm_core.api.results import RequestRows

    rows = RequestRows(limit=60, what="x")  # 60 bytes of base64: 45 bytes of rows
    rows.add("a", v=np.arange(4, dtype=np.int32))
    rows.add("a", v=np.arange(2, dtype=np.int32))
    assert rows.take("a", {"v": []})["v"].tolist() == [0, 1, 2, 3, 0, 1]
    assert rows.take("a", {"v": []}) == {"v": []}  # taken: forgotten
    for _ in range(3):  # 48 bytes: past the limit, then still counted
        rows.add("b", v=np.zeros(4, np.int32))
    over = rows.take("b", {})
    assert "more than 48 bytes" in over["error"] and over["limit"] == 60
    rows.add("c", v=np.zeros(1, np.int32))
    rows.lose("c")
    rows.add("c", v=np.zeros(1, np.int32))  # after a loss: ignored
    assert "dropped" in rows.take("c", {})["error"] and rows.take("c", {}) == {}


def test_the_result_store_is_bounded_and_refuses_large_results():
    from tllm_core.api.counters import Counters
    from tllm_core.api.rows import RequestInfo
    from tllm_core.runtime.request_results import ResultStore

    counters = Counters()
    store = ResultStore(counters, max_result_bytes=2048, max_requests=3)

    def req(i: int) -> RequestInfo:
        return RequestInfo(f"r{i}-abcdefgh", f"r{i}", i, 0, 4)

    store.put(req(0), "c", np.zeros(2000, np.float32))  # ~10.7 kB of base64: refused
    got = store.take(["r0"])["r0"][0]["c"]
    assert "past this engine's limit of 2048" in got["error"] and got["bytes"] > 2048
    for i in range(1, 6):
        store.put(req(i), "c", {"v": i})
    assert len(store) == 3 and counters.snapshot()["results_expired"] == 2
    got = store.take(["r1", "r5"])  # r1 was dropped: its taker is told so
    assert got["r5"] == {0: {"c": {"v": 5}}} and "dropped" in got["r1"][0]["c"]["error"]
    snap = counters.snapshot()
    assert snap["results_made"] == 5 and snap["results_refused"] == 1
    assert snap["results_taken"] == 2  # r0's error and r5's result
    store.put(req(6), "c", {"not json": {1, 2}})  # a set: not JSON-able
    assert "not JSON-able" in store.take(["r6"])["r6"][0]["c"]["error"]
    assert counters.snapshot()["results_failed"] == 1


def test_results_of_a_request_cut_short_are_dropped_at_once():
    """A request its caller aborted (a client gone, a sibling prompt refused): nobody takes
    its result, so it is not kept; results of requests that ended on their own are kept, its
    sibling samples' too (a stream whose other prompt failed still takes them). A response
    that still waits for the dropped one gets an error at once, not the wait."""
    from tllm_core.api.counters import Counters
    from tllm_core.api.rows import RequestInfo
    from tllm_core.runtime.request_results import ResultStore

    counters = Counters()
    store = ResultStore(counters, max_result_bytes=2048)
    store.put(RequestInfo("0_a-abcdefgh", "a", 0, 0, 4), "c", {"v": 0})  # ended before
    cut = RequestInfo("1_a-abcdefgh", "a", 0, 1, 4)
    cut.cut_short = True
    store.put(RequestInfo("b-abcdefgh", "b", 0, 0, 4), "c", {"v": 2})
    store.put(cut, "c", {"v": 1})
    assert len(store) == 2 and counters.snapshot()["results_discarded"] == 1
    assert store._total == 2 * len('{"v":2}')  # a's sample 0 and b: not the one cut short
    cut_error = {"c": {"error": "cut short: the request was aborted before its end"}}
    want = {"a": {0: {"c": {"v": 0}}, 1: cut_error}, "b": {0: {"c": {"v": 2}}}}
    assert store.take(["a", "b"]) == want
    assert store._total == 0 and store.take(["a"]) == {}


def test_results_of_a_failed_response_are_discarded_at_once():
    """A prompt refused (its response fails): what the prompts admitted before it left in the
    store, results and errors, goes at once, counted as discarded; other requests keep theirs."""
    from tllm_core.api.counters import Counters
    from tllm_core.api.rows import RequestInfo
    from tllm_core.runtime.request_results import ResultStore

    counters = Counters()
    store = ResultStore(counters, max_result_bytes=2048)
    for engine_id, rid, sample in [("0_a-0-x", "a-0", 0), ("1_a-0-x", "a-0", 1), ("b-x", "b", 0)]:
        store.put(RequestInfo(engine_id, rid, 0, sample, 4), "c", {"v": sample})
    cut = RequestInfo("a-1-x", "a-1", 1, 0, 4)
    cut.cut_short = True
    store.put(cut, "c", {"v": 3})
    store.discard(["a-0", "a-1"])
    assert counters.snapshot()["results_discarded"] == 1 + 2  # cut short, then the 2 kept
    assert len(store) == 1 and store._total == len('{"v":0}') and not store._dropped
    # A background consumer's result that comes after: dropped too (nothing waited for it).
    store.put(RequestInfo("2_a-0-x", "a-0", 0, 2, 4), "c", {"v": 2})
    snap = counters.snapshot()
    assert snap["results_discarded"] == 4 and snap["results_made"] == 4 and len(store) == 1
    assert store.take(["a-0", "a-1", "b"]) == {"b": {0: {"c": {"v": 0}}}}
    # A new request with that caller id (a client's retry reuses its id) keeps its results,
    # as does any after UNWANTED_S; a late result of the discarded request is still dropped.
    store.reuse("a-0", "0_a-0-y")
    store.put(RequestInfo("0_a-0-y", "a-0", 0, 0, 4), "c", {"v": 5})
    store.put(RequestInfo("3_a-0-x", "a-0", 0, 3, 4), "c", {"v": 3})
    assert store.take(["a-0"]) == {"a-0": {0: {"c": {"v": 5}}}}
    store._unwanted["a-1"] = 0.0
    store.put(RequestInfo("0_a-1-y", "a-1", 0, 0, 4), "c", {"v": 6})
    assert store.take(["a-1"]) == {"a-1": {0: {"c": {"v": 6}}}}
    # A discarded request the engine first sees after its discard (queued, then scheduled
    # once before vLLM's abort) is no retry: its results and its samples' are still dropped.
    store.discard(["q"], ["q-x"])
    for engine_id, sample in (("q-x", 0), ("1_q-x", 1)):
        store.reuse("q", engine_id, "q-x")  # hooks: parse_engine_id's parent
        store.put(RequestInfo(engine_id, "q", 0, sample, 4), "c", {"v": 7})
    store.reuse("q", "q-y")  # a retry under that id: its own are kept
    store.put(RequestInfo("q-y", "q", 0, 0, 4), "c", {"v": 8})
    assert store.take(["q"]) == {"q": {0: {"c": {"v": 8}}}}
    # Ids reused after that: nothing more remembered for them (a client with a fixed id).
    for i in range(3):
        store.reuse("a-1", f"0_a-1-{i}")
    assert "a-1" not in store._unwanted and "a-1" not in store._reused


def test_kit_returns_the_exported_rows_of_the_requests_that_ask(tiny_model):
    from tllm_core.testing import ConsumerKit

    cfg = {"out": None, "layers": [0, -1], "phase": "all"}
    kit = ConsumerKit(tiny_model, [{"name": "export", "config": cfg}])
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10]]
    out = kit.generate(
        prompts,
        max_tokens=3,
        temperature=0.0,
        extra_args=[{"tllm_results": "export"}, None],
    )
    assert set(kit.results) == {(0, 0)}  # the second request did not ask
    got = kit.results[(0, 0)]["export"]
    tokens = prompts[0] + out[0][0]
    assert got["positions"].tolist() == list(range(len(tokens) - 1))
    assert got["token_ids"].tolist() == tokens[:-1]
    ref = hf_states(tiny_model, tokens[:-1])
    for key in ("layer.0", "layer.3"):
        assert got[key].shape == (len(tokens) - 1, ref[key].shape[-1])
        torch.testing.assert_close(torch.from_numpy(got[key]), ref[key], rtol=1e-4, atol=1e-4)
    report = kit.close()
    assert report["runtime"]["results_made.export"] == 1
    assert report["consumers"]["export"]["rows_returned"] == len(tokens) - 1
    assert report["results"]["export"]["out"] is None  # no files


def test_export_counts_where_its_time_goes(tiny_model, tmp_path):
    """The counters that say where export's time goes are counted where the work is: the
    engine thread's host copies for a background consumer, the export's thread on its
    bundles and on writing the shard."""
    from tllm_core.testing import ConsumerKit

    cfg = {"out": str(tmp_path / "x"), "layers": [0, -1]}
    kit = ConsumerKit(tiny_model, [{"name": "export", "config": cfg}])
    kit.generate([[3, 4, 5]], max_tokens=3, temperature=0.0)
    report = kit.close()
    assert report["runtime"]["host_s.to_host"] > 0
    taking = report["consumers"]["export"]["seconds_taking"]
    writing = report["consumers"]["export"]["seconds_writing"]
    assert taking > 0 and writing > 0


def test_asking_is_checked_before_generation(tiny_model):
    from tllm_core.testing import ConsumerKit

    kit = ConsumerKit(tiny_model, [{"name": "stats", "config": {}}])
    with pytest.raises(ValueError, match=r"tllm_results.*'nope'.*not configured"):
        kit.generate([[3, 4]], max_tokens=1, extra_args={"tllm_results": "nope"})
    with pytest.raises(ValueError, match=r"tllm_results.*comma-separated"):
        kit.generate([[3, 4]], max_tokens=1, extra_args={"tllm_results": 3})


@torch.no_grad()
def test_tllm_llm_returns_exported_rows_on_each_completion(tiny_model, engines):
    """Offline, V1: two samples of one prompt ask, a concurrent prompt does not."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from tllm_core import TllmLLM

    spec = {"name": "export", "config": {"out": None, "layers": [1], "phase": "generated[0:4]"}}
    llm = engines.get(
        ("results-export", tiny_model),
        lambda: TllmLLM(tiny_model, [spec], enable_prefix_caching=False, **ENGINE_KW),
    )
    ask = SamplingParams(
        n=2, max_tokens=6, temperature=1.0, seed=1, extra_args={"tllm_results": "export"}
    )
    plain = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    outs = llm.generate(prompts, [ask, plain], use_tqdm=False)
    assert not hasattr(outs[1].outputs[0], "tllm")
    assert len(outs[0].outputs) == 2
    for c in outs[0].outputs:
        got = c.tllm["export"]
        tokens = [5, 6, 7, 8, *c.token_ids]
        # generated[0:4]: positions 4..7 (the first four generated tokens fed back)
        assert got["positions"].tolist() == [4, 5, 6, 7]
        assert got["token_ids"].tolist() == tokens[4:8]
        ref = hf_states(tiny_model, tokens[:8])["layer.1"][4:8]
        torch.testing.assert_close(torch.from_numpy(got["layer.1"]), ref, rtol=1e-3, atol=1e-3)


def test_tllm_serve_returns_rows_with_the_completion_to_the_openai_client(
    tiny_model, guarded_server
):
    """The issue's "done when", on the shared server (conftest's ``guarded_server``: export
    per request, no files, 64 KiB results): the OpenAI Python client asks for export's rows
    at a window and gets them in the response, non-streamed and streamed, equal to
    transformers; a chat completion too; a request whose rows could pass the limit gets HTTP
    400 and the server goes on; a concurrent request that did not ask gets no results."""
    import concurrent.futures

    import openai

    import tllm_core

    prompt = [5, 6, 7, 8, 9]
    # export's rows of a window of this request: its first three generated tokens
    xargs = {"tllm_consumers": "export", "tllm_results": "export"}
    ask = {"vllm_xargs": {**xargs, "tllm_export_window": "generated[0:3]"}}
    url, key = guarded_server.url, guarded_server.key
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)

    def complete(body: dict, **kw):
        return client.completions.create(
            model="default", prompt=prompt, temperature=0.0, extra_body=body, **kw
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        asked = pool.submit(complete, ask, max_tokens=6)
        plain = pool.submit(complete, {}, max_tokens=6)
        r, p = asked.result(timeout=300), plain.result(timeout=300)
    assert getattr(p, "tllm", None) is None  # did not ask: no results
    assert r.choices[0].text == p.choices[0].text  # asking changes nothing generated
    [entry] = r.tllm
    rows = tllm_core.decode_results(entry)["export"]
    assert rows["positions"].tolist() == [5, 6, 7]
    tokens = prompt + rows["token_ids"].tolist()  # the first 3 generated tokens
    with torch.no_grad():  # ... are transformers' greedy choices
        logits = hf_model(tiny_model)(torch.tensor([tokens])).logits[0]
    assert logits[4:7].argmax(-1).tolist() == tokens[5:8]
    ref = hf_states(tiny_model, tokens)
    for key_ in ("layer.0", "layer.3"):
        torch.testing.assert_close(
            torch.from_numpy(rows[key_]), ref[key_][5:8], rtol=1e-3, atol=1e-3
        )

    # Streamed: the results arrive in one event before [DONE].
    events = list(complete(ask, max_tokens=6, stream=True))
    text = "".join(e.choices[0].text for e in events if e.choices)
    assert text == r.choices[0].text
    [last] = [e for e in events if getattr(e, "tllm", None)]
    streamed = tllm_core.decode_results(last.tllm[0])["export"]
    np.testing.assert_array_equal(streamed["layer.3"], rows["layer.3"])

    # A chat completion, its prompt's last token (the chat template's) only.
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"vllm_xargs": {**xargs, "tllm_export_window": "last_prompt"}},
    )
    [one] = tllm_core.decode_results(chat.tllm[0])["export"]["positions"].tolist()
    assert one == chat.usage.prompt_tokens - 1

    # Past the limit: all rows (the config's window), 2 keys x 300 rows x hidden 128 x 4
    # bytes > 64 KiB: refused before generating.
    with pytest.raises(openai.BadRequestError) as ei:
        complete({"vllm_xargs": xargs}, max_tokens=300)
    assert ei.value.status_code == 400 and "max_result_bytes" in ei.value.message
    again = complete(ask, max_tokens=3)  # the server goes on
    assert tllm_core.decode_results(again.tllm[0])["export"]["positions"].tolist() == [5, 6]


def test_tllm_serve_refuses_prompts_that_together_overflow_the_results_store(
    tiny_model, guarded_server
):
    """A completion request with a list of prompts (vLLM runs each as its own request): each
    prompt's 4 choices fit the store (8 x 64 KiB), 4 prompts together could not: HTTP 400
    before generating, not results dropped uncollected after; 2 prompts that fit get all."""
    import time

    import openai
    from serve_util import get_json

    import tllm_core

    url, key = guarded_server.url, guarded_server.key
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    xargs = {"tllm_consumers": "export", "tllm_results": "export"}

    def complete(prompts: list[list[int]], window: str, **kw):
        body = {"vllm_xargs": {**xargs, "tllm_export_window": window}, "ignore_eos": True}
        return client.completions.create(model="default", prompt=prompts, extra_body=body, **kw)

    def sampled() -> int:
        return get_json(f"{url}/tllm/counters", key)["runtime"].get("rows_captured.sampled", 0)

    before = sampled()
    # generated[0:30]: 30 rows x 2 layers x hidden 128, as base64: 41984 bytes a choice
    with pytest.raises(openai.BadRequestError) as ei:
        complete([[5, 6, 7, 8, 9]] * 4, "generated[0:30]", n=4, max_tokens=40)
    message = str(ei.value)
    assert "4 prompts x 4 choices could hold up to 671744 bytes, past the 524288" in message
    assert "fewer prompts, choices (n) or rows" in message
    # The prompts admitted before the refused one were aborted, not run on: once the engine
    # is idle (no request open, no rows added for 1 s; run on, they would end by then), they
    # made fewer than half their rows.
    deadline, rows, quiet = time.monotonic() + 120, sampled(), 0
    while quiet < 5:
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.2)
        idle = get_json(f"{url}/tllm/status", key)["worker"]["requests_open"] == 0
        quiet, rows = (quiet + 1 if idle and sampled() == rows else 0), sampled()
    assert rows - before < 3 * 4 * 40 // 2, (before, rows)
    r = complete([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]], "generated[0:3]", n=2, max_tokens=4)
    assert [e["index"] for e in r.tllm] == [0, 1, 2, 3] and len(r.choices) == 4
    for entry in r.tllm:
        assert tllm_core.decode_results(entry)["export"]["positions"].tolist() == [5, 6, 7]


def test_tllm_serve_a_stream_with_a_refused_prompt_leaves_no_results_behind(guarded_server):
    """A streamed completion whose third prompt would overflow the results store: the client
    gets one error event naming the bound and the prompts, no results; the two prompts
    admitted before (one step each: they may end before vLLM aborts them) leave nothing in
    the store, every result of theirs discarded; another client's request then gets its own.
    Whether they end before the abort depends on timing (without the server's discard, 7 of
    8 results were once kept); test_server_guards checks the discard itself."""
    import time

    import httpx
    from serve_util import get_json

    import tllm_core

    url, key = guarded_server.url, guarded_server.key
    xargs = {"tllm_consumers": "export", "tllm_results": "export"}
    prompt = list(range(5, 45))  # 41 rows x 2 layers x hidden 128: ~56 kB a choice, 4 a prompt

    def runtime() -> dict:
        return get_json(f"{url}/tllm/counters", key)["runtime"]

    def idle() -> tuple[int, int]:  # once the engine ran every request: (kept, discarded)
        deadline = time.monotonic() + 60
        while get_json(f"{url}/tllm/status", key)["worker"]["requests_open"]:
            assert time.monotonic() < deadline, "the engine never went idle"
            time.sleep(0.1)
        got = get_json(f"{url}/tllm/counters", key)
        run, cut = got["runtime"], got["consumers"]["export"].get("requests_cut_short", 0)
        # made, less taken, less discarded after made (discarded: also those cut short)
        kept = run.get("results_made", 0) - run.get("results_taken", 0)
        return kept - run.get("results_discarded", 0) + cut, run.get("results_discarded", 0)

    before = idle()
    body = {"model": "default", "prompt": [prompt] * 3, "n": 4, "max_tokens": 1}
    body |= {"stream": True, "vllm_xargs": xargs}
    headers = {"Authorization": f"Bearer {key}"}
    got = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert got.status_code == 200, got.text  # a stream: its headers left before the refusal
    events = [e[6:] for e in got.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", got.text
    parsed = [json.loads(e) for e in events[:-1]]
    assert not [e for e in parsed if "tllm" in e], got.text  # no results to return
    [error] = [e["error"] for e in parsed if "error" in e]
    message = error["message"]
    assert re.search(
        r"first 3 prompts x 4 choices could hold up to \d+ bytes, past the 524288", message
    ), message
    assert "fewer prompts, choices (n) or rows" in message
    # Each of the 2 x 4 choices admitted: never run (aborted first), cut short, or its result
    # made and then discarded (the server does that once the client has its [DONE]).
    deadline = time.monotonic() + 60
    while (after := idle())[0] != before[0]:
        assert time.monotonic() < deadline, f"kept: {after[0] - before[0]} results"
        time.sleep(0.2)

    plain = {**body, "prompt": [5, 6, 7], "n": 1, "max_tokens": 2, "stream": False}
    plain["vllm_xargs"] = {**xargs, "tllm_export_window": "last_prompt"}
    r = httpx.post(f"{url}/v1/completions", json=plain, headers=headers, timeout=120).json()
    assert tllm_core.decode_results(r["tllm"][0])["export"]["positions"].tolist() == [2]
    assert runtime().get("results_discarded", 0) == after[1]


def test_tllm_serve_requests_ended_by_a_stop_string_are_not_cut_short(guarded_server):
    """vLLM's output handler aborts in the engine core the requests its detokenizer ended on a
    stop string: they ran to their end (finish_reason "stop"), so consumers do not hear them
    as cut short, and their results come back. A client gone mid-generation is cut short."""
    import openai
    from serve_util import get_json
    from test_serve_state import _leave_while_running

    import tllm_core

    url, key = guarded_server.url, guarded_server.key
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    xargs = {"tllm_consumers": "export", "tllm_results": "export"}
    body = {"vllm_xargs": {**xargs, "tllm_export_window": "last_prompt"}, "ignore_eos": True}

    def complete(**kw):
        return client.completions.create(
            model="default", prompt=[5, 6, 7, 8, 9], temperature=0.0, extra_body=body, **kw
        )

    def cut_short() -> int:
        export = get_json(f"{url}/tllm/counters", key)["consumers"]["export"]
        return export.get("requests_cut_short", 0)

    def runtime() -> dict:
        return get_json(f"{url}/tllm/counters", key)["runtime"]

    # Greedy: a character of the first generated token ends the request at once.
    stop = complete(max_tokens=1).choices[0].text.strip()[:1]
    assert stop, "the first token has no visible text"
    before = cut_short()
    r = complete(max_tokens=8, stop=[stop])
    assert (r.choices[0].finish_reason, r.choices[0].stop_reason) == ("stop", stop)
    # on_request_finished ran before the result was made, so the counter is up to date
    assert tllm_core.decode_results(r.tllm[0])["export"]["positions"].tolist() == [4]
    assert cut_short() == before

    # A client gone mid-generation: its request is cut short, and its results, which nobody
    # will take, leave the store as it ends.
    discarded: list[int] = []

    def watch():
        counted = runtime()
        made, discarded[:] = counted.get("results_made", 0), [counted.get("results_discarded", 0)]
        cut = cut_short()

        def heard() -> bool | None:
            counted = runtime()
            if counted.get("results_made", 0) > made:  # made: it ran to its end
                return False
            if cut_short() > cut and counted.get("results_discarded", 0) > discarded[0]:
                return True
            return None

        return heard

    _leave_while_running(url, [5, 6, 7], 400, body["vllm_xargs"], key=key, watch=watch)
    assert runtime().get("results_discarded", 0) == discarded[0] + 1


def test_tllm_serve_aborts_a_stream_whose_client_went_away(guarded_server):
    """A streamed completion's client gone: anyio cancels the handler at every await, also
    while tllm marks the request cut short; the engine still gets the abort, so the request
    does not run on to max_tokens (measured by the rows export captured for it)."""
    from serve_util import get_json
    from test_serve_state import _leave_while_running

    url, key = guarded_server.url, guarded_server.key

    def sampled() -> int:
        return get_json(f"{url}/tllm/counters", key)["runtime"].get("rows_captured.sampled", 0)

    def watch():
        before = sampled()

        def heard() -> bool | None:
            if get_json(f"{url}/tllm/status", key)["worker"]["requests_open"]:
                return None
            # Fewer than max_tokens: it was aborted (without the abort all 480 rows came); how
            # many before the abort landed depends on the machine's speed.
            return sampled() - before < 480

        return heard

    xargs = {"tllm_consumers": "export"}
    _leave_while_running(url, [5, 6, 7], 480, xargs, key=key, stream=True, watch=watch)


def test_kit_returns_stats_figures_and_sae_top_features(tiny_model, tmp_path):
    """``stats`` returns its per-request figures and ``sae`` each token's top features, both
    equal to what transformers' hidden states give on the same tokens."""
    from consumers.sae.loader import save_sae
    from consumers.sae.model import SparseAutoencoder
    from tllm_core.testing import ConsumerKit

    g = torch.Generator().manual_seed(3)
    d_in, d_sae, k = 128, 64, 4
    w_enc = torch.randn(d_in, d_sae, generator=g) / d_in**0.5
    path = save_sae(
        SparseAutoencoder(
            W_enc=w_enc,
            b_enc=torch.zeros(d_sae),
            W_dec=torch.randn(d_sae, d_in, generator=g),
            b_dec=torch.zeros(d_in),
            architecture="standard",
        ),
        tmp_path / "sae",
    )
    sae = {"path": path, "site": 1, "top_k": k, "phase": "decode"}
    kit = ConsumerKit(
        tiny_model,
        [{"name": "stats", "config": {"layers": [1]}}, {"name": "sae", "config": sae}],
    )
    prompt = [3, 4, 5, 6]
    out = kit.generate(
        [prompt], max_tokens=5, temperature=0.0, extra_args={"tllm_results": "stats,sae"}
    )
    got = kit.results[(0, 0)]
    tokens = prompt + out[0][0]
    h = hf_states(tiny_model, tokens[:-1])["layer.1"]
    figures = got["stats"]["layer.1"]
    assert figures["rows"] == len(tokens) - 1
    assert figures["mean_norm"] == pytest.approx(h.norm(dim=-1).mean().item(), rel=1e-4)
    assert figures["max_abs"] == pytest.approx(h.abs().max().item(), rel=1e-4)
    feats = got["sae"]
    dec = h[len(prompt) :]  # decode rows: positions 4.. (the generated tokens fed back)
    assert feats["positions"].tolist() == list(range(len(prompt), len(tokens) - 1))
    acts = torch.relu(dec @ w_enc)
    top = torch.topk(acts, k, dim=-1)
    for row in range(len(dec)):
        assert set(feats["features"][row].tolist()) == set(top.indices[row].tolist())
        np.testing.assert_allclose(
            np.sort(feats["values"][row]), np.sort(top.values[row].numpy()), rtol=1e-3, atol=1e-4
        )
    assert kit.close()["consumers"]["sae"]["rows_returned"] == len(dec)


@pytest.mark.parametrize("runner", ["v1", pytest.param("v2", marks=pytest.mark.slow)])
def test_tllm_run_results_on_v1_and_v2(tiny_model, runner, capsys):
    """``tllm run --results``: each sample's result in the JSON, on both model runners (V2
    through Triton's interpreter, ~2 min: slow; V1 in this process: the results' way from
    vLLM's engine process is the server's, test_tllm_serve_returns_rows...), equal to
    transformers; a bad name is refused before vLLM starts."""
    from cli_util import v2_env
    from conftest import cli_in_process, cli_json, run_cli

    import tllm_core
    from tllm_core.app.cli import main

    spec = {"out": None, "layers": [1], "phase": "last_prompt"}
    args = ["run", "--model", tiny_model, "--consumer", f"export:{json.dumps(spec)}"]
    args += ["--results", "export", "--prompt", "sea rain stone", "--prompt", "light"]
    args += ["-n", "1", "--max-tokens", "2", "--temperature", "0", "--no-chat"]
    args += ["--enforce-eager", "--max-model-len", "256", "--kv-cache-gib", "1"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    if runner == "v2":
        out = cli_json(run_cli(*args, "--json", env=v2_env()))
    else:
        out = cli_in_process(*args)
    assert out["run"]["runner"].startswith(runner.upper()), out["run"]["runner"]
    for text, per_prompt in zip(["sea rain stone", "light"], out["request_results"], strict=True):
        ids = tok(text).input_ids
        rows = tllm_core.decode_results(per_prompt[0])["export"]
        assert rows["positions"].tolist() == [len(ids) - 1]  # the last prompt token only
        assert rows["token_ids"].tolist() == [ids[-1]]
        ref = hf_states(tiny_model, ids)["layer.1"][-1]
        torch.testing.assert_close(torch.from_numpy(rows["layer.1"][0]), ref, rtol=1e-3, atol=1e-3)
    capsys.readouterr()
    assert main(["run", "--model", tiny_model, "--consumer", "stats", "--results", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--results" in err and "'nope'" in err, err


def test_result_bounds_follow_the_window_and_the_request():
    """The bound the server checks before generating: rows of the config's window, narrowed
    by the request's own, times the ports' widths (base64), plus positions and token ids."""
    from tllm_core.api.results import PlannedRequest
    from tllm_core.plugins.registry import Registry
    from tllm_core.serving.keys import EngineConsumers, result_bounds

    registry = Registry()
    spec = {"name": "export", "config": {"out": None, "layers": [0, 1], "phase": "all"}}
    specs = [ConsumerSpec.coerce(spec)]
    engine = EngineConsumers.of(specs, registry.check(specs), registry)
    ask = {"tllm_results": "export"}
    every = result_bounds(PlannedRequest(10, 20, 64, ask), engine)["export"]
    # 30 rows x 2 ports x 64 floats x 4 bytes, as base64, plus two int64 columns
    assert 4 * 30 * 2 * 64 * 4 // 3 < every <= 4 * 30 * 2 * 64 * 4 // 3 + 2048
    last = {**ask, "tllm_export_window": "last_prompt"}
    assert result_bounds(PlannedRequest(10, 20, 64, last), engine)["export"] < every / 10
    assert result_bounds(PlannedRequest(10, 20, 64, {}), engine) == {}


@torch.no_grad()
def test_tllm_llm_returns_esamp_errors_on_each_completion(tiny_model, engines):
    """Offline, V1: two samples of one prompt ask for esamp's errors and get one per decode
    row (every generated token fed back), finite and >= 0; a concurrent prompt does not ask
    and gets none."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from tllm_core import TllmLLM

    spec = {"name": "esamp", "config": {"intermediate_size": 16}}
    llm = engines.get(
        ("results-esamp", tiny_model),
        lambda: TllmLLM(tiny_model, [spec], enable_prefix_caching=False, **ENGINE_KW),
    )
    ask = SamplingParams(
        n=2, max_tokens=6, temperature=1.0, seed=1, extra_args={"tllm_results": "esamp"}
    )
    plain = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=2)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    outs = llm.generate(prompts, [ask, plain], use_tqdm=False)
    assert not any(hasattr(c, "tllm") for c in outs[1].outputs)
    assert len(outs[0].outputs) == 2
    for c in outs[0].outputs:
        got = c.tllm["esamp"]
        rows = len(c.token_ids) - 1  # the last sampled token is never fed back
        assert got["positions"].tolist() == list(range(4, 4 + rows)) and rows > 0
        assert got["prediction_error"].shape == (rows,)
        assert np.isfinite(got["prediction_error"]).all() and (got["prediction_error"] >= 0).all()


@torch.no_grad()
def test_vllm_esamp_errors_equal_a_reference_on_transformers_states(tiny_model, engines):
    """In vLLM, ESamp's distiller reads the spec's layers (h_1: the residual stream after
    decoder layer 0; h_L: the final state after the norm) and takes one Adam step per decode
    row: a one-sample request's returned errors equal a distiller trained independently
    (torch's Adam) on transformers' hidden states of the same tokens."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from tllm_core import TllmLLM

    cfg = {"intermediate_size": 16}
    spec = {"name": "esamp", "config": cfg}
    llm = engines.get(
        ("results-esamp", tiny_model),
        lambda: TllmLLM(tiny_model, [spec], enable_prefix_caching=False, **ENGINE_KW),
    )
    params = SamplingParams(
        max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, extra_args={"tllm_results": "esamp"}
    )
    prompt = [5, 6, 7, 8, 9]
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    got = out.tllm["esamp"]
    with torch.enable_grad():
        tokens = prompt + list(out.token_ids)
        decode = list(range(len(prompt), len(tokens) - 1))
        assert got["positions"].tolist() == decode and len(decode) > 2
        ref = hf_states(tiny_model, tokens[:-1])
        want = _distiller_reference(ref["layer.0"][decode], ref["final"][decode], cfg)
    np.testing.assert_allclose(got["prediction_error"], want, rtol=2e-3)


def _distiller_reference(x: torch.Tensor, target: torch.Tensor, cfg: dict) -> list[float]:
    """ESamp's row errors for one request's decode rows, one row per step, recomputed
    independently: the distiller from its seeded initial parameters, each row's error
    ``||f(x) - target||^2 / hidden`` taken before torch's own Adam step (clip 0.5) on it."""
    from algorithms.esamp.params import DistillerShape, init_params, split_params

    shape = DistillerShape(x.shape[-1], cfg["intermediate_size"], 2)
    theta = init_params(shape, "paper", 0)[None]
    params = [torch.nn.Parameter(p[0].clone()) for p in split_params(theta, shape)]
    opt = torch.optim.Adam(params, lr=4e-4, eps=1e-4, betas=(0.9, 0.999))
    errors = []
    for row in range(x.shape[0]):
        h = x[row : row + 1]
        for blk in range(shape.num_blocks):
            a, u = h @ params[0][blk].t(), h @ params[1][blk].t()
            h = h + (torch.nn.functional.silu(a) * u) @ params[2][blk].t()
        loss = torch.nn.functional.mse_loss(h, target[row : row + 1])
        errors.append(loss.item())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
    return errors


def test_kit_returns_esamp_prediction_errors_per_decode_row(tiny_model):
    """``esamp`` returns each decode row's prediction error (its term of the training
    loss), equal to a distiller trained independently with torch's Adam on transformers'
    hidden states of the same tokens; a concurrent request that did not ask gets none."""
    from tllm_core.testing import ConsumerKit

    cfg = {"intermediate_size": 16, "beta": 0.5}
    kit = ConsumerKit(tiny_model, [{"name": "esamp", "config": cfg}])
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10]]
    out = kit.generate(prompts, max_tokens=6, extra_args=[{"tllm_results": "esamp"}, None])
    assert set(kit.results) == {(0, 0)}  # the second request did not ask
    got = kit.results[(0, 0)]["esamp"]
    tokens = prompts[0] + out[0][0]
    decode = list(range(len(prompts[0]), len(tokens) - 1))  # generated tokens fed back
    assert got["positions"].tolist() == decode and len(decode) == 5
    assert got["prediction_error"].dtype == np.float32 and got["prediction_error"].shape == (
        len(decode),
    )
    assert np.isfinite(got["prediction_error"]).all() and (got["prediction_error"] >= 0).all()
    ref = hf_states(tiny_model, tokens[:-1])
    want = _distiller_reference(ref["layer.0"][decode], ref["final"][decode], cfg)
    np.testing.assert_allclose(got["prediction_error"], want, rtol=1e-3)
    report = kit.close()
    assert report["consumers"]["esamp"]["rows_returned"] == len(decode)
    assert report["runtime"]["results_made.esamp"] == 1


def _asgi(app, body: bytes = b"{}", path: str = "/v1/chat/completions") -> tuple[dict, bytes]:
    """Run one POST through an ASGI app; (response start, whole body)."""
    import asyncio

    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_the_server_middleware_adds_results_to_json_and_streams():
    """ResultReturn without vLLM: a two-prompt completion (choices i*n + sample, by the
    "-i" suffix vLLM gives prompt i), a chat stream (one event before [DONE]), a result
    that never comes (an error after the wait), and a request that did not ask."""
    import asyncio

    from tllm_core.vllm_bridge import request_marks as rr

    taken: list[list[str]] = []
    nan = float("nan")  # strict JSON has no such number: it goes out as "NaN"

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))

    async def ask(method, ids):
        assert method == "tllm_take_results"
        taken.append(list(ids))
        return [
            {"cmpl-1-0": {"0": {"stats": {"v": 0, "mean": nan}}, "1": {"stats": {"v": 1}}}},
            {"cmpl-1-1": {"0": {"stats": {"v": 2}}}},
        ]  # sample 1 of prompt 1: never

    class Params:
        n = 2

    def app_for(ids, payload: bytes, stream: bool):
        async def app(scope, receive, send):
            for rid in ids:  # what vLLM's input processor does per request it admits
                req = type(
                    "R",
                    (),
                    {"external_req_id": rid, "request_id": rid, "sampling_params": Params()},
                )
                rr.note_request(req, {"tllm_results": "stats"} if rid else {})
            kind = b"text/event-stream" if stream else b"application/json"
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", kind),
                        (b"content-length", str(len(payload)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": payload})

        return rr.ResultReturn(
            app, ("/v1/completions", "/v1/chat/completions"), ask=lambda: ask, wait_s=0.05
        )

    body = json.dumps({"id": "cmpl-1", "choices": [{"index": i} for i in range(4)]}).encode()
    start, out = _asgi(app_for(["cmpl-1-0", "cmpl-1-1"], body, False), path="/v1/completions")
    got = strict(out)
    assert dict(start["headers"])[b"content-length"] == str(len(out)).encode()
    assert [e["index"] for e in got["tllm"]] == [0, 1, 2, 3]
    assert got["tllm"][0]["stats"]["mean"] == "NaN"
    assert [e["stats"].get("v") for e in got["tllm"][:3]] == [0, 1, 2]
    assert "no result within" in got["tllm"][3]["stats"]["error"]
    assert len(taken) > 1  # read again until the wait ran out

    event = b'data: {"id":"chatcmpl-9","object":"chat.completion.chunk","model":"m"}\n\n'
    stream = event + b"data: [DONE]\n\n"
    _, out = _asgi(app_for(["cmpl-1-0"], stream, True))
    lines = [ln for ln in out.split(b"\n") if ln.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    last = strict(lines[-2][6:])
    assert last["id"] == "chatcmpl-9" and last["choices"] == []
    assert [e["stats"] for e in last["tllm"]] == [{"v": 0, "mean": "NaN"}, {"v": 1}]

    async def empty(ids):  # stats of a request with no rows: an empty result
        return [{"r": {"0": {"stats": {}}}, "other": {"0": {"stats": {}}}}]

    got = asyncio.run(rr.gather_results(empty, {"r": (["stats"], 1)}, wait_s=0.05))
    assert got == [{"index": 0, "stats": {}}]  # a result, not "no result within"

    taken.clear()  # a request that did not ask: its response goes out as it was
    _, out = _asgi(app_for([""], body, False), path="/v1/completions")
    assert out == body and taken == []


def test_a_stream_whose_text_holds_the_end_marker_gets_its_results_at_its_end():
    """``data: [DONE]`` inside an event's JSON (an echoed prompt, generated text) is text, not
    the stream's end: the results event goes before the real end, every event stays JSON."""
    from tllm_core.vllm_bridge import request_marks as rr

    async def ask(method, ids):
        return [{i: {"0": {"stats": {"v": 1}}} for i in ids}]

    text = {"id": "cmpl-1", "choices": [{"index": 0, "text": "say data: [DONE] now"}]}
    chunks = [b"data: " + json.dumps(text).encode() + b"\n\n", b"data: [DONE]\n\n"]

    async def app(scope, receive, send):
        req = type("R", (), {"external_req_id": "s-0", "request_id": "s-0"})
        req.sampling_params = type("P", (), {"n": 1})()
        rr.note_request(req, {"tllm_results": "stats"})
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i, chunk in enumerate(chunks):
            more = i < len(chunks) - 1
            await send({"type": "http.response.body", "body": chunk, "more_body": more})

    middleware = rr.ResultReturn(app, ("/v1/completions",), ask=lambda: ask, wait_s=1.0)
    _, out = _asgi(middleware, path="/v1/completions")
    events = [e[6:] for e in out.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 3, out
    assert json.loads(events[0]) == text
    assert json.loads(events[1])["tllm"] == [{"index": 0, "stats": {"v": 1}}]


def test_results_a_response_did_not_take_are_discarded_before_its_id_is_free():
    """A result left in the engine would go to the next request of the same caller id (a
    retry, another client guessing it): a response that did not take all of its results (one
    late, a failed response) discards them, with the engine ids, before its caller ids are
    free again; a response that took all sends no discard."""
    from tllm_core.vllm_bridge import request_marks as rr

    made = {"ok-0": {"0": {"stats": {"v": 1}}}}  # "late-0" has none yet
    calls: list[tuple] = []
    seen_in_flight: list[bool] = []

    async def ask(method, ids):
        assert method == "tllm_take_results"
        return [{i: made[i] for i in ids if i in made}]

    def app_for(rid: str, status: int = 200):
        async def app(scope, receive, send):
            req = type("R", (), {"external_req_id": rid, "request_id": f"{rid}-engine"})
            req.sampling_params = type("P", (), {"n": 1})()
            rr.note_request(req, {"tllm_results": "stats"})
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            body = json.dumps({"id": "cmpl", "choices": [{"index": 0}]}).encode()
            await send({"type": "http.response.body", "body": body})

        async def discard(ids, engines):
            seen_in_flight.append(all(i in rr_app.in_flight for i in ids))
            calls.append((list(ids), list(engines)))

        rr_app = rr.ResultReturn(
            app, ("/v1/completions",), ask=lambda: ask, wait_s=0.05, discard=discard
        )
        return rr_app

    for rid, status in [("ok-0", 200), ("late-0", 200), ("failed-0", 500)]:
        rr_app = app_for(rid, status)
        _asgi(rr_app, path="/v1/completions")
        assert rr_app.in_flight == {}
    assert calls == [(["late-0"], ["late-0-engine"]), (["failed-0"], ["failed-0-engine"])]
    assert seen_in_flight == [True, True]


def test_responses_reading_their_results_at_once_share_the_rpcs():
    """Twenty responses read their results together: the reads made while one RPC is in flight
    share the next (each RPC stops the engine between two steps), and each response gets its
    own results, not another's."""
    import asyncio

    from tllm_core.vllm_bridge import request_marks as rr

    sent: list[list[str]] = []

    async def ask(method, ids):
        assert method == "tllm_take_results"
        sent.append(list(ids))
        await asyncio.sleep(0.01)
        return [{i: {"0": {"stats": {"id": i}}} for i in ids}, {}]  # rank 1: nothing

    async def main():
        takes = rr.IdBatches(ask, "tllm_take_results")
        reads = [rr.gather_results(takes.call, {f"r{i}": (["stats"], 1)}, 5.0) for i in range(20)]
        return await asyncio.wait_for(asyncio.gather(*reads), 10)

    got = asyncio.run(main())
    assert got == [[{"index": 0, "stats": {"id": f"r{i}"}}] for i in range(20)]
    assert len(sent) == 1 and sorted(sum(sent, [])) == sorted(f"r{i}" for i in range(20))


def test_results_dropped_from_a_full_store_say_so_at_once():
    """A store past its bytes drops the oldest requests' results (a client gone never takes
    them). One that is still taken got nothing, and its taker waited results_wait_s (30 s) to
    report "no result" (a request with many large choices, or another client's, caused it):
    now it gets an error naming the store's bound, and the errors kept are bounded too."""
    from tllm_core.api.counters import Counters
    from tllm_core.api.rows import RequestInfo
    from tllm_core.runtime.request_results import ResultStore

    counters = Counters()
    store = ResultStore(counters, max_result_bytes=2048, max_requests=16)

    def put(rid: str, sample: int, floats: int) -> None:
        value = np.zeros(floats, np.float32)
        store.put(RequestInfo(f"{rid}-abcdefgh", rid, 0, sample, 4), "c", value)

    put("a", 0, 8)
    for sample in range(12):  # ~1.5 kB each: 16 kB (8 x 2048) holds about ten
        put("b", sample, 256)
    got = store.take(["a", "b"])
    assert "dropped uncollected" in got["a"][0]["c"]["error"], got["a"]
    assert "16384 bytes" in got["a"][0]["c"]["error"]
    assert all(s in got["b"] for s in range(12)), sorted(got["b"])  # dropped or kept: each told
    assert counters.snapshot()["results_expired"] >= 2
    assert store.take(["a", "b"]) == {}  # taken once
    for i in range(50):  # the errors of requests nobody takes are bounded (16 samples here)
        for sample in range(3):
            put(f"x{i}", sample, 256)
    assert 0 < sum(map(len, store._dropped.values())) <= 16


def test_a_request_whose_choices_together_overflow_the_results_store_is_refused():
    """Each choice's result within max_result_bytes, but n of them past what the engine keeps
    uncollected (8 x): refused up front, not left to evict other clients' results."""
    from types import SimpleNamespace

    from tllm_core.api.consumer_spec import ConsumerSpec
    from tllm_core.plugins.registry import Registry
    from tllm_core.serving.keys import EngineConsumers
    from tllm_core.vllm_bridge.request_marks import check_bounds

    registry = Registry()
    specs = [ConsumerSpec(name="stats", config={"layers": [0, 1, 2, 3]})]
    server = EngineConsumers.of(specs, registry.check(specs), registry)
    extra = {"tllm_results": "stats"}  # a stats result is bounded by 512 bytes (4 layers)

    def why(n: int) -> str | None:
        params = SimpleNamespace(n=n, max_tokens=4)
        request = SimpleNamespace(sampling_params=params, prompt_token_ids=[1, 2])
        return check_bounds(request, extra, server, limit=1024, hidden_size=64)

    assert why(1) is None and why(16) is None  # 16 x 512 = 8 x 1024: what the store keeps
    assert "17 choices could hold up to 8704 bytes, past the 8192" in why(17)


def test_the_prompts_of_one_completion_request_together_must_fit_the_results_store():
    """vLLM runs prompt i of a completion request as its own engine request "{id}-{i}", and
    all their choices wait in one store: prompts that each fit but together pass it are
    refused (HTTP 400, naming the numbers), those admitted before asked for nothing more,
    those after (vLLM starts them all together) are refused too, even one that would fit;
    prompts that fit together get every result, and the next HTTP request starts afresh."""
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError

    from tllm_core.plugins.registry import Registry
    from tllm_core.serving.keys import EngineConsumers
    from tllm_core.vllm_bridge import request_marks as rr
    from tllm_core.vllm_bridge.serving import install_request_checks

    registry = Registry()
    specs = [ConsumerSpec(name="stats", config={"layers": [0, 1, 2, 3]})]
    server = EngineConsumers.of(specs, registry.check(specs), registry)
    admitted: list[str] = []  # the engine requests vLLM would run
    processor = SimpleNamespace(
        assign_request_id=lambda request: admitted.append(request.request_id)
    )
    install_request_checks(processor, server, b"k" * 32, max_result_bytes=1024, hidden_size=64)

    async def ask(method, ids):  # every result there at once
        return [{rid: {str(s): {"stats": {"v": rid}} for s in range(17)} for rid in ids}]

    def completion(ns: list[int]) -> tuple[int, dict]:
        """Prompt i with ``ns[i]`` choices (stats' bound does not grow with the prompt: a
        larger n stands in for a longer prompt)."""
        admitted.clear()

        async def app(scope, receive, send):  # vLLM's completion route, every prompt started
            status, out = 200, {"id": "cmpl-1", "choices": [{}] * sum(ns)}
            for i, n in enumerate(ns):
                params = SimpleNamespace(n=n, max_tokens=4, extra_args={"tllm_results": "stats"})
                request = SimpleNamespace(
                    sampling_params=params, prompt_token_ids=[1, 2], request_id=f"cmpl-1-{i}"
                )
                request.cache_salt = None
                try:
                    processor.assign_request_id(request)
                except VLLMValidationError as e:
                    assert rr.ASKED.get() == {}  # prompts admitted before: no results awaited
                    if status == 200:
                        status, out = 400, {"error": str(e)}
            payload = json.dumps(out).encode()
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": payload})

        wrapped = rr.ResultReturn(app, ("/v1/completions",), ask=lambda: ask, wait_s=1.0)
        start, body = _asgi(wrapped, path="/v1/completions")
        return start["status"], json.loads(body)

    # A stats result is bounded by 512 bytes (4 layers): 4 prompts x 4 choices fill the 8 x
    # 1024 bytes the store keeps; each prompt alone (2048 bytes) fits, 5 together do not.
    status, got = completion([4] * 4)
    assert status == 200 and len(got["tllm"]) == 16, got
    assert [e["index"] for e in got["tllm"]] == list(range(16))
    assert [e["stats"]["v"] for e in got["tllm"][::4]] == [f"cmpl-1-{i}" for i in range(4)]
    status, got = completion([4] * 6)
    assert status == 400, got
    message = "request's first 5 prompts x 4 choices could hold up to 10240 bytes, past the 8192"
    assert message in got["error"]
    assert "fewer prompts, choices (n) or rows" in got["error"]
    assert admitted == [f"cmpl-1-{i}" for i in range(4)]  # not the 6th, after the 5th
    assert completion([4] * 4)[0] == 200  # each HTTP request counts its own prompts
    # The first prompt alone past the store (17 x 512 bytes), the second fits: none runs.
    status, got = completion([17, 1])
    assert status == 400 and "17 choices could hold up to 8704 bytes" in got["error"], got
    assert admitted == []
    # A route that returns no results (/v1/messages, /invocations, ...): refused, not kept in
    # the store, where they would push out other clients' results.
    params = SimpleNamespace(n=4, max_tokens=4, extra_args={"tllm_results": "stats"})
    request = SimpleNamespace(sampling_params=params, prompt_token_ids=[1], request_id="msg-1")
    with pytest.raises(VLLMValidationError, match="tllm_results is answered on /v1/completions"):
        processor.assign_request_id(request)
    assert admitted == []


def test_a_request_id_waiting_for_its_results_is_not_taken_by_another_request():
    """Results are kept by the client's request id: a second request asking for results
    under an id whose first request still waits for its own is refused (400 naming the id),
    not served the first one's results; once the first is answered, the id is free."""
    import asyncio
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError

    from tllm_core.plugins.registry import Registry
    from tllm_core.serving.keys import EngineConsumers
    from tllm_core.vllm_bridge import request_marks as rr
    from tllm_core.vllm_bridge.serving import install_request_checks

    registry = Registry()
    specs = [ConsumerSpec(name="stats", config={"layers": [0]})]
    server = EngineConsumers.of(specs, registry.check(specs), registry)

    def assign(request):  # vLLM's: the client's id kept, a unique one made
        request.external_req_id, request.request_id = request.request_id, request.request_id + "-x"

    processor = SimpleNamespace(assign_request_id=assign)
    install_request_checks(processor, server, b"k" * 32, max_result_bytes=1 << 20, hidden_size=8)
    release = asyncio.Event()

    async def ask(method, ids):
        await release.wait()
        return [{rid: {"0": {"stats": {"v": rid}}} for rid in ids}]

    async def app(scope, receive, send):  # vLLM's completion route: one prompt, id "cmpl-abc"
        status, out = 200, {"id": "cmpl-abc", "choices": [{}]}
        params = SimpleNamespace(n=1, max_tokens=4, extra_args={"tllm_results": "stats"})
        request = SimpleNamespace(sampling_params=params, prompt_token_ids=[1], cache_salt=None)
        request.request_id, request.external_req_id = "cmpl-abc", None
        try:
            processor.assign_request_id(request)
        except VLLMValidationError as e:
            status, out = 400, {"error": str(e)}
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(out).encode()})

    wrapped = rr.ResultReturn(app, ("/v1/completions",), ask=lambda: ask, wait_s=5.0)

    async def post() -> tuple[int, dict]:
        sent: list[dict] = []

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(msg):
            sent.append(msg)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        await wrapped(scope, receive, send)
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return sent[0]["status"], json.loads(body)

    async def main():
        first = asyncio.ensure_future(post())
        await asyncio.sleep(0.05)  # admitted, waiting for its results
        status, got = await asyncio.wait_for(post(), 5)
        assert status == 400 and "request id 'cmpl-abc' (vLLM's" in got["error"]
        assert "is that of another request" in got["error"]
        release.set()
        status, got = await asyncio.wait_for(first, 5)
        assert status == 200 and got["tllm"] == [{"index": 0, "stats": {"v": "cmpl-abc"}}], got
        assert wrapped.in_flight == {}
        status, got = await asyncio.wait_for(post(), 5)  # the id is free again
        assert status == 200, got

    asyncio.run(main())
