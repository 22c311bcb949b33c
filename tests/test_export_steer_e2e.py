"""Export and steering inside real vLLM (CPU): round trip against transformers, interrupted
export, steering effects, isolation of unsteered requests, counters."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import torch
from cli_util import cli_env, long_export_argv
from conftest import ENGINE_KW
from reference import hf_states

pytestmark = pytest.mark.vllm

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog", "One two three four five"]


def test_export_round_trip_matches_transformers(tiny_model, engines, tmp_path):
    from vllm import SamplingParams

    from consumers.export import format as fmt
    from consumers.export import read_export
    from tllm_core.app.engine import TllmLLM

    out = tmp_path / "exp"
    spec = {
        "name": "export",
        "config": {"out": str(out), "layers": [0, -1, "final"], "phase": "all", "shard_rows": 16},
    }
    llm = engines.get(
        ("export", str(out)),
        lambda: TllmLLM(tiny_model, [spec], enable_prefix_caching=False, **ENGINE_KW),
    )
    outs = llm.generate(PROMPTS, SamplingParams(n=2, max_tokens=6, seed=5), use_tqdm=False)
    report = llm.close()
    engines.close()
    assert report["consumers"]["export"]["shards_written"] > 1
    assert report["runtime"]["bundles_delivered.export"] > 0
    expected = {
        (o.request_id, c.index): list(o.prompt_token_ids) + list(c.token_ids)
        for o in outs
        for c in o.outputs
    }
    # A run that went to its end is complete: every sample finished, nothing missing.
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True and not any(manifest["losses"].values()), manifest["losses"]
    assert all(r["finished"] for r in fmt.request_table(str(out), manifest))
    records = list(read_export(out, verify=True))
    assert len(records) == len(expected)
    checked = 0
    for rec in records:
        seq = expected[(rec.request_id, rec.sample_index)]
        assert rec.token_ids.tolist() == seq
        assert rec.positions.tolist() == list(range(len(seq) - 1))
        assert rec.prompt_index == PROMPTS.index(outs[rec.prompt_index].prompt)
        ref = hf_states(tiny_model, seq)
        for key in ("layer.0", "layer.3", "final"):
            torch.testing.assert_close(
                rec.hidden[key], ref[key][rec.positions], rtol=1e-4, atol=1e-4
            )
            checked += 1
    assert checked == 3 * len(expected)


@pytest.mark.slow  # ~30 s; an export stopped mid-run: tests/test_stop_signals.py
def test_interrupted_export_leaves_a_readable_directory(tiny_model, tmp_path):
    from consumers.export import IncompleteExportWarning, read_export
    from consumers.export import format as fmt

    out = tmp_path / "exp"
    # tllm run with an export of 64-row shards: the first manifest appears mid-generation
    # (tllm export's default shards hold the whole run, so its manifest comes at the end).
    spec = {"out": str(out), "layers": [0, "final"], "shard_rows": 64}
    argv = [
        *long_export_argv(tiny_model, str(out), "--prompt", "Tell me a long story", "-n", "8"),
        "--consumer",
        "stats",
    ]
    i = argv.index("export")
    argv[i : i + 7] = ["run", "--model", tiny_model, "--consumer", f"export:{json.dumps(spec)}"]
    assert argv[i + 5 : i + 7] == ["--prompt", "Tell me a long story"], argv
    proc = subprocess.Popen(
        argv,
        env=cli_env(VLLM_LOGGING_STREAM="ext://sys.stderr"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (out / "manifest.json").exists():
            time.sleep(0.5)
        assert (out / "manifest.json").exists(), "export wrote nothing"
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGKILL)  # harshest interruption: no cleanup at all
    finally:
        proc.wait(30)
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {s["file"] for s in manifest["shards"]}
    assert listed and all((out / f).exists() for f in listed)
    # Killed mid-run: the last manifest says so (none of the 400-token samples finished).
    assert manifest["complete"] is False
    assert not any(r["finished"] for r in fmt.request_table(str(out), manifest))
    with pytest.warns(IncompleteExportWarning):
        records = list(read_export(out, verify=True))
    assert sum(len(r.positions) for r in records) == sum(s["rows"] for s in manifest["shards"])


def _vector(tmp_path, hidden=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(hidden, generator=g)
    path = tmp_path / "vec.pt"
    torch.save(v / v.norm(), path)
    return path


def _tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def test_steering_changes_text_isolates_unsteered_and_counts(tiny_model, engines, tmp_path):
    from vllm import LLM, SamplingParams

    from tllm_core.app.engine import TllmLLM

    prompts = ["Write a poem", "Tell me about cats", "Once upon a time"]

    def params(extra=None):
        return SamplingParams(n=2, max_tokens=10, seed=21, temperature=1.0, extra_args=extra)

    plain = engines.get(("plain", tiny_model), lambda: LLM(tiny_model, **ENGINE_KW))
    plain_tokens = _tokens(plain.generate(prompts, [params()] * 3, use_tqdm=False))

    cfg = {"vectors": [{"layer": 1, "path": str(_vector(tmp_path)), "scale": 20.0}]}
    spec = {"name": "steer", "config": cfg, "per_request": True}
    llm = engines.get(("steer", tiny_model), lambda: TllmLLM(tiny_model, [spec], **ENGINE_KW))
    # one batch: unsteered, steered, steered with scale 0 — all in flight together
    mixed = llm.generate(
        prompts,
        [
            params(),
            params({"tllm_consumers": "steer"}),
            params({"tllm_consumers": "steer", "tllm_steer_scale": 0.0}),
        ],
        use_tqdm=False,
    )
    toks = _tokens(mixed)
    assert toks[0] == plain_tokens[0], "an unsteered request must be identical to plain vLLM"
    assert toks[2] == plain_tokens[2], "steering with scale 0 must be identical to no steering"
    assert toks[1] != plain_tokens[1], "steering must change the text"
    rep = llm.collect()
    rt, st = rep["runtime"], rep["consumers"]["steer"]
    # rows_edited comes from the tap inside the forward: rows whose stream changed. The
    # scale-0 request's rows are selected but unchanged, so fewer rows are edited.
    assert 0 < rt["rows_edited"] < st["rows_selected"]
    assert rt["rows_edited.layer.1"] == rt["rows_edited"]

    def delta(extra):
        before = llm.collect()
        llm.generate([prompts[0]], [params(extra)], use_tqdm=False)
        after = llm.collect()
        return (
            after["runtime"].get("rows_edited", 0) - before["runtime"].get("rows_edited", 0),
            after["consumers"]["steer"]["rows_selected"]
            - before["consumers"]["steer"]["rows_selected"],
        )

    edited, selected = delta({"tllm_consumers": "steer", "tllm_steer_scale": 0.0})
    assert selected > 0 and edited == 0, "a zero edit changes nothing and must count nothing"
    edited, selected = delta({"tllm_consumers": "steer", "tllm_steer_scale": 5.0})
    assert edited == selected > 0, "every selected row's stream changes under a non-zero vector"
    # same prompt again, unsteered, after the steered request filled the prefix cache
    again = llm.generate([prompts[1]], [params()], use_tqdm=False)
    assert _tokens(again)[0] == plain_tokens[1], "steered prompt blocks leaked through the cache"
    engines.close()


def test_steer_compute_cli(tiny_model, engines, tmp_path, capsys):
    """The command's ``main`` in this process, on an in-process engine (a start in seconds;
    the default multiprocess layout is every other command test's)."""
    from tllm_core.app.cli import main

    pos, neg = tmp_path / "pos.txt", tmp_path / "neg.txt"
    pos.write_text("I love this\nThis is wonderful\n")
    neg.write_text("I hate this\nThis is awful\n")
    out = tmp_path / "v.npy"
    engines.close()  # one engine at a time
    argv = ["steer", "compute", "--positive", str(pos), "--negative", str(neg), "--layer", "-2"]
    argv += ["--out", str(out), "--model", tiny_model, "--enforce-eager"]
    argv += ["--max-model-len", "256", "--kv-cache-gib", "1", "--json"]
    try:
        assert main(argv) == 0
    finally:
        gc.collect()  # the command's engine, closed, is freed before the next test's
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    v = np.load(out)
    assert v.shape == (128,) and np.isfinite(v).all() and res["layer"] == 2
    assert res["norm"] > 0 and res["positive_rows"] == 2 and res["negative_rows"] == 2
