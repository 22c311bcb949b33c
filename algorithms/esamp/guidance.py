"""Pure mixing functions of ESamp guidance.

Convention: ``ref`` logits are the sampler's (already divided by the row temperature, -inf
off the candidate set); ``dist`` logits are raw head projections of the distiller's
prediction, so they are divided by the same temperature here ("mix before temperature").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from algorithms.esamp.kernels import candidate_dot

# dist_fn(rows [N], tokens [N]) -> raw dist logits [N] for those (row, token) pairs.
DistFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mix_candidates(
    ref: torch.Tensor, dist: torch.Tensor, beta: torch.Tensor | float, temperature: torch.Tensor
) -> torch.Tensor:
    """The ESamp mix for candidate entries: ``(1+beta)*ref - beta*dist/T`` elementwise
    (``ref`` temperature-scaled, ``dist`` raw head projections)."""
    t = temperature.to(ref.dtype)
    return (1 + beta) * ref - beta * dist.to(ref.dtype) / t


def mix_post_filter(
    ref_logits: torch.Tensor, dist_fn: DistFn, beta: float, temperature: torch.Tensor
) -> torch.Tensor:
    """Mix on the surviving candidates only.

    ``ref_logits [R, V]``: temperature-scaled, -inf for non-candidates. Candidates get
    ``(1+beta)*ref - beta*dist/T``; non-candidates stay -inf. ``dist_fn`` is called once,
    with exactly the candidate (row, token) pairs.
    """
    if beta == 0:
        return ref_logits.clone()  # bit-identical: never touch the logits
    rows, toks = torch.isfinite(ref_logits).nonzero(as_tuple=True)
    out = torch.full_like(ref_logits, float("-inf"))
    out[rows, toks] = mix_candidates(
        ref_logits[rows, toks], dist_fn(rows, toks), beta, temperature[rows]
    )
    return out


def _per_row(beta: torch.Tensor | float) -> torch.Tensor | float:
    """A per-row beta ``[R]`` as a column ``[R, 1]``; a float stays a float."""
    return beta[:, None] if isinstance(beta, torch.Tensor) else beta


def mix_full_vocab_logits(
    ref_logits: torch.Tensor,
    dist_logits: torch.Tensor,
    beta: torch.Tensor | float,
    temperature: torch.Tensor,
    inplace: bool = False,
) -> torch.Tensor:
    """Two-projection mix over the whole vocabulary: ``(1+beta)*ref - beta*dist/T``
    (``beta`` a float or one value per row). ``inplace``: the result is written into
    ``dist_logits`` (same dtype as ``ref_logits``), so the mix needs no ``[R, V]``
    temporary of its own."""
    if not isinstance(beta, torch.Tensor) and beta == 0:
        return ref_logits.clone()
    b = _per_row(beta)
    t = temperature.to(ref_logits.dtype)[:, None]
    if not inplace:
        return (1 + b) * ref_logits - b * dist_logits.to(ref_logits.dtype) / t
    # -(b*dist/t) + (1+b)*ref in one fused pass (addcmul may round the last bit differently
    # from the two-step form above).
    out = dist_logits.mul_(b).div_(t).neg_()
    one_b = 1 + b if isinstance(b, torch.Tensor) else torch.tensor(1 + b, device=out.device)
    return out.addcmul_(ref_logits, one_b)


def mix_latent(
    h_target: torch.Tensor, f_pred: torch.Tensor, beta: torch.Tensor | float
) -> torch.Tensor:
    """Latent mix ``(1+beta)*h_L - beta*f(h_1)`` (``beta`` a float or one value per row): one
    head projection of it equals the logits mix exactly for a linear head without bias or
    soft-capping."""
    b = _per_row(beta)
    return (1 + b) * h_target - b * f_pred


def candidate_dist_fn(
    f_pred: torch.Tensor,
    weight: torch.Tensor | None = None,
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    dense_fraction: float = 0.25,
) -> DistFn:
    """Dist logits for candidate pairs from the prediction ``f_pred [R, H]``.

    With a plain head ``weight [V, H]`` and a sparse candidate set, gathers
    ``W[tokens] · f[rows]`` (:func:`~algorithms.esamp.kernels.candidate_dot`).
    Otherwise (dense set, or a non-linear head given as ``lm_head``) projects the full
    vocabulary once and gathers.
    """
    if weight is None and lm_head is None:
        raise ValueError("need the head weight or the lm_head callable")

    def fn(rows: torch.Tensor, toks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # ``out``: fp32 ``[N]`` to write the sparse form's result into (nothing allocated).
        r, h = f_pred.shape
        n = rows.numel()
        if weight is not None and n <= dense_fraction * r * weight.shape[0]:
            # One fused gather-dot (Triton on CUDA: each head row read once, nothing
            # materialised; on CPU the PyTorch reference, ``chunk`` rows at a time).
            if out is None:
                out = torch.empty(n, dtype=torch.float32, device=f_pred.device)
            return candidate_dot(weight, f_pred.float(), rows, toks, out)
        return full_dist_logits(f_pred, weight, lm_head)[rows, toks]

    return fn


def full_dist_logits(
    f_pred: torch.Tensor,
    weight: torch.Tensor | None = None,
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Raw dist logits over the vocabulary ``[R, V]`` (fp32). ``lm_head`` (fp32 in, any dtype
    out; it casts to the model dtype itself) is preferred: it is exactly the model's head."""
    if lm_head is not None:
        return lm_head(f_pred).float()
    if weight is None:
        raise ValueError("need the head weight or the lm_head callable")
    return (f_pred.to(weight.dtype) @ weight.t()).float()


def noise_prediction(
    h_target: torch.Tensor, f_pred: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Noise ablation: a stand-in prediction ``h_L - n`` whose error ``n`` is Gaussian with the
    same per-row norm as the real error ``h_L - f(h_1)`` (direction randomised)."""
    err_norm = torch.linalg.vector_norm(h_target - f_pred, dim=-1, keepdim=True)
    n = torch.randn(
        h_target.shape, generator=generator, device=h_target.device, dtype=h_target.dtype
    )
    n = n / torch.linalg.vector_norm(n, dim=-1, keepdim=True).clamp_min(1e-12) * err_norm
    return h_target - n


def f_noise_prediction(
    f_pred: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """f-noise ablation: Gaussian noise with the same per-row norm as the prediction
    ``f(h_1)`` (direction randomised). The mix ``(1+beta) ref - beta dist`` keeps its
    ``(1+beta)`` sharpening; only the learned direction of ``f`` is replaced."""
    n = torch.randn(f_pred.shape, generator=generator, device=f_pred.device, dtype=f_pred.dtype)
    norm = torch.linalg.vector_norm(f_pred, dim=-1, keepdim=True)
    return n / torch.linalg.vector_norm(n, dim=-1, keepdim=True).clamp_min(1e-12) * norm


def relative_error(h_target: torch.Tensor, f_pred: torch.Tensor) -> torch.Tensor:
    """Per row ``||h_target - f_pred|| / ||h_target||`` (fp32; a zero target counts as 1)."""
    h = h_target.float()
    num = torch.linalg.vector_norm(h - f_pred.float(), dim=-1)
    den = torch.linalg.vector_norm(h, dim=-1)
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.ones_like(num))


def fit_scale(err: torch.Tensor) -> torch.Tensor:
    """beta_schedule 'fit': the factor ``clamp(1 - err, 0, 1)`` of a group's recent relative
    error (1 = the distiller predicts perfectly, 0 = no better than predicting zero)."""
    return (1 - err).clamp(0.0, 1.0)


def candidate_shift(
    rows: torch.Tensor, tokens: torch.Tensor, ref: torch.Tensor, new: torch.Tensor, n_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """How a mix moved each row's candidate distribution. Entries ``(rows[j], tokens[j])``
    with logits ``ref[j]`` before and ``new[j]`` after (rows in ``0..n_rows-1``). Returns per
    row: total-variation distance between softmax(ref) and softmax(new) over its candidates,
    the top token before, the top token after, the number of candidates (rows without
    candidates: 0, -1, -1, 0)."""
    ref, new = ref.float(), new.float()

    def softmax(x: torch.Tensor) -> torch.Tensor:
        mx = torch.full((n_rows,), float("-inf"), device=x.device)
        mx = mx.scatter_reduce(0, rows, x, "amax")
        e = torch.exp(x - mx[rows])
        s = torch.zeros(n_rows, device=x.device).index_add_(0, rows, e)
        return e / s[rows]

    def top(x: torch.Tensor) -> torch.Tensor:
        mx = torch.full((n_rows,), float("-inf"), device=x.device)
        mx = mx.scatter_reduce(0, rows, x, "amax")
        # Lowest-index entry reaching the row max (ties: the first candidate).
        pos = torch.arange(x.numel(), device=x.device)
        hit = torch.where(x == mx[rows], pos, torch.full_like(pos, x.numel()))
        first = torch.full((n_rows,), x.numel(), device=x.device, dtype=torch.long)
        first = first.scatter_reduce(0, rows, hit, "amin")
        tok = torch.full((n_rows,), -1, device=x.device, dtype=torch.long)
        ok = first < x.numel()
        tok[ok] = tokens[first[ok]].long()
        return tok

    tv = torch.zeros(n_rows, device=ref.device).index_add_(
        0, rows, (softmax(ref) - softmax(new)).abs()
    )
    count = torch.zeros(n_rows, device=ref.device, dtype=torch.long).index_add_(
        0, rows, torch.ones_like(rows)
    )
    return tv / 2, top(ref), top(new), count
