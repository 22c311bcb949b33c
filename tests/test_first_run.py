"""A first run in about a minute (issue 39): a small job starts eager, and says so; the
embedded model converts in a child process while the command goes on."""

from __future__ import annotations

import argparse

import pytest

from tllm_core.app.cli import build_parser
from tllm_core.app.cli_common import EAGER_MAX_TOKENS, choose_eager


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv])


def test_a_small_job_starts_eager_and_says_why():
    args = _args()  # the default job: 1 prompt x 4 samples x 64 tokens
    note = choose_eager(args, 1 * 4 * 64)
    assert args.enforce_eager is True
    assert note == "a small job of 256 new tokens at most, --compile to compile"


@pytest.mark.parametrize(
    "argv, tokens, eager",
    [
        ((), EAGER_MAX_TOKENS, True),
        ((), EAGER_MAX_TOKENS + 1, False),  # a long job compiles, as vLLM does by default
        (("--compile",), 10, False),
        (("--enforce-eager",), 10**6, True),
    ],
)
def test_compile_or_eager(argv, tokens, eager):
    args = _args(*argv)
    choose_eager(args, tokens)
    assert args.enforce_eager is eager


def test_compile_and_enforce_eager_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        _args("--compile", "--enforce-eager")
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_conversion_child_is_not_started_for_a_cached_model(tmp_path, monkeypatch):
    from tllm_core.app import default_model

    monkeypatch.setenv("TLLM_CACHE_DIR", str(tmp_path))
    done = tmp_path / default_model.MODEL_DIRNAME
    done.mkdir()
    (done / default_model._DONE_MARKER).write_text('{"version": 1}')
    assert default_model.convert_in_background() is None


def test_a_stuck_conversion_child_is_stopped_with_a_clear_error():
    import subprocess
    import sys

    from tllm_core.app import default_model

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(default_model.DefaultModelUnavailable, match="did not finish in 0.2 s"):
        default_model.wait_for_conversion(child, timeout=0.2)
    assert child.poll() is not None  # stopped, not left running


def test_a_conversion_lock_held_too_long_is_a_clear_error(tmp_path):
    import fcntl

    from tllm_core.app import default_model

    lock = tmp_path / "model.lock"
    with open(lock, "a+") as held:  # another process's conversion (flock: per open file)
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(default_model.DefaultModelUnavailable, match=str(lock)):
            with default_model._file_lock(lock, timeout=0.3):
                pass
    with default_model._file_lock(lock, timeout=0.3):  # released: taken at once
        pass
