"""vLLM's decoder families as tllm architecture specs (the built-in tap sites), returned by
the bridge's ``tllm_architectures`` hook."""

from __future__ import annotations

from tllm_core.api.architectures import Architectures, ArchitectureSpec, SiteSpec

SITES = (
    # Decoder layer ``(positions, h, residual) -> (h, residual)``: the residual stream after
    # the layer is h + residual (the next layer's fused add-norm adds them); a layer returning
    # one tensor (Granite) returns the stream itself.
    SiteSpec("residual", output="sum", what="decoder layer"),
    SiteSpec("attn", ("self_attn", "attn", "self_attention"), what="self-attention block"),
    SiteSpec(
        "mlp",
        ("mlp", "feed_forward", "block_sparse_moe"),
        what="MLP / MoE block",
        partial_if=("shared_mlp", "shared_expert", "shared_experts"),
    ),
    # An MoE block's router logits: a forward hook on its gate (``gate``; gpt-oss ``router``),
    # refused at layers whose block is a dense MLP.
    SiteSpec("router", ("mlp", "feed_forward", "block_sparse_moe"), "router", "MLP / MoE block"),
)

# Decoder layers returning ``(stream, residual)`` whose first element already includes the
# residual (``hidden_states = residual + block(...)``) and whose model applies the final norm
# to that element alone: ``h + residual`` would count the residual twice. GraniteMoeHybrid is
# checked by tests/test_arch_matrix.py; the others are from reading vLLM 0.32's model files.
STREAM_FIRST_LAYERS = frozenset(
    {
        "GraniteMoeHybridAttentionDecoderLayer",
        "GraniteMoeHybridMambaDecoderLayer",
        "CohereDecoderLayer",
        "Cohere2MoeDecoderLayer",
        "CohereCompassDecoderLayer",
        "Exaone4DecoderLayer",
        "HyperCLOVAXDecoderLayer",
        "MuseGlimmerDecoderLayer",
        "PhiMoEDecoderLayer",
        "StablelmDecoderLayer",
    }
)

ARCHITECTURES = (
    # vLLM's causal LMs keep their layers at ``model.layers``; others are found by shape.
    ArchitectureSpec("decoder", layers="model.layers", sites=SITES),
    ArchitectureSpec(
        "stream-first",
        layer_classes=STREAM_FIRST_LAYERS,
        sites=(SiteSpec("residual", output="first", what="decoder layer"),),
    ),
)


def builtin_architectures() -> Architectures:
    """The built-in specs alone (the engine uses its registry's, third-party ones included)."""
    return Architectures(ARCHITECTURES)
