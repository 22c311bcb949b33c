"""ESamp's options (defaults: the paper's recipe; in detail: docs/consumers/esamp.md, "Config")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tllm_core import ConsumerConfig, FiniteF32

# Far past any useful tilt; below it (1+beta) x a logit stays finite in fp32 (a request's
# beta near fp32's max would make its row's logits NaN).
MAX_BETA = 1000.0


class ESampConfig(ConsumerConfig):
    """ESamp settings. Unknown fields are errors (inherited)."""

    beta: FiniteF32 = Field(
        0.25,
        ge=0,
        le=MAX_BETA,
        description="Exploration strength: logits_new = (1+beta)*logits_ref - beta*logits_dist "
        "(0: sampling bit-identical to vanilla; the distiller still trains).",
    )
    source_layer: int = Field(
        0, description="Decoder layer whose output is the distiller input (negative: from end)."
    )
    target_layer: int | Literal["final"] = Field(
        "final",
        description="What the distiller predicts: 'final' (the LM head input) or a decoder "
        "layer index (projected by the LM head: logit-lens semantics).",
    )
    intermediate_size: int = Field(
        384, ge=1, description="Intermediate width of each SwiGLU block."
    )
    num_blocks: int = Field(2, ge=1, description="Number of residual gated-SwiGLU blocks.")
    lr: FiniteF32 = Field(4e-4, gt=0, description="Adam learning rate.")
    eps: FiniteF32 = Field(1e-4, gt=0, description="Adam epsilon.")
    grad_clip: FiniteF32 | None = Field(
        0.5, gt=0, description="Per-group gradient-norm clip (None disables clipping)."
    )
    loss_reduction: Literal["mean", "sum"] = Field(
        "mean",
        description="Squared error / (rows x hidden size) ('mean'), or / rows ('sum', the paper).",
    )
    optimizer_stats: bool = Field(
        False,
        description="Measure every update (counters optimizer_*, result key 'optimizer_curve').",
    )
    scope: Literal["group", "batch"] = Field(
        "group",
        description="'group': a distiller per prompt (group_key); 'batch': one shared by all.",
    )
    max_groups: int | None = Field(
        None,
        ge=1,
        description="Cap on live distillers (None: unlimited); a group at the cap gets none "
        "until one is freed (rows_skipped_cap, train_rows_skipped_cap).",
    )
    mode: Literal["post_filter", "full_vocab", "auto"] = Field(
        "auto",
        description="'post_filter': mix only the candidates surviving top-k/top-p/min-p; "
        "'full_vocab': the whole vocabulary; 'auto': post_filter when the view is filtered.",
    )
    mix: Literal["logits", "latent"] = Field(
        "logits",
        description="Full-vocab mixing: 'logits' = two projections; 'latent' = one projection "
        "of (1+beta)h_L - beta f(h_1). Latent needs a plain linear head (lm_head_weight) and "
        "target 'final', else it falls back to 'logits' (counter latent_fallback_rows). Latent "
        "recomputes the reference logits from h_L, so logits processors are not applied to them "
        "(filters and a structured-output grammar still hold: only candidates are written).",
    )
    ablation: Literal["none", "noise", "frozen", "f_noise"] = Field(
        "none",
        description="'noise': the error direction h_L - f(h_1) replaced by Gaussian noise of its "
        "norm; 'frozen': never trained; 'f_noise': f(h_1) replaced by noise of its norm.",
    )
    init: Literal["paper", "zero", "zero_output"] = Field(
        "paper",
        description="'paper': nn.Linear's random init; 'zero': down projections at zero (f(x) "
        "= x); 'zero_output': likewise and f(x) = blocks(x) - x (an untrained f predicts 0).",
    )
    warm_start_steps: int = Field(
        0, ge=0, description="Optimizer steps on a new group's prompt rows (0: off, the paper)."
    )
    beta_schedule: Literal["constant", "fit"] = Field(
        "constant",
        description="'constant': every row uses beta (the paper). 'fit': beta times clamp(1 - e, "
        "0, 1), e the group's recent relative prediction error (starts at 1).",
    )
    fit_decay: FiniteF32 = Field(
        0.8,
        ge=0,
        lt=1,
        description="beta_schedule 'fit': e <- fit_decay * e + (1 - fit_decay) * step's error.",
    )
    diagnostics: bool = Field(
        False,
        description="Record per guided row its prediction error and how the mix moved its "
        "candidates (result key 'diagnostics', 50000 rows at most; no wait in the step).",
    )
    seed: int = Field(0, description="Seed of the distiller init and of the noise ablations.")
    train: bool = Field(True, description="Train the distiller online (False = same as frozen).")
    skip_mixed_batches: bool = Field(
        False, description="The paper's guardrail: no guidance or training on steps with prefill."
    )
    cpu_update: Literal["auto", "thread", "inline"] = Field(
        "auto",
        description="On CPU: each training step on a side thread ('thread') or the engine "
        "thread ('inline'); 'auto': 'thread' only when a core is idle. Same math either way.",
    )
    use_cuda_graph: bool = Field(
        True, description="On CUDA, capture the update step as CUDA graphs (else eager)."
    )
    cuda_capacity: int | None = Field(
        None,
        ge=1,
        description="On CUDA: distiller slots, allocated with the consumer, never grown (None: "
        "ceil(cuda_rows_per_step / cuda_graph_max_rows); max_groups when set). CPU: ignored.",
    )
    cuda_graph_max_rows: int = Field(
        16, ge=1, description="On CUDA: rows per group in the packed buffers (samples per prompt)."
    )
    cuda_rows_per_step: int = Field(
        128, ge=1, description="Decode rows of one step (vLLM's max_num_seqs) the plan budgets."
    )
    cuda_adam_moments: Literal["float32", "bfloat16"] = Field(
        "float32", description="On CUDA: the dtype of Adam's moments (updates computed in fp32)."
    )
    cuda_tf32: bool = Field(
        False, description="On CUDA: the distiller's products on TF32 tensor cores (faster)."
    )
    cuda_max_candidates: int = Field(
        64,
        ge=1,
        description="On CUDA, post-filter guidance mixes up to this many candidates per row; a "
        "guided row's others are dropped (candidates_over_cap). CPU: all.",
    )
    max_memory_fraction: float = Field(
        0.1,
        gt=0,
        le=1,
        description="Refuse to start when the memory plan exceeds this share (CUDA only).",
    )

    @model_validator(mode="after")
    def _layers(self) -> ESampConfig:
        if self.target_layer != "final" and self.target_layer == self.source_layer:
            raise ValueError(
                f"source_layer and target_layer are both {self.source_layer}: the distiller "
                "would learn the identity"
            )
        return self
