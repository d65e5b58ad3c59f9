"""qkv_rope's epilogue: rope_kv's job (nq/kernels/rope_kv.py) done by the qkv GEMV itself, so
that q and the new K, V slot come out of one kernel.

The qkv_rope kernel (gemv.py) reads qkv's weights as they are (same `prepare`, same default
ks, so one upload serves both): a thread owns one RoPE pair, rows r0 = h*D + i and r0 + D/2
of head h (rows=2; `weight_row` maps the pair to its rows), so lane 0 holds both halves of
the rotation.  Its
fp32 y = acc*rstd + bias is exactly what qkv writes, and the rotation is rope_kv's arithmetic
(fp32 angle pos*inv_freq[i], precise libdevice cosf/sinf: not fastmath, whose Payne-Hanek
path for |angle| > 1e5 keeps 28 bytes of local memory, as rope_kv's does; the same fmas
rope_kv's expressions compile to), so with qkv's threads, ks and span the outputs are
bit-identical to qkv followed by rope_kv.  Everything the epilogue needs but the dot products
(biases, position, page, cos and sin) is read and computed before griddepcontrol.wait
(`rope_setup`), so that after the wait the kernel's critical path is the GEMV and a few fmas
and stores.
"""
from __future__ import annotations

import math

from numba import cuda, float32
from numba.cuda.types import float16

from nq.kernels.common import dev
from nq.paged import PAGE, STATE_POS
from nq.ptx import cvt_f32_f16, ld_global_nc_u16


def put_rope_body(n_out: int, HQ: int, HKV: int, D: int, weight_row):
    """The epilogue's device-function bodies for a qkv_rope kernel of N = n_out rows and heads
    (HQ, HKV, D); weight_row is the kernel's (a RoPE pair's weight rows): (put_rope,
    rope_setup), for the kernel to wrap with `dev`; all inlined with these as constants."""
    HALF = D // 2

    def put_rope(kv, q_out, row0, v0, v1, pre):
        """rope_kv's job for RoPE pair row0 // 2, from the fp32 dot products v0, v1 of its rows
        (times rstd) and `pre`, rope_setup's (read before the wait).  Its inputs y0, y1 are
        qkv's outputs bit for bit; its arithmetic is rope_kv's as compiled: rope_kv writes
        x1*c - x2*s and x2*c + x1*s, which the compilers contract (LLVM, then ptxas: sm_90
        SASS, CUDA 13) into fma(x1, c, -(x2*s)) and fma(x1, s, x2*c).  Left to contraction
        here the second came out fma(y1, c, y0*s) (a different rounding), so both are spelled
        out: no mul-add pair is left to contract."""
        b0, b1, cos_a, sin_a, pos, page = pre
        if row0 < n_out:
            y0 = float32(v0 + b0)   # = put_qkv's out[r0]
            y1 = float32(v1 + b1)
            p = row0 >> 1
            b = p // HALF   # head: [q heads | k heads | v heads]
            i = p % HALF
            slot = pos % PAGE
            if b < HQ + HKV:
                z0 = cuda.fma(y0, cos_a, -(y1 * sin_a))
                z1 = cuda.fma(y0, sin_a, y1 * cos_a)
                if b < HQ:
                    q_out[b * D + i] = z0
                    q_out[b * D + i + HALF] = z1
                else:
                    kv[page, b - HQ, 0, slot, i] = float16(z0)
                    kv[page, b - HQ, 0, slot, i + HALF] = float16(z1)
            else:
                kv[page, b - HQ - HKV, 1, slot, i] = float16(y0)
                kv[page, b - HQ - HKV, 1, slot, i + HALF] = float16(y1)

    def cos_sin(pos, fr):
        """The angle's cos and sin: rope_kv's fp32 pos * inv_freq[i], precise cosf / sinf."""
        ang = float32(pos) * fr
        return math.cos(ang), math.sin(ang)

    def rope_setup(bias, state, inv_freq, table, row0):
        """Everything put_rope needs besides the dot products, for RoPE pair row0 // 2 (row0 >=
        n_out: none), all of it read before griddepcontrol.wait: the pair's biases (weights;
        258 KB of them do not survive a step in L2), the position and its page (state and
        the block table are written only by the previous replay's argmax and by host copies
        between replays -- attn_split's EARLY argument, decode.py), and the angle's cos and
        sin.  Returns put_rope's `pre`, (b0, b1, cos, sin, pos, page)."""
        b0 = float32(0.0)
        b1 = float32(0.0)
        cos_a = float32(1.0)
        sin_a = float32(0.0)
        pos = state[STATE_POS]
        if row0 < n_out:
            b0, b1 = bias_pair(bias, row0)
            cos_a, sin_a = cos_sin(pos, inv_freq[(row0 >> 1) % HALF])
        return b0, b1, cos_a, sin_a, pos, table[pos // PAGE]

    def bias_pair(bias, row0):
        """The biases of RoPE pair row0 // 2's rows (row0 < n_out), fp32."""
        r0 = weight_row(row0, 0)
        return (cvt_f32_f16(ld_global_nc_u16(bias, r0)),
                cvt_f32_f16(ld_global_nc_u16(bias, r0 + HALF)))

    cos_sin, bias_pair = dev(cos_sin), dev(bias_pair)   # rope_setup's calls see these
    return put_rope, rope_setup
