"""Test-time algorithms built on the tllm consumer API."""
