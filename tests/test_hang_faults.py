"""A hung consumer callback in a real engine (issue 46, item 2): the engine's watchdog names the
consumer, the callback and where it waits, and stops the engine; ``TllmLLM`` then raises
:class:`ConsumerHungError` within seconds of the deadline, and nothing of the engine is left.
The callback kinds one by one are tests/test_watchdog.py's (the consumer kit, no vLLM)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from node_util import leftover_shm, shm_entries

DEADLINE_S = 3
# The deadline, the watchdog's look, the engine watch's notice: seconds, bounded generously.
HANG_BOUND_S = 40

HANG_IN_GENERATE = r"""
import sys, time
from vllm import SamplingParams
from tllm_core import TllmLLM
from tllm_core.app.engine import ConsumerHungError
from tllm_core.vllm_bridge.lifecycle import engine_processes

spec = 'hang:{"callback": "on_bundle", "after": 3}'
llm = TllmLLM(sys.argv[1], consumers=[spec], callback_deadline_s=float(sys.argv[2]),
              enforce_eager=True, max_model_len=512)
print("core", engine_processes(llm.llm.llm_engine.engine_core)[0].pid, flush=True)
t0 = time.monotonic()
try:
    llm.generate(["Tell me a story"] * 2, SamplingParams(n=2, max_tokens=64, ignore_eos=True))
    print("generate returned", flush=True)
except ConsumerHungError as e:
    print("hung", round(time.monotonic() - t0, 1), e.hung.consumer, e.hung.callback, flush=True)
    print("error", e, flush=True)
finally:
    llm.shutdown()
"""


def _env() -> dict[str, str]:
    here = os.getcwd()
    paths = [here, str(Path(here) / "tests" / "plugin_pkg"), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


@pytest.mark.vllm
def test_a_hung_on_bundle_ends_generate_naming_the_consumer(tiny_model):
    before = shm_entries()
    proc = subprocess.run(
        [sys.executable, "-c", HANG_IN_GENERATE, tiny_model, str(DEADLINE_S)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    out = proc.stdout
    assert proc.returncode == 0, (out, proc.stderr[-4000:])
    hung = re.search(r"^hung ([\d.]+) (\S+) (\S+)$", out, re.M)
    assert hung, (out, proc.stderr[-4000:])
    assert float(hung.group(1)) < HANG_BOUND_S, out
    assert hung.group(2, 3) == ("hang", "on_bundle"), out
    error = re.search(r"^error (.*)$", out, re.M).group(1)
    assert "consumer 'hang' is stuck in on_bundle" in error and "_maybe_hang" in error, error
    # The engine's log names it with its stack too; vLLM logs no crash of its own.
    assert "_maybe_hang" in proc.stderr + out, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr + out, proc.stderr[-4000:]
    core = int(re.search(r"^core (\d+)", out, re.M).group(1))
    assert leftover_shm(before, {core}) == [], proc.stderr[-4000:]
