"""The consumer API: what a consumer, producer or plugin author touches (re-exported by
``tllm_core``). Imports nothing from the other layers."""
