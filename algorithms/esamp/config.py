"""Options of the ESamp consumer (defaults are the paper's recipe)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tllm_core import ConsumerConfig, FiniteF32


class ESampConfig(ConsumerConfig):
    """ESamp settings. Unknown fields are errors (inherited)."""

    beta: FiniteF32 = Field(
        0.25,
        ge=0,
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
        description="Distiller loss of a group: its squared error ||f(h_1) - h_L||^2 summed "
        "over hidden dims and rows, divided by rows x hidden size ('mean', as F.mse_loss) or "
        "by rows ('sum', the paper's equation: hidden_size times larger loss and gradient).",
    )
    optimizer_stats: bool = Field(
        False,
        description="Measure every decode update where it runs: whether clipping fired, the "
        "share of parameters whose Adam denominator is dominated by eps (sqrt(v_hat) < eps) "
        "the step size mean |delta theta| / lr and the gradient norm before clipping "
        "(counters optimizer_*, result key "
        "'optimizer_curve'). One extra pass over the Adam moments per update.",
    )
    scope: Literal["group", "batch"] = Field(
        "group",
        description="'group': one distiller per prompt group (requests sharing group_key); "
        "'batch': one distiller shared by every live request.",
    )
    max_groups: int | None = Field(
        None,
        ge=1,
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
    ablation: Literal["none", "noise", "frozen", "f_noise"] = Field(
        "none",
        description="'noise': replace the error direction h_L - f(h_1) by Gaussian noise of the "
        "same norm per row; 'frozen': the distiller is never trained (stays at init); "
        "'f_noise': replace the prediction f(h_1) by Gaussian noise of the same norm per row "
        "(the distiller still trains, setting that norm), keeping the (1+beta) sharpening "
        "of the mix and only the learned direction replaced.",
    )
    init: Literal["paper", "zero", "zero_output"] = Field(
        "paper",
        description="'paper': random init (nn.Linear default, U(+-1/sqrt(fan_in))) for every "
        "projection; 'zero': the down projection of each block starts at zero, so f(x) = x "
        "initially (gate/up stay random so learning starts at once); 'zero_output': down "
        "projections at zero and the input is not added to the output (f(x) = blocks(x) - x, "
        "trained on h_tgt + x), so an untrained distiller predicts exactly 0: its guidance "
        "is then the pure (1+beta) sharpening.",
    )
    warm_start_steps: int = Field(
        0,
        ge=0,
        description="Optimizer steps on the prompt's own prefill rows (pairs h_src -> h_tgt of "
        "the prompt tokens) when a group's distiller is created, before its first decode step. "
        "The consumer then reads prefill rows too and creates the group's distiller at "
        "prefill. 0 = off (the paper: decode rows only). Not done under ablation 'frozen'.",
    )
    beta_schedule: Literal["constant", "fit"] = Field(
        "constant",
        description="'constant': every row uses beta (the paper). 'fit': a row's beta is "
        "multiplied by clamp(1 - e, 0, 1), where e is its group's recent relative prediction "
        "error ||h_tgt - f(h_src)|| / ||h_tgt||, an average over the group's previous decode "
        "steps (decay fit_decay), measured on each step's rows before the distiller trains on "
        "them and starting at 1: guidance is strong only once the distiller predicts well.",
    )
    fit_decay: FiniteF32 = Field(
        0.8,
        ge=0,
        lt=1,
        description="beta_schedule 'fit': e <- fit_decay * e + (1 - fit_decay) * (this step's "
        "mean relative error of the group's rows); in [0, 1).",
    )
    diagnostics: bool = Field(
        False,
        description="Record, for every guided row, the group's step index, the prediction's "
        "relative error, the number of candidates, the top candidate before and after the mix "
        "and the total-variation distance between the two candidate distributions (result "
        "key 'diagnostics'; capped at 50000 rows). On CUDA recorded on the device, each full "
        "half of a 256-step ring copied to the host without a wait: no wait in the step.",
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
    cuda_capacity: int | None = Field(
        None,
        ge=1,
        description="On CUDA: distiller slots allocated when the consumer is built (inside "
        "vLLM's load_model, so vLLM's memory profile sees them); the CUDA distiller never grows, "
        "so a group arriving while this many are live gets none (rows_skipped_cap) until one is "
        "freed. None: ceil(cuda_rows_per_step / cuda_graph_max_rows), the prompts in flight "
        "when each has that many samples (8 for 128 rows in groups of 16). max_groups, when "
        "set, is used instead. Ignored on CPU (its state grows).",
    )
    cuda_graph_max_rows: int = Field(
        16,
        ge=1,
        description="On CUDA: rows of one group per step in the packed buffers' first layout "
        "(rounded up to a power of two; the samples per prompt, n). The buffers hold slots x "
        "this many rows; a step whose group has more (n > 16, warm start) replays the graph "
        "of a layout with fewer, longer groups on the same buffers (no extra memory).",
    )
    cuda_rows_per_step: int = Field(
        128,
        ge=1,
        description="Decode rows of one step the memory plan budgets for: set it to vLLM's "
        "max_num_seqs (prompts x samples per prompt).",
    )
    cuda_adam_moments: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="On CUDA: the dtype of Adam's two moments. 'bfloat16' (opt-in) halves "
        "their memory and cuts the update's traffic from 24 to 16 bytes per parameter; "
        "updates are computed in fp32 either way. Its effect on the fit, measured on the "
        "embedded model: docs/consumers/esamp.md.",
    )
    cuda_tf32: bool = Field(
        False,
        description="On CUDA: run the distiller's products (prediction, update, the gradient "
        "inside Adam) on TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation). "
        "Faster; its effect on the fit: docs/consumers/esamp.md.",
    )
    cuda_max_candidates: int = Field(
        64,
        ge=1,
        description="On CUDA, post-filter guidance mixes up to this many candidates per row "
        "(the highest model logits), found in fixed-size tensors without a host sync (a "
        "variable-length search would make the host wait for the GPU every step); a guided "
        "row's candidates past it are dropped, a top-k filter (counter candidates_over_cap). "
        "Raise it for wide top-p. The CPU path mixes every candidate.",
    )
    max_memory_fraction: float = Field(
        0.1,
        gt=0,
        le=1,
        description="Refuse to start (an error naming the numbers) when the memory plan "
        "(state + update graph pool + step workspace, counter memory_plan_bytes, result key "
        "'memory_plan') exceeds this share of the device's memory. Checked on CUDA; on CPU "
        "the state grows with live groups, so the plan is reported but not enforced.",
    )

    @model_validator(mode="after")
    def _layers(self) -> ESampConfig:
        if self.target_layer != "final" and self.target_layer == self.source_layer:
            raise ValueError(
                f"source_layer and target_layer are both {self.source_layer}: the distiller "
                "would learn the identity"
            )
        return self
