"""Test tools for consumer authors and for tllm's own GPU-only code: checks that run
without vLLM (and without a GPU) in a plain pytest test."""
