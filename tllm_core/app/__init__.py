"""The user-facing edges: the ``tllm`` command, ``tllm serve``, ``TllmLLM``, the default model."""
