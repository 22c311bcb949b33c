"""The consumer API (re-exported by ``tllm_core``); imports nothing from the other layers."""
