"""A sparse autoencoder's encode/decode math as SAELens defines it for inference, in fp32."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Literal, get_args

import torch

Architecture = Literal["standard", "jumprelu", "topk"]
Normalization = Literal["none", "layer_norm", "constant_norm_rescale"]

ARCHITECTURES: tuple[str, ...] = get_args(Architecture)
NORMALIZATIONS: tuple[str, ...] = get_args(Normalization)
_LN_EPS = 1e-5


@dataclass
class NormState:
    """Per-row statistics of the input normalization, undone when decoding."""

    mean: torch.Tensor | None = None  # [R, 1] (layer_norm)
    scale: torch.Tensor | None = None  # [R, 1]: normalized = (x - mean) * scale


@dataclass
class SparseAutoencoder:
    """Weights (SAELens layout: ``W_enc [d_in, d_sae]``, ``W_dec [d_sae, d_in]``) and settings."""

    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    architecture: Architecture = "standard"
    threshold: torch.Tensor | None = None
    k: int | None = None
    apply_b_dec_to_input: bool = True
    normalize_activations: Normalization = "none"
    rescale_acts_by_decoder_norm: bool = False
    metadata: dict = field(default_factory=dict)

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def to(self, device: torch.device | str) -> SparseAutoencoder:
        moved = {
            f.name: t.to(device=device, dtype=torch.float32)
            for f in fields(self)
            if isinstance(t := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved, metadata=dict(self.metadata))

    def normalize(self, x: torch.Tensor) -> tuple[torch.Tensor, NormState]:
        x = x.float()
        if self.normalize_activations == "layer_norm":
            mean = x.mean(dim=-1, keepdim=True)
            centered = x - mean
            scale = 1.0 / (centered.std(dim=-1, keepdim=True) + _LN_EPS)
            return centered * scale, NormState(mean, scale)
        if self.normalize_activations == "constant_norm_rescale":
            scale = (self.d_in**0.5) / x.norm(dim=-1, keepdim=True)
            return x * scale, NormState(None, scale)
        return x, NormState()

    @staticmethod
    def denormalize(y: torch.Tensor, state: NormState | None) -> torch.Tensor:
        if state is None:
            return y
        if state.scale is not None:
            y = y / state.scale
        if state.mean is not None:
            y = y + state.mean
        return y

    def pre_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, NormState]:
        xn, state = self.normalize(x)
        if self.apply_b_dec_to_input:
            xn = xn - self.b_dec
        pre = torch.addmm(self.b_enc, xn, self.W_enc)  # bias added inside the GEMM: one pass less
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        return pre, state

    def activate(self, pre: torch.Tensor) -> torch.Tensor:
        if self.architecture == "standard":
            return torch.relu(pre)
        if self.architecture == "jumprelu":
            assert self.threshold is not None
            return torch.relu(pre) * (pre > self.threshold).to(pre.dtype)
        if self.architecture == "topk":
            idx, vals = self._top_k_codes(pre)
            return torch.zeros_like(pre).scatter_(-1, idx, vals)
        raise ValueError(f"unknown SAE architecture {self.architecture!r}")

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, NormState]:
        pre, state = self.pre_activations(x)
        return self.activate(pre), state

    def decode(self, acts: torch.Tensor, state: NormState | None = None) -> torch.Tensor:
        """Reconstruction ``[R, d_in]`` in the input's own space (normalization undone)."""
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            acts = acts / self.W_dec.norm(dim=-1)
        return self.denormalize(acts @ self.W_dec + self.b_dec, state)

    def decode_sparse(self, acts: torch.Tensor, state: NormState | None = None) -> torch.Tensor:
        """:meth:`decode` outside autograd: when at most 1/16 of the activations are non-zero
        the product runs on a CSR copy, O(active features x d_in) instead of O(d_sae x d_in)."""
        if (
            acts.layout is not torch.strided
            or acts.dim() != 2
            or acts.requires_grad
            or acts.device.type != "cpu"  # a GPU's dense product beats the count's sync
            or int(torch.count_nonzero(acts)) * 16 > acts.numel()
        ):
            return self.decode(acts, state)
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            acts = acts / self.W_dec.norm(dim=-1)
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            y = torch.sparse.mm(acts.to_sparse_csr(), self.W_dec) + self.b_dec
        return self.denormalize(y, state)

    def encode_codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, NormState]:
        """A ``topk`` SAE's activations as codes: feature indices and activations ``[R, k]``;
        :meth:`encode` scattered into a dense tensor holds exactly these."""
        if self.architecture != "topk" or self.k is None:
            raise ValueError(f"encode_codes needs a topk SAE, this one is {self.architecture!r}")
        pre, state = self.pre_activations(x)
        idx, vals = self._top_k_codes(pre)
        return idx, vals, state

    def _top_k_codes(self, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.k is not None
        vals, idx = pre.topk(min(self.k, pre.shape[-1]), dim=-1, sorted=False)
        return idx, torch.relu(vals)

    def decode_codes(
        self, idx: torch.Tensor, vals: torch.Tensor, state: NormState | None = None
    ) -> torch.Tensor:
        """:meth:`decode` of codes from :meth:`encode_codes`, in O(k x d_in)."""
        if self.rescale_acts_by_decoder_norm:
            vals = vals / self.W_dec.norm(dim=-1)[idx]
        y = torch.nn.functional.embedding_bag(idx, self.W_dec, per_sample_weights=vals, mode="sum")
        return self.denormalize(y + self.b_dec, state)


def top_codes(
    idx: torch.Tensor, vals: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_features` of the dense activations the codes ``(idx, vals)`` stand for."""
    v, order = vals.topk(min(top_k, vals.shape[-1]), dim=-1, sorted=True)
    return _marked_and_padded(idx.gather(-1, order), v, top_k)


def top_features(acts: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` largest activations per row, descending: ``(indices int32, values fp32)``
    ``[R, top_k]``; slots beyond a row's active features get index ``-1`` and value ``0``."""
    vals, idx = acts.topk(min(top_k, acts.shape[-1]), dim=-1, sorted=True)
    return _marked_and_padded(idx, vals, top_k)


def _marked_and_padded(
    idx: torch.Tensor, vals: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted top features as records store them: inactive slots (value <= 0) and padding to
    ``top_k`` columns as index -1 / value 0."""
    idx = idx.to(torch.int32)
    inactive = vals <= 0
    idx = idx.masked_fill(inactive, -1)
    vals = vals.masked_fill(inactive, 0.0)
    pad = top_k - vals.shape[-1]
    if pad > 0:
        idx = torch.cat([idx, idx.new_full((idx.shape[0], pad), -1)], dim=1)
        vals = torch.cat([vals, vals.new_zeros(vals.shape[0], pad)], dim=1)
    return idx, vals
