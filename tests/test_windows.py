"""Capture windows (issue 45 item 1): one position grammar for every read port and the
consumers that capture (export, stats, sae); rows outside a window are never cut into a
bundle. Checked on the grammar, in the consumer kit, and end to end: the last prompt token
of 512 prompts at two layers, exported by vLLM, equals transformers at those positions."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
import torch
from conftest import cli_in_process
from reference import hf_states

from tllm_core import HiddenStates, Phase
from tllm_core.api.ports import as_selector
from tllm_core.api.windows import AnyOf, Window, takes_last


def test_the_grammar_and_the_rows_each_window_keeps():
    # two requests: prompt of 5 (positions 0..4) then 3 generated (5..7); prompt of 2 then 6
    position = np.array([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7])
    prompt = np.array([5] * 8 + [2] * 8)
    cases = {
        "last_prompt": [4, 9],
        "prompt[-2:]": [3, 4, 8, 9],
        "prompt[1:3]": [1, 2, 9],
        "generated[0:2]": [5, 6, 10, 11],
        "generated[::3]": [5, 10, 13],
        "all[::4]": [0, 4, 8, 12],
        "all[6:]": [6, 7, 14, 15],
        "prompt[::2]": [0, 2, 4, 8],
    }
    for text, rows in cases.items():
        w = Window.parse(text)
        assert np.nonzero(w.mask(position, prompt))[0].tolist() == rows, text
        assert Window.parse(str(w)) == w
    bad_texts = ("final", "prompt[a:]", "generated[-1:]", "all[::0]", "decoded", "prompt[1]")
    for bad in (*bad_texts, "all[::99999999999999999999]", "prompt[-99999999999999999999:]"):
        with pytest.raises(ValueError, match="window|expected"):
            as_selector(bad, "phase")
    assert as_selector("prefill", "x") is Phase.PREFILL
    assert (
        as_selector("prompt", "x") is Phase.PREFILL
        and as_selector("generated", "x") is Phase.DECODE
    )
    with pytest.raises(ValueError, match=r"HiddenStates\(phase='final'\).*last_prompt"):
        HiddenStates(1, "final")
    # A config's window (CaptureWindow) cuts bundles: 'guide' (a guide-time read) selects none.
    from tllm_core import ConsumerSpec
    from tllm_core.plugins.registry import ConsumerSpecError, Registry

    for name in ("stats", "export", "sae"):
        config = {"phase": "guide", **({"path": "p"} if name == "sae" else {})}
        with pytest.raises(ConsumerSpecError, match=f"{name}: phase: 'guide' selects no row"):
            Registry().validate(ConsumerSpec(name=name, config=config))
    assert Registry().validate(ConsumerSpec(name="stats", config={"phase": "prefill"}))
    # 'last' (each request's last row) keeps no row when a step is cut: it is delivered at
    # the request's finish (tllm_core/runtime/reads.py)
    assert not Window.parse("last").mask(position, prompt).any()
    assert str(as_selector("last", "x")) == "last" and takes_last(lw := as_selector("last", "x"))
    assert takes_last(lw.union(Window.parse("prompt[-1:]"))) and not takes_last(Phase.ALL)
    # ports of one key merge their windows; ALL wins
    w1, w2 = Window.parse("last_prompt"), Window.parse("generated[0:2]")
    assert w1.union(w2) == AnyOf(frozenset({w1, w2})) and Phase.ALL.union(w1) is Phase.ALL
    assert Phase.DECODE.union(w1) == AnyOf(frozenset({w1, Phase.DECODE}))


def test_a_window_cuts_the_bundle_in_the_kit(tiny_model, tmp_path):
    from consumers.export import read_export
    from tllm_core.testing import ConsumerKit

    cfg = {"out": str(tmp_path / "x"), "layers": [0, -1], "phase": "prompt[-2:]"}
    kit = ConsumerKit(tiny_model, [{"name": "export", "config": cfg}])
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10]]
    kit.generate(prompts, max_tokens=3, temperature=0.0)
    report = kit.close()
    assert report["runtime"]["rows_bundled.export"] == 4  # 2 rows of each prompt, nothing else
    recs = sorted(read_export(tmp_path / "x", verify=True), key=lambda r: r.prompt_index)
    assert [r.positions.tolist() for r in recs] == [[3, 4], [1, 2]]
    for rec, p in zip(recs, prompts, strict=True):
        assert rec.token_ids.tolist()[: len(p)] == p  # the whole prompt, from the request
    assert report["consumers"]["export"]["rows_exported"] == 4


@torch.no_grad()
def test_the_last_prompt_token_of_512_prompts_at_two_layers(tiny_model, tmp_path):
    from consumers.export import read_export

    pytest.importorskip("vllm")
    rng = np.random.default_rng(0)
    words = ["sea", "rain", "stone", "light", "river", "song", "wind", "glass", "fire"]
    prompts = [" ".join(rng.choice(words, size=int(rng.integers(2, 9)))) for _ in range(512)]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    out = tmp_path / "probe"
    args = ["export", "--model", tiny_model, "--layers", "0,-1", "--phase", "last_prompt"]
    args += ["--prompts", str(tmp_path / "prompts.txt"), "--out", str(out), "--max-tokens", "1"]
    args += ["-n", "1", "--no-chat", "--enforce-eager", "--max-model-len", "64"]
    report = cli_in_process(*args)
    recs = list(read_export(out, verify=True))
    assert len(recs) == 512
    assert sum(len(r.positions) for r in recs) == 512  # exactly one row per prompt
    assert report["counters"]["export"]["rows_exported"] == 512
    assert report["counters"]["runtime"]["rows_bundled.export"] == 512  # nothing else was cut
    by_length = defaultdict(list)  # one reference forward per prompt length
    for rec in recs:
        n = rec.num_prompt_tokens
        assert rec.positions.tolist() == [n - 1]
        by_length[n].append(rec)
    for n, group in by_length.items():
        ref = hf_states(tiny_model, [r.token_ids[:n].tolist() for r in group])  # last un-normed
        for key in ("layer.0", "layer.3"):
            got = torch.stack([r.hidden[key][0] for r in group])
            torch.testing.assert_close(got, ref[key][:, n - 1], rtol=1e-4, atol=1e-4, msg=key)


def test_a_request_window_is_checked_with_the_window_grammar_and_listed():
    from consumers.export.consumer import ExportConsumer
    from consumers.sae.consumer import SaeConsumer
    from consumers.stats import StatsConsumer
    from tllm_core.api.request_settings import describe_request_keys, parse_request_settings

    model = ExportConsumer.Request
    got = parse_request_settings("export", model, {"tllm_export_window": "generated[0:3]"})
    assert got.window == Window("generated", 0, 3)
    assert parse_request_settings("export", model, {"tllm_export_window": "prompt"}).window is (
        Phase.PREFILL
    )
    assert parse_request_settings("export", model, {}).window is None
    assert parse_request_settings("export", model, {"tllm_export_window": "last"}).window == (
        as_selector("last", "x")
    )
    for bad in ("final", "generated[-1:]", "guide", "prompt[1]", 3, True):
        with pytest.raises(ValueError) as e:
            parse_request_settings("export", model, {"tllm_export_window": bad})
        msg = str(e.value)
        assert "extra_args['tllm_export_window']" in msg and repr(bad) in msg, msg
        assert "REGION[START:STOP:STEP]" in msg and "last_prompt" in msg, msg
    for cls in (ExportConsumer, StatsConsumer, SaeConsumer):
        keys = {k["key"]: k for k in describe_request_keys(cls.name, cls.Request)}
        assert "capture window" in keys[f"tllm_{cls.name}_window"]["allowed"], cls.name


def test_request_windows_cut_each_requests_rows_in_the_kit(tiny_model, tmp_path):
    """Three requests in the same steps: one exports its last prompt token, one its first 3
    generated tokens, one (no key) every row; the runtime cuts nothing else."""
    from consumers.export import read_export
    from consumers.export.format import request_table
    from tllm_core.testing import ConsumerKit

    cfg = {"out": str(tmp_path / "x"), "layers": [0, -1]}
    consumers = [{"name": "export", "config": cfg}, {"name": "stats", "config": {"layers": [0]}}]
    kit = ConsumerKit(tiny_model, consumers)
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12]]
    extra = [
        {"tllm_export_window": "last_prompt", "tllm_stats_window": "generated[1:2]"},
        {"tllm_export_window": "generated[0:3]"},
        None,
    ]
    kit.generate(prompts, max_tokens=5, temperature=0.0, ignore_eos=True, extra_args=extra)
    report = kit.close()
    recs = sorted(read_export(tmp_path / "x", verify=True), key=lambda r: r.prompt_index)
    assert [r.positions.tolist() for r in recs] == [[4], [3, 4, 5], [0, 1, 2, 3, 4, 5]]
    # every request's whole token sequence still (sampled tokens are not windowed)
    assert [len(r.token_ids) for r in recs] == [10, 8, 7]
    assert report["runtime"]["rows_bundled.export"] == 1 + 3 + 6
    assert report["consumers"]["export"]["rows_exported"] == 10
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert manifest["complete"] and not any(manifest["losses"].values()), manifest["losses"]
    table = request_table(str(tmp_path / "x"), manifest)
    windows = {e["prompt_index"]: e.get("window") for e in table}
    assert windows == {0: "prompt[-1:]", 1: "generated[0:3]", 2: None}
    # stats: one row of prompt 0 (its 2nd generated token), every row of the others
    stats = report["results"]["stats"]
    rows = {k.split("/")[0]: v["layer.0"]["rows"] for k, v in stats.items()}
    assert rows == {"0": 1, "1": 7, "2": 6}, rows
    assert report["runtime"]["rows_bundled.stats"] == 1 + 7 + 6


def test_the_last_window_delivers_each_requests_last_row_at_its_finish(tiny_model, tmp_path):
    """Window 'last': of requests of different lengths in the same steps, exactly the row
    that sampled each one's final token (the last prompt row when it generated one token),
    per request (export) and in a port's config (stats); nothing else is cut."""
    from consumers.export import read_export
    from tllm_core.testing import ConsumerKit

    cfg = {"out": str(tmp_path / "x"), "layers": [0, -1]}
    consumers = [
        {"name": "export", "config": cfg},
        {"name": "stats", "config": {"layers": [0], "phase": "last"}},
    ]
    kit = ConsumerKit(tiny_model, consumers)
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12]]
    tokens = [[[20, 21, 22]], [[23]], [[24, 25, 26, 27, 28]]]  # 3, 1 and 5 generated
    extra = [{"tllm_export_window": "last"}, {"tllm_export_window": "last"}, None]
    kit.generate(prompts, temperature=0.0, extra_args=extra, tokens=tokens)
    report = kit.close()
    recs = sorted(read_export(tmp_path / "x", verify=True), key=lambda r: r.prompt_index)
    # the row that sampled the final token: position prompt + generated - 2
    assert [r.positions.tolist() for r in recs] == [[6], [2], [0, 1, 2, 3, 4, 5]]
    assert [len(r.token_ids) for r in recs] == [8, 4, 7]  # whole sequences still
    assert report["runtime"]["rows_bundled.export"] == 1 + 1 + 6
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert manifest["complete"] and not any(manifest["losses"].values()), manifest["losses"]
    stats = report["results"]["stats"]
    rows = {k.split("/")[0]: v["layer.0"]["rows"] for k, v in stats.items()}
    assert rows == {"0": 1, "1": 1, "2": 1}, rows
    assert report["runtime"]["rows_bundled.stats"] == 3


@pytest.mark.vllm
@torch.no_grad()
def test_request_windows_on_vllm_export_those_rows_equal_to_transformers(
    tiny_model, engines, tmp_path
):
    """vLLM V1, in process: three requests of one call, with 'last_prompt',
    'generated[0:3]' and 'last', export exactly those rows, equal to transformers there; a bad window
    is refused before anything of its call runs."""
    from conftest import ENGINE_KW
    from vllm import SamplingParams

    from consumers.export import read_export
    from tllm_core.app.engine import TllmLLM

    out = tmp_path / "x"
    spec = [{"name": "export", "config": {"out": str(out), "layers": [0, -1]}}]
    llm = engines.get(
        ("windows", tiny_model, str(out)), lambda: TllmLLM(tiny_model, spec, **ENGINE_KW)
    )

    def params(window: str | None) -> SamplingParams:
        extra = None if window is None else {"tllm_export_window": window}
        return SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args=extra)

    steps = llm.collect()["runtime"].get("engine_steps", 0)
    with pytest.raises(
        ValueError, match=r"'tllm_export_window'\] is not a capture window, got 'final'"
    ) as e:
        llm.generate(["a b", "c d"], [params(None), params("final")], use_tqdm=False)
    assert "REGION[START:STOP:STEP]" in str(e.value)
    assert llm.collect()["runtime"].get("engine_steps", 0) == steps, "a refused call generated"

    prompts = ["sea rain stone light", "river song", "glass fire wind"]
    windows = ["last_prompt", "generated[0:3]", "last"]
    llm.generate(prompts, [params(w) for w in windows], use_tqdm=False)
    report = llm.close()
    engines.close()
    assert report["runtime"]["rows_bundled.export"] == 1 + 3 + 1
    assert report["results"]["export"]["complete"], report["results"]["export"]
    recs = sorted(read_export(out, verify=True), key=lambda r: r.prompt_index)
    assert len(recs) == 3
    n0, n1, n2 = (r.num_prompt_tokens for r in recs)
    assert recs[0].positions.tolist() == [n0 - 1]
    assert recs[1].positions.tolist() == [n1, n1 + 1, n1 + 2]
    assert recs[2].positions.tolist() == [n2 + 3]  # the row that sampled the 5th token
    for rec in recs:
        assert len(rec.token_ids) == rec.num_prompt_tokens + 5  # the whole sequence
        ref = hf_states(tiny_model, rec.token_ids[:-1].tolist())
        for key in ("layer.0", "layer.3"):
            torch.testing.assert_close(
                rec.hidden[key], ref[key][rec.positions], rtol=1e-4, atol=1e-4, msg=key
            )


@pytest.mark.vllm
@torch.no_grad()
def test_n_samples_with_request_windows_map_each_row_to_its_sample(tiny_model, engines, tmp_path):
    """n=3 samples per prompt, each prompt with its own window, sampled at temperature 1 (the
    samples differ): every record is one (prompt, sample) of vLLM's outputs, its token ids are
    that sample's, its rows are exactly its window's positions, and each row equals
    transformers on that sample's own tokens."""
    from conftest import ENGINE_KW
    from vllm import SamplingParams

    from consumers.export import read_export
    from tllm_core.app.engine import TllmLLM

    out = tmp_path / "n3"
    spec = [{"name": "export", "config": {"out": str(out), "layers": [1, "final"]}}]
    llm = engines.get(
        ("windows-n", tiny_model, str(out)), lambda: TllmLLM(tiny_model, spec, **ENGINE_KW)
    )
    prompts, windows = ["sea rain stone light", "river song"], ["generated[1:3]", "prompt[-2:]"]
    params = [
        SamplingParams(
            n=3,
            max_tokens=4,
            temperature=1.0,
            seed=11 + i,
            ignore_eos=True,
            extra_args={"tllm_export_window": w},
        )
        for i, w in enumerate(windows)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    report = llm.close()
    engines.close()
    assert report["results"]["export"]["complete"], report["results"]["export"]
    expected = {
        (o.request_id, c.index): list(o.prompt_token_ids) + list(c.token_ids)
        for o in outs
        for c in o.outputs
    }
    records = list(read_export(out, verify=True))
    assert sorted((r.request_id, r.sample_index) for r in records) == sorted(expected)
    assert len({tuple(s) for s in expected.values()}) > 2  # the samples differ
    for rec in records:
        seq = expected[(rec.request_id, rec.sample_index)]
        assert rec.token_ids.tolist() == seq
        n = rec.num_prompt_tokens
        want = [n + 1, n + 2] if rec.prompt_index == 0 else [n - 2, n - 1]
        assert rec.positions.tolist() == want, (rec.request_id, rec.sample_index)
        ref = hf_states(tiny_model, seq)
        for key in ("layer.1", "final"):
            torch.testing.assert_close(
                rec.hidden[key], ref[key][rec.positions], rtol=1e-4, atol=1e-4, msg=key
            )
