"""The consumer API: what a consumer or producer author touches (ports, bundles, rows, edits,
counters, config numbers, request keys and the pluggy hook specifications). Imports nothing
from the other layers; ``tllm_core``'s top level re-exports its public names."""
