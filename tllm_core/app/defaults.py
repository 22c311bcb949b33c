"""The model dtype ``TllmLLM``, every ``tllm`` command and ``ConsumerKit`` share, so that one
prompt gives the same text in each: float32 runs at full speed on any x86 CPU and matches
transformers' forward. ``dtype="auto"`` (``--dtype auto``): the model's own, usual on a GPU.
"""

DEFAULT_DTYPE = "float32"
