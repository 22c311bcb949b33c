"""Options of the ESamp consumer (defaults are the paper's recipe)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from tllm_core.consumer import ConsumerConfig


class ESampConfig(ConsumerConfig):
    """ESamp settings. Unknown fields are errors (inherited)."""

    beta: float = Field(
        0.25,
        description="Exploration strength: logits_new = (1+beta)*logits_ref - beta*logits_dist. "
        "0 leaves sampling bit-identical to vanilla (the distiller still trains).",
    )
    source_layer: int = Field(
        0,
        description="Decoder layer whose output residual stream is the distiller input h_1 "
        "(negative counts from the end).",
    )
    target_layer: int | Literal["final"] = Field(
        "final",
        description="What the distiller predicts: 'final' (after the final norm, the LM head "
        "input) or a decoder layer index. Guidance always projects the prediction with the "
        "LM head, so a non-final target gives logit-lens semantics.",
    )
    intermediate_size: int = Field(384, description="Intermediate width of each SwiGLU block.")
    num_blocks: int = Field(2, description="Number of residual gated-SwiGLU blocks.")
    lr: float = Field(4e-4, description="Adam learning rate.")
    eps: float = Field(1e-4, description="Adam epsilon.")
    grad_clip: float | None = Field(
        0.5, description="Per-group gradient-norm clip (None disables clipping)."
    )
    scope: Literal["group", "batch"] = Field(
        "group",
        description="'group': one distiller per prompt group (requests sharing group_key); "
        "'batch': one distiller shared by every live request.",
    )
    max_groups: int | None = Field(
        None,
        description="Cap on live distillers. A new group arriving at the cap gets none: its rows "
        "are neither guided nor trained (counted as rows_skipped_cap / train_rows_skipped_cap) "
        "until a live group is freed, after which it gets a fresh distiller on its next decode "
        "row. None = unlimited.",
    )
    mode: Literal["post_filter", "full_vocab", "auto"] = Field(
        "auto",
        description="'post_filter': mix only on the candidates that survive top-k/top-p/min-p "
        "(dist logits computed only for them); 'full_vocab': mix over the whole vocabulary; "
        "'auto': post_filter when the sampler view is filtered, else full_vocab.",
    )
    mix: Literal["logits", "latent"] = Field(
        "logits",
        description="Full-vocab mixing: 'logits' = two projections; 'latent' = one projection "
        "of (1+beta)h_L - beta f(h_1). Latent needs a plain linear head (lm_head_weight) and "
        "target 'final', else it falls back to 'logits' (counter latent_fallback_rows). Latent "
        "recomputes the reference logits from h_L, so logits processors are not applied to them.",
    )
    ablation: Literal["none", "noise", "frozen"] = Field(
        "none",
        description="'noise': replace the error direction h_L - f(h_1) by Gaussian noise of the "
        "same norm per row; 'frozen': the distiller is never trained (stays at init).",
    )
    init: Literal["paper", "zero"] = Field(
        "paper",
        description="'paper': random init (nn.Linear default, U(+-1/sqrt(fan_in))) for every "
        "projection; 'zero': the down projection of each block starts at zero, so f(x) = x "
        "initially (gate/up stay random so learning starts at once).",
    )
    seed: int = Field(
        0,
        description="Seed of the distiller init (every group starts from the same weights) and "
        "of the noise ablation.",
    )
    train: bool = Field(True, description="Train the distiller online (False = same as frozen).")
    skip_mixed_batches: bool = Field(
        False,
        description="Paper's guardrail: bypass the distiller (no guidance, no training) on steps "
        "that also contain prefill rows. Off by default: rows are selected one by one instead.",
    )
    cpu_update: Literal["auto", "thread", "inline"] = Field(
        "auto",
        description="On CPU: 'thread' runs each training step on a side thread (the CPU "
        "counterpart of the CUDA side stream; the next prediction waits for it, so guidance "
        "stays strictly fresh); 'inline' runs it on the engine thread right after sampling; "
        "'auto' picks 'thread' only when a core is idle (torch uses fewer threads than the "
        "process may use cores), since a side thread competing with the model's OpenMP "
        "threads slows the forward more than it saves. Same math either way.",
    )
    use_cuda_graph: bool = Field(
        True,
        description="On CUDA, capture the update step as CUDA graphs when the consumer is "
        "built (one per bucket of groups x rows per group) and replay them (else eager).",
    )
    cuda_capacity: int = Field(
        64,
        description="On CUDA: distiller slots allocated when the consumer is built (inside "
        "vLLM's load_model, so vLLM's memory profile sees them); the CUDA distiller never grows, "
        "so a group arriving while this many are live gets none (rows_skipped_cap) until one is "
        "freed. max_groups, when set, is used instead. Ignored on CPU (its state grows).",
    )
    cuda_graph_max_rows: int = Field(
        64,
        description="On CUDA: update graphs are captured for up to this many rows of one group "
        "in a step (rounded up to a power of two); a step with more runs eagerly (counter "
        "eager_updates, logged).",
    )

    @field_validator("beta")
    @classmethod
    def _beta(cls, v: float) -> float:
        if not v >= 0:
            raise ValueError(f"beta must be >= 0 (0 disables guidance), got {v}")
        return v

    @field_validator("intermediate_size", "num_blocks", "cuda_capacity", "cuda_graph_max_rows")
    @classmethod
    def _positive_int(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    @field_validator("lr", "eps")
    @classmethod
    def _positive(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"must be > 0, got {v}")
        return v

    @field_validator("grad_clip")
    @classmethod
    def _clip(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError(f"grad_clip must be > 0 or None (no clipping), got {v}")
        return v

    @field_validator("max_groups")
    @classmethod
    def _cap(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_groups must be >= 1 or None (unlimited), got {v}")
        return v

    @model_validator(mode="after")
    def _layers(self) -> ESampConfig:
        if self.target_layer != "final" and self.target_layer == self.source_layer:
            raise ValueError(
                f"source_layer and target_layer are both {self.source_layer}: the distiller "
                "would learn the identity"
            )
        return self
