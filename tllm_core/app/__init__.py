"""The user-facing edges: the ``tllm`` command and its helpers for plugin commands, ``tllm
serve``, the Python ``TllmLLM`` and the embedded default model."""
