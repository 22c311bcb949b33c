"""What a second third-party author found writing a consumer from the docs with ConsumerKit
(issue 45, item 5): transforms see the whole step in the kit as in the engine, one dtype
default for TllmLLM, ``tllm run`` and the kit, config errors and ``tllm consumers`` that list
what is allowed, and kits that share a loaded model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tllm_core import Consumer, ConsumerConfig, Edit, HiddenStates
from tllm_core.api.consumer_spec import ConsumerSpec, ConsumerSpecError
from tllm_core.plugins.registry import Registry
from tllm_core.testing import ConsumerKit


class _Centre(torch.nn.Module):
    """A transform that pools over rows: it subtracts the mean of the selected rows (so its
    result for a row depends on the other rows of the call), and records each call's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def forward(self, s: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.calls.append(int(s.shape[0]))
        sel = rows.expand_as(s)
        mean = (s * sel).sum(0, keepdim=True) / sel[:, :1].sum().clamp(min=1)
        return s - 0.5 * mean


class Centre(Consumer):
    name = "centre"

    class Config(ConsumerConfig):
        edit: bool = True

    def __init__(self, config, context):
        super().__init__(config, context)
        self.module = _Centre()
        self.steps: list[int] = []
        self.first: torch.Tensor | None = None  # layer 1 of the first step (after the edit)

    def reads(self):
        return [HiddenStates(1)]

    def on_bundle(self, bundle):
        if self.first is None:
            self.first = bundle.hidden["layer.1"].clone()

    def writes(self):
        return [Edit(HiddenStates(1), transform=self.module)]

    def edit(self, rows, plan):
        self.steps.append(len(rows))
        if self.config.edit:
            plan.transform(1, np.arange(len(rows)))


def test_the_kit_runs_a_transform_once_per_step_over_every_row(tiny_model):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    kit = ConsumerKit(tiny_model, [Centre])
    kit.generate(prompts, max_tokens=3, seed=0, temperature=0.0)
    c = kit.consumer("centre")
    # One call per step, over all the step's rows (3 prompts: 9 prefill rows, then 3 decode
    # rows a step), as the engine's in-graph transform is called.
    assert c.module.calls == c.steps == [9, 3, 3]
    # The values: the first step's edited rows are the unedited ones less half the mean over
    # all 9 rows of the three prompts (per-request calls would subtract per-request means).
    plain = ConsumerKit(tiny_model, [(Centre, {"edit": False})])
    plain.generate(prompts, max_tokens=1, temperature=0.0)
    s = plain.consumer("centre").first
    assert s is not None and c.first is not None and s.shape == c.first.shape == (9, s.shape[1])
    torch.testing.assert_close(c.first, s - 0.5 * s.mean(0, keepdim=True), rtol=1e-5, atol=1e-5)
    kit.close()
    plain.close()


def test_a_failing_forward_in_a_lockstep_step_is_raised_not_hung(tiny_model):
    class Boom(Centre):
        name = "boom"

        def __init__(self, config, context):
            super().__init__(config, context)

            class _M(torch.nn.Module):
                def forward(self, s, rows):
                    raise RuntimeError("transform boom")

            self.module = _M()

    kit = ConsumerKit(tiny_model, [Boom], lockstep_timeout=30)
    with pytest.raises(Exception, match="boom"):
        kit.generate([[1, 2], [3, 4]], max_tokens=2, temperature=0.0)
    kit.close()


def test_kits_in_one_process_share_a_loaded_model(tiny_model):
    a = ConsumerKit(tiny_model, [])
    b = ConsumerKit(tiny_model, [])
    c = ConsumerKit(tiny_model, [], share_model=False)
    assert a.hf is b.hf and c.hf is not a.hf
    assert a.hf.dtype == torch.float32  # the shared default dtype
    for k in (a, b, c):
        k.close()


def test_tllm_llm_run_and_the_kit_share_one_dtype_default(tiny_model, monkeypatch):
    import vllm

    from tllm_core import TllmLLM
    from tllm_core.app.cli import build_parser
    from tllm_core.app.defaults import DEFAULT_DTYPE

    seen = {}

    class _Stop(Exception):
        pass

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    with pytest.raises(_Stop):
        TllmLLM(tiny_model)
    assert seen["dtype"] == DEFAULT_DTYPE == "float32"
    args = build_parser().parse_args(["run"])
    assert args.dtype == DEFAULT_DTYPE
    assert ConsumerKit.__init__.__kwdefaults__["dtype"] == DEFAULT_DTYPE
    with pytest.raises(_Stop):
        TllmLLM(tiny_model, dtype="bfloat16")
    assert seen["dtype"] == "bfloat16"  # a caller's choice is kept


def test_an_unknown_config_field_error_lists_the_valid_ones():
    reg = Registry()
    with pytest.raises(ConsumerSpecError) as e:
        reg.check([ConsumerSpec.coerce('export:{"layer": 3}')])
    msg = str(e.value)
    assert "unknown field(s) 'layer'" in msg and "consumer 'export' takes:" in msg
    assert "layers" in msg.split("takes:")[1]


def test_tllm_consumers_shows_config_fields_limits():
    from tllm_core.app.cli import main

    info = Registry().describe()
    sae = next(c for c in info if c["name"] == "sae")
    shard = next(f for f in sae["fields"] if f["name"] == "shard_rows")
    assert shard["allowed"] == "int, >= 1"
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["consumers"]) == 0
    assert "shard_rows: int, >= 1 = 65536" in out.getvalue()
    json.dumps(info)


def test_a_greedy_run_says_why_a_guiding_consumer_did_nothing(tiny_model):
    from tllm_core import SamplerGuide
    from tllm_core.app.summary import summarize

    class Lens(Consumer):
        name = "lens"

        def writes(self):
            return [SamplerGuide()]

        def guide(self, view):
            self.counters.add("rows_contrasted", len(view.rows))

    kit = ConsumerKit(tiny_model, [Lens])
    kit.generate([[1, 2, 3]], max_tokens=3, temperature=0.0)
    greedy = kit.collect()
    assert greedy["runtime"]["steps_greedy"] == 3  # one sampling row a step, none guided
    lines = summarize(greedy, lookup=lambda _n: Lens).warnings
    assert any("sampled every row greedily (temperature 0)" in w for w in lines), lines
    kit.generate([[1, 2, 3]], max_tokens=3, temperature=1.0)
    report = kit.close()
    assert report["runtime"]["steps_greedy"] == 3  # the sampled run added none
    assert report["consumers"]["lens"]["rows_contrasted"] == 3
