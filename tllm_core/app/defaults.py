"""The model dtype that ``TllmLLM``, every ``tllm`` command and ``ConsumerKit`` share, so that
one prompt gives the same text in each of them.

float32: vLLM's CPU build runs it at full speed on any x86 CPU (bfloat16 needs AMX or AVX512-BF16
to be fast) and transformers' float32 forward is then the same computation, which the kit's
results are compared with. Pass ``dtype="auto"`` (``--dtype auto``) for the model's own dtype,
the usual choice on a GPU.
"""

DEFAULT_DTYPE = "float32"
