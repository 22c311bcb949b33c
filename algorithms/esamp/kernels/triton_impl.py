"""The Triton kernels (launchers in ``op_<op>.py``): plain functions decorated by
:func:`jit_kernels`, so a test can run its own copy under ``TRITON_INTERPRET=1`` on CPU. They
call only Triton builtins and this module's helpers, decorated again in their scope (a
library ``@triton.jit`` helper such as ``tl.zeros`` may be compiled where they are interpreted)."""

from __future__ import annotations

import functools
import types
from types import SimpleNamespace
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _tile(base, rows, cols, s_row, s_col):
    # Pointers to the [rows, cols] tile of the matrix at base (strides s_row, s_col).
    return base + rows[:, None] * s_row + cols[None, :] * s_col


@triton.jit
def _load_tile(base, rows, cols, s_row, s_col, mask):
    # Masked-off elements read as 0: padding rows and columns add nothing to a product.
    return tl.load(_tile(base, rows, cols, s_row, s_col), mask=mask, other=0.0)


@triton.jit
def _swiglu_grads(dp, a, u, s):
    # The gradients at u and a of p = s * u, s = silu(a): du = dp * s, da = dp * u * silu'(a).
    du = dp * s
    sig = 1.0 / (1.0 + tl.exp(-a))
    da = dp * u * sig * (1.0 + a * (1.0 - sig))
    return du, da


@triton.jit
def _gram(base, ri, rj, cols, s_row, s_col, mi, mj, acc, INPUT_PRECISION: tl.constexpr):
    # acc + (rows ri) @ (rows rj)^T of the matrix at base, over the columns cols.
    ti = _load_tile(base, ri, cols, s_row, s_col, mi)
    tj = _load_tile(base, rj, cols, s_row, s_col, mj)
    return tl.dot(ti, tl.trans(tj), acc, input_precision=INPUT_PRECISION)


# The helpers the kernels call, decorated afresh by jit_kernels.
_DEVICE_HELPERS = ("_tile", "_load_tile", "_swiglu_grads", "_gram")


def _grad_adam_kernel(
    a_ptr,  # [G, M, N] fp32
    b_ptr,  # [G, M, K] fp32
    scale_ptr,  # [G] fp32
    slot_ptr,  # [G] int
    ok_ptr,  # [G] (bool as uint8, int or float): 0 skips the group
    step_ptr,  # [S] fp32, already counting this step
    w_ptr,  # [S, N, K] fp32 (strided view)
    m_ptr,  # [S, N, K] fp32 or bf16
    v_ptr,
    M, N, K,
    E_B,  # b's matrices: matrix e uses b[:, e % E_B] (1: shared)
    s_ag, s_ae, s_am, s_an, s_bg, s_be, s_bm, s_bk, s_ws, s_we, s_wn, s_wk,
    s_ms, s_me, s_mn, s_mk, s_vs, s_ve, s_vn, s_vk,
    lr, beta1, beta2, eps,
    # 1 - beta and log(beta), from the host's fp64 (1 - beta2 in fp32 is off by 1e-5)
    one_minus_beta1, one_minus_beta2, log_beta1, log_beta2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    # One [BLOCK_N, BLOCK_K] tile of one group's matrix: form that tile of the gradient in
    # registers, then Adam on it, reading and writing each element of w, m, v once.
    tile = tl.program_id(0)
    g = tl.program_id(1)
    e = tl.program_id(2)  # which matrix of the slot
    slot = tl.load(slot_ptr + g).to(tl.int64)
    ok = tl.load(ok_ptr + g)
    if (slot < 0) | (ok == 0):
        return  # nothing read, nothing written: the slot keeps its state bit for bit
    tiles_k = (K + BLOCK_K - 1) // BLOCK_K
    offs_n = (tile // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = (tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_n = offs_n < N
    in_k = offs_k < K
    a_base = a_ptr + g.to(tl.int64) * s_ag + e * s_ae
    b_base = b_ptr + g.to(tl.int64) * s_bg + (e % E_B) * s_be

    # grad tile = a[g][:, n]^T @ b[g][:, k]; M (rows) padded to BLOCK_M by masked loads.
    acc = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < M
        at = _load_tile(a_base, offs_m, offs_n, s_am, s_an, in_m[:, None] & in_n[None, :])
        bt = _load_tile(b_base, offs_m, offs_k, s_bm, s_bk, in_m[:, None] & in_k[None, :])
        acc = tl.dot(tl.trans(at), bt, acc, input_precision=INPUT_PRECISION)
    grad = acc * tl.load(scale_ptr + g)

    # torch._fused_adam_'s formula: bias corrections in fp64 (beta^t = exp(t log beta)).
    t = tl.load(step_ptr + slot).to(tl.float64)
    bc1 = 1.0 - tl.exp(t * log_beta1)
    bc2 = 1.0 - tl.exp(t * log_beta2)
    step_size = (lr / bc1).to(tl.float32)
    bc2_sqrt = tl.sqrt(bc2).to(tl.float32)

    mask = in_n[:, None] & in_k[None, :]
    w_ptrs = _tile(w_ptr + slot * s_ws + e * s_we, offs_n, offs_k, s_wn, s_wk)
    m_ptrs = _tile(m_ptr + slot * s_ms + e * s_me, offs_n, offs_k, s_mn, s_mk)
    v_ptrs = _tile(v_ptr + slot * s_vs + e * s_ve, offs_n, offs_k, s_vn, s_vk)
    w = tl.load(w_ptrs, mask=mask)
    m = tl.load(m_ptrs, mask=mask).to(tl.float32)
    v = tl.load(v_ptrs, mask=mask).to(tl.float32)
    m = beta1 * m + one_minus_beta1 * grad
    v = beta2 * v + one_minus_beta2 * grad * grad
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    w = w - tl.div_rn(step_size * m, denom)
    tl.store(w_ptrs, w, mask=mask)
    tl.store(m_ptrs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptrs, v.to(v_ptr.dtype.element_ty), mask=mask)


def _slot_matmul_kernel(
    x_ptr,  # [G, E, M, K] fp32 (s_xe 0: one x for every e)
    w_ptr,  # [S, E, ., .] fp32: element (k, n) of slot s, matrix e at s * s_ws + e * s_we + ...
    slot_ptr,  # [G] int
    out_ptr,  # [G, E, M, N] fp32 ([G, M, N] with REDUCE_E: the sum over e)
    add_ptr,  # [G, M, N] fp32, added to out (HAS_ADD; else a placeholder, never read)
    M, N, K, E,
    s_xg, s_xe, s_xm, s_xk, s_ws, s_we, s_wk, s_wn, s_og, s_oe, s_om, s_on, s_cg, s_cm, s_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, REDUCE_E: tl.constexpr, HAS_ADD: tl.constexpr,
):  # fmt: skip
    # One [BLOCK_M, BLOCK_N] tile of out[g] (of matrix e, or summed over e), over every
    # SPLIT_K-th BLOCK_K chunk of K (SPLIT_K > 1: added atomically into a zeroed out).
    tile = tl.program_id(0)
    g = tl.program_id(1)
    part = tl.program_id(2) % SPLIT_K
    e_out = tl.program_id(2) // SPLIT_K
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    offs_m = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m = offs_m < M
    in_n = offs_n < N
    slot = tl.load(slot_ptr + g).to(tl.int64)
    k_end = tl.where(slot >= 0, K, 0)  # a padding group reads no weights: its product is 0
    if REDUCE_E:
        e_lo = 0
        e_hi = E
    else:
        e_lo = e_out
        e_hi = e_out + 1
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for e in range(e_lo, e_hi):
        x_base = x_ptr + g.to(tl.int64) * s_xg + e * s_xe
        w_base = w_ptr + tl.maximum(slot, 0) * s_ws + e * s_we
        for k0 in range(part * BLOCK_K, k_end, SPLIT_K * BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            in_k = offs_k < K
            xt = _load_tile(x_base, offs_m, offs_k, s_xm, s_xk, in_m[:, None] & in_k[None, :])
            wt = _load_tile(w_base, offs_k, offs_n, s_wk, s_wn, in_k[:, None] & in_n[None, :])
            acc = tl.dot(xt, wt, acc, input_precision=INPUT_PRECISION)
    mask = in_m[:, None] & in_n[None, :]
    if HAS_ADD:
        if part == 0:
            acc += _load_tile(add_ptr + g.to(tl.int64) * s_cg, offs_m, offs_n, s_cm, s_cn, mask)
    o_ptrs = _tile(out_ptr + g.to(tl.int64) * s_og + e_out * s_oe, offs_m, offs_n, s_om, s_on)
    if SPLIT_K == 1:
        tl.store(o_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(o_ptrs, acc, mask=mask)


def _candidate_dot_kernel(
    w_ptr,  # [V, H] fp16/bf16/fp32, unit stride along H
    f_ptr,  # [R, H] fp32, unit stride along H
    rows_ptr,  # [N] int
    tokens_ptr,  # [N] int
    out_ptr,  # [N] fp32
    N, H,
    s_wv, s_fr, s_rows, s_tokens, s_out,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    # BLOCK_P pairs: their head rows W[token] and prediction rows f[row] streamed along H in
    # BLOCK_H chunks; products summed in a [BLOCK_P, BLOCK_H] fp32 accumulator, reduced once.
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    in_p = offs_p < N
    tok = tl.load(tokens_ptr + offs_p * s_tokens, mask=in_p, other=0).to(tl.int64)
    row = tl.load(rows_ptr + offs_p * s_rows, mask=in_p, other=0).to(tl.int64)
    w_rows = w_ptr + tok[:, None] * s_wv
    f_rows = f_ptr + row[:, None] * s_fr
    acc = tl.full((BLOCK_P, BLOCK_H), 0.0, tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = in_p[:, None] & (offs_h < H)[None, :]
        w = tl.load(w_rows + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(f_rows + offs_h[None, :], mask=mask, other=0.0)
        acc += w * x
    # tl.sum is a @triton.jit helper (see the module's note); tl.reduce is a builtin, and the
    # interpreter runs it with _sum_combine as np.sum.
    dots = tl.reduce(acc, 1, tl.standard._sum_combine)
    tl.store(out_ptr + offs_p * s_out, dots, mask=in_p)


def _loss_dy_kernel(
    h_ptr,  # [G, M, H] fp32
    t_ptr,  # [G, M, H] fp32
    mask_ptr,  # [G, M] bool as uint8
    parts_ptr,  # [G, L] fp32: the loss's share of each program
    dy_ptr,  # [G, M, H] fp32
    M, H,
    CHUNK,  # hidden columns per program
    s_hg, s_hm, s_hh, s_tg, s_tm, s_th, s_mg, s_mm, s_dg, s_dm, s_dh, s_pg, s_pl,
    per_row,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    # Columns [l * CHUNK, (l + 1) * CHUNK) of one group: its row count (the denominator),
    # then diff = h - t on its rows, squared into the loss part and scaled into dy.
    part = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    cnt = tl.full((BLOCK_M,), 0.0, tl.float32)
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        live = tl.load(mask_ptr + g * s_mg + offs_m * s_mm, mask=offs_m < M, other=0)
        cnt += (live != 0).to(tl.float32)
    denom = tl.maximum(tl.reduce(cnt, 0, tl.standard._sum_combine) * per_row, 1.0)
    coef = 2.0 / denom
    h_lo = part * CHUNK
    h_hi = tl.minimum(h_lo + CHUNK, H)
    acc = tl.full((BLOCK_M, BLOCK_H), 0.0, tl.float32)
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < M
        live = tl.load(mask_ptr + g * s_mg + offs_m * s_mm, mask=in_m, other=0) != 0
        for h0 in range(h_lo, h_hi, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            inside = in_m[:, None] & (offs_h < h_hi)[None, :]
            use = inside & live[:, None]
            hv = _load_tile(h_ptr + g * s_hg, offs_m, offs_h, s_hm, s_hh, use)
            tv = _load_tile(t_ptr + g * s_tg, offs_m, offs_h, s_tm, s_th, use)
            diff = tl.where(use, hv - tv, 0.0)
            acc += diff * diff
            d_ptrs = _tile(dy_ptr + g * s_dg, offs_m, offs_h, s_dm, s_dh)
            tl.store(d_ptrs, diff * coef, mask=inside)
    total = tl.reduce(tl.reduce(acc, 1, tl.standard._sum_combine), 0, tl.standard._sum_combine)
    tl.store(parts_ptr + g * s_pg + part * s_pl, total / denom)


def _block_backward_kernel(
    dp_ptr,  # [G, M, I] fp32, and a, u, s, p the same shape
    a_ptr, u_ptr, s_ptr, p_ptr,
    hin_ptr,  # [G, M, H] fp32, and dy
    dy_ptr,
    du_ptr,  # [G, M, I] fp32 out, and da
    da_ptr,
    parts_ptr,  # [G, T] fp32 out
    M, INTER, HID,
    SPLIT_H,  # programs per row-tile pair, each over a share of H
    s_dpg, s_dpm, s_dpi, s_ag, s_am, s_ai, s_ug, s_um, s_ui, s_sg, s_sm, s_si, s_pg, s_pm, s_pi,
    s_hg, s_hm, s_hh, s_yg, s_ym, s_yh, s_dug, s_dum, s_dui, s_dag, s_dam, s_dai, s_tg, s_tt,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    # One (row tile ti, row tile tj) pair of one group and one share of H: that tile of the
    # Gram matrices (du du^T + da da^T, p p^T over I; h_in h_in^T, dy dy^T over the share)
    # reduced to a norm part. du, da are stored by the diagonal pair's first share.
    col = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M
    if col >= tiles_m * tiles_m * SPLIT_H:
        tl.store(parts_ptr + g * s_tg + col * s_tt, 0.0)
        return
    tile = col // SPLIT_H
    share = col % SPLIT_H
    ti = tile // tiles_m
    tj = tile % tiles_m
    h_chunk = (HID + SPLIT_H - 1) // SPLIT_H
    h_lo = share * h_chunk
    h_hi = tl.minimum(h_lo + h_chunk, HID)
    ri = ti * BLOCK_M + tl.arange(0, BLOCK_M)
    rj = tj * BLOCK_M + tl.arange(0, BLOCK_M)
    in_i = ri < M
    in_j = rj < M
    acc_g = tl.full((BLOCK_M, BLOCK_M), 0.0, tl.float32)
    acc_p = tl.full((BLOCK_M, BLOCK_M), 0.0, tl.float32)
    p_g, h_g, y_g = p_ptr + g * s_pg, hin_ptr + g * s_hg, dy_ptr + g * s_yg
    for c0 in range(0, INTER, BLOCK_I):
        offs_c = c0 + tl.arange(0, BLOCK_I)
        in_c = offs_c < INTER
        mi = in_i[:, None] & in_c[None, :]
        mj = in_j[:, None] & in_c[None, :]
        # Rows of tile i.
        dp = _load_tile(dp_ptr + g * s_dpg, ri, offs_c, s_dpm, s_dpi, mi)
        av = _load_tile(a_ptr + g * s_ag, ri, offs_c, s_am, s_ai, mi)
        uv = _load_tile(u_ptr + g * s_ug, ri, offs_c, s_um, s_ui, mi)
        sv = _load_tile(s_ptr + g * s_sg, ri, offs_c, s_sm, s_si, mi)
        du_i, da_i = _swiglu_grads(dp, av, uv, sv)
        if (ti == tj) & (share == 0):
            tl.store(_tile(du_ptr + g * s_dug, ri, offs_c, s_dum, s_dui), du_i, mask=mi)
            tl.store(_tile(da_ptr + g * s_dag, ri, offs_c, s_dam, s_dai), da_i, mask=mi)
        # Rows of tile j (the same rows on the diagonal: read again from cache).
        dp = _load_tile(dp_ptr + g * s_dpg, rj, offs_c, s_dpm, s_dpi, mj)
        av = _load_tile(a_ptr + g * s_ag, rj, offs_c, s_am, s_ai, mj)
        uv = _load_tile(u_ptr + g * s_ug, rj, offs_c, s_um, s_ui, mj)
        sv = _load_tile(s_ptr + g * s_sg, rj, offs_c, s_sm, s_si, mj)
        du_j, da_j = _swiglu_grads(dp, av, uv, sv)
        acc_g = tl.dot(du_i, tl.trans(du_j), acc_g, input_precision=INPUT_PRECISION)
        acc_g = tl.dot(da_i, tl.trans(da_j), acc_g, input_precision=INPUT_PRECISION)
        acc_p = _gram(p_g, ri, rj, offs_c, s_pm, s_pi, mi, mj, acc_p, INPUT_PRECISION)
    acc_h = tl.full((BLOCK_M, BLOCK_M), 0.0, tl.float32)
    acc_y = tl.full((BLOCK_M, BLOCK_M), 0.0, tl.float32)
    for c0 in range(h_lo, h_hi, BLOCK_H):
        offs_c = c0 + tl.arange(0, BLOCK_H)
        mi = in_i[:, None] & (offs_c < h_hi)[None, :]
        mj = in_j[:, None] & (offs_c < h_hi)[None, :]
        acc_h = _gram(h_g, ri, rj, offs_c, s_hm, s_hh, mi, mj, acc_h, INPUT_PRECISION)
        acc_y = _gram(y_g, ri, rj, offs_c, s_ym, s_yh, mi, mj, acc_y, INPUT_PRECISION)
    prod = acc_y * acc_p + acc_g * acc_h
    part = tl.reduce(tl.reduce(prod, 1, tl.standard._sum_combine), 0, tl.standard._sum_combine)
    tl.store(parts_ptr + g * s_tg + col * s_tt, part)


def _update_tail_kernel(
    lparts_ptr,  # [G, L] fp32: loss parts
    parts_ptr,  # [G, K] fp32: squared-norm parts
    slot_ptr,  # [G] int
    mask_ptr,  # [G, M] bool as uint8
    step_ptr,  # [S] fp32 (in/out)
    applied_ptr,  # [S] int64 (in/out; unused without HAS_APPLIED)
    ok_ptr,  # [G] bool as uint8 (out)
    scale_ptr,  # [G] fp32 (out)
    norm_ptr,  # [G] fp32 (out)
    loss_ptr,  # [G] fp32 (out)
    G, L, K, M,
    s_lg, s_ll, s_pg, s_pk, s_slot, s_mg, s_mm, s_step, s_app, s_ok, s_scale, s_norm, s_loss,
    grad_clip, clip_eps,
    BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, HAS_CLIP: tl.constexpr,
    HAS_APPLIED: tl.constexpr,
):  # fmt: skip
    # BLOCK_G groups: norm, ok, clip scale, and their slots' step (and applied) counts.
    offs_g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    in_g = offs_g < G
    sq = tl.full((BLOCK_G,), 0.0, tl.float32)
    for k in range(0, K):
        sq += tl.load(parts_ptr + offs_g * s_pg + k * s_pk, mask=in_g, other=0.0)
    norm = tl.sqrt_rn(sq)
    cnt = tl.full((BLOCK_G, BLOCK_M), 0, tl.int32)
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        live = tl.load(
            mask_ptr + offs_g[:, None] * s_mg + offs_m[None, :] * s_mm,
            mask=in_g[:, None] & (offs_m < M)[None, :],
            other=0,
        )
        cnt += (live != 0).to(tl.int32)
    rows = tl.reduce(cnt, 1, tl.standard._sum_combine)
    slot = tl.load(slot_ptr + offs_g * s_slot, mask=in_g, other=-1).to(tl.int64)
    loss = tl.full((BLOCK_G,), 0.0, tl.float32)
    for j in range(0, L):
        loss += tl.load(lparts_ptr + offs_g * s_lg + j * s_ll, mask=in_g, other=0.0)
    tl.store(loss_ptr + offs_g * s_loss, loss, mask=in_g)
    valid = (slot >= 0) & (rows > 0)
    # Finite iff x * 0 == 0 (inf * 0 and NaN * 0 are NaN).
    ok = valid & (loss * 0.0 + norm * 0.0 == 0.0)
    if HAS_CLIP:
        scale = tl.div_rn(grad_clip, norm + clip_eps)
        scale = tl.where(scale > 1.0, 1.0, scale)
    else:
        scale = tl.full((BLOCK_G,), 1.0, tl.float32)
    tl.store(ok_ptr + offs_g * s_ok, ok.to(tl.uint8), mask=in_g)
    tl.store(scale_ptr + offs_g * s_scale, scale, mask=in_g)
    tl.store(norm_ptr + offs_g * s_norm, norm, mask=in_g)
    # A slot is in at most one group: no two lanes touch the same count.
    has = in_g & (slot >= 0)
    at = tl.maximum(slot, 0)
    step = tl.load(step_ptr + at * s_step, mask=has, other=0.0)
    tl.store(step_ptr + at * s_step, step + ok.to(tl.float32), mask=has)
    if HAS_APPLIED:
        done = tl.load(applied_ptr + at * s_app, mask=has, other=0)
        tl.store(applied_ptr + at * s_app, done + valid.to(tl.int64), mask=has)


def _silu_mul_kernel(
    a_ptr,  # [G, M, I] fp32, and u, s (out), p (out)
    u_ptr, s_ptr, p_ptr,
    M, INTER,
    s_ag, s_am, s_ai, s_ug, s_um, s_ui, s_sg, s_sm, s_si, s_pg, s_pm, s_pi,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    # One [BLOCK_M, BLOCK_I] tile of one group: s = silu(a) = a / (1 + exp(-a)), p = s * u.
    g = tl.program_id(1).to(tl.int64)
    tiles_i = (INTER + BLOCK_I - 1) // BLOCK_I
    offs_m = (tl.program_id(0) // tiles_i) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_i = (tl.program_id(0) % tiles_i) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (offs_m < M)[:, None] & (offs_i < INTER)[None, :]
    a = _load_tile(a_ptr + g * s_ag, offs_m, offs_i, s_am, s_ai, mask)
    u = _load_tile(u_ptr + g * s_ug, offs_m, offs_i, s_um, s_ui, mask)
    s = tl.div_rn(a, 1.0 + tl.exp(-a))
    tl.store(_tile(s_ptr + g * s_sg, offs_m, offs_i, s_sm, s_si), s, mask=mask)
    tl.store(_tile(p_ptr + g * s_pg, offs_m, offs_i, s_pm, s_pi), s * u, mask=mask)


def _stale_max_kernel(
    sub_ptr,  # [G] int64
    applied_ptr,  # [S] int64
    slot_ptr,  # [G] int
    stale_ptr,  # [1] int64 (in/out)
    G,
    s_sub, s_app, s_slot,
    BLOCK_G: tl.constexpr,
):  # fmt: skip
    # One program: the largest lag submitted - applied over the groups with a slot.
    old = tl.load(stale_ptr)
    acc = tl.full((BLOCK_G,), 0, tl.int64) + old
    for g0 in range(0, G, BLOCK_G):
        offs = g0 + tl.arange(0, BLOCK_G)
        slot = tl.load(slot_ptr + offs * s_slot, mask=offs < G, other=-1).to(tl.int64)
        live = (offs < G) & (slot >= 0)
        sub = tl.load(sub_ptr + offs * s_sub, mask=live, other=0)
        done = tl.load(applied_ptr + tl.maximum(slot, 0) * s_app, mask=live, other=0)
        acc = tl.maximum(acc, tl.where(live, sub - done, old))
    tl.store(stale_ptr, tl.reduce(acc, 0, tl.standard._elementwise_max))


def _in_scope(fn: Any, scope: dict[str, Any]) -> Any:
    # fn's code with scope as its globals (Triton resolves a kernel's callees there).
    out = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__annotations__ = dict(fn.__annotations__)  # tl.constexpr marks
    out.__qualname__ = fn.__qualname__
    return out


def jit_kernels() -> SimpleNamespace:
    """Freshly decorated kernels (interpreted when ``TRITON_INTERPRET=1`` is set now), with
    their device helpers decorated afresh in a scope of their own."""
    scope = dict(globals())
    for name in _DEVICE_HELPERS:
        scope[name] = triton.jit(_in_scope(globals()[name].fn, scope))

    kernels = (k for k in globals() if k.startswith("_") and k.endswith("_kernel"))
    return SimpleNamespace(
        **{
            k[1:].removesuffix("_kernel"): triton.jit(_in_scope(globals()[k], scope))
            for k in kernels
        }
    )


@functools.cache
def _kernels() -> SimpleNamespace:
    return jit_kernels()


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
