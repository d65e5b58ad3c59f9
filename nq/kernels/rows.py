"""The small kernels of prefill, over a chunk of M token rows: embed_rows, rmsnorm_rows and
rope_kv_rows.

Decode's versions (embed.py, rope_kv.py) take one token whose id and position come from the
device `state`, so one captured graph serves every step.  Prefill runs a chunk of M prompt
tokens at positions start..start+M-1 through each layer at once (nq/kernels/attention/
prefill.py's module doc has the layer), so these take M and start as launch arguments: a
launcher is built once over buffers of M_max rows and launches any 1 <= m <= M_max (the grid
follows m; nothing is allocated per launch).  The arithmetic is decode's, so prefill and
decode agree on what lands in the cache:

    embed_rows    ids int32 (M,) -> x fp32 (M, H): x[i] = emb[ids[i]]
    rmsnorm_rows  x fp32 (M, H), w fp16 (H,) -> h fp16 (M, H): rmsnorm.py's kernel (fp32 sum
                  of squares times fp32 1/H, + eps, 1/sqrt, x*inv*w) with an m-row grid
    rope_kv_rows  qkv fp32 (M, qkv_size) = [q | k | v] per row -> q_out fp32 (M, Hq, D)
                  rotated, and k rotated / v as fp16 into the paged cache at positions
                  start + i: rope_kv's arithmetic bit for bit (below)

rope_kv_rows keeps rope_kv's fp32 angle pos*inv_freq[i] and precise cosf/sinf (no fastmath:
see rope_kv.py), and writes the rotation as the fmas that rope_kv's `x1*c - x2*s` and
`x2*c + x1*s` compile to on sm_90 (fma(x1, c, -(x2*s)) and fma(x1, s, x2*c), as the qkv_rope
GEMV spells them out, nq/kernels/int4/gemv.py), so no mul-add pair is left for the compilers
to contract differently here.  Its q_out is fp32 like rope_kv's: the attention kernel rounds
q * log2(e)/sqrt(D) to fp16 itself, once.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda  # a module global: the simulator swaps it for its fake module

from nq.kernels.build import compile_kernel, kernel_name
from nq.kernels.fastlaunch import FastLaunch
from nq.paged import PAGE, check_paged_args

THREADS = 256    # embed_rows: a row of H fp32 in coalesced 1 KiB blocks
# rope_kv_rows: one block a token (it was a block of D/2 threads a (head, token): 36 x M tiny
# blocks, each paying precise cosf/sinf for its pairs -- 90 us a 2048-token chunk of the 7B on
# the H200 for ~70 MB moved, 2026-12-01); D/2 must divide it
ROPE_THREADS = 256


# ---- NumPy references ----------------------------------------------------------------------------

def embed_rows_reference(emb, ids) -> np.ndarray:
    """emb (vocab, H) fp16, ids (M,) -> x (M, H) fp32."""
    return np.asarray(emb)[np.asarray(ids, np.int64)].astype(np.float32)


def rmsnorm_rows_reference(x, w, eps) -> np.ndarray:
    """x (M, H) fp32, w (H,) fp16 -> h (M, H) fp16 (nq.ref.rms_norm, rounded)."""
    from nq.ref import rms_norm
    return rms_norm(np.asarray(x, np.float32), w, eps).astype(np.float16)


def rope_kv_rows_reference(cfg, qkv, start: int):
    """qkv (M, qkv_size) fp32 -> (q (M, Hq, D) fp32, k (M, Hkv, D) fp16, v (M, Hkv, D) fp16)
    for positions start..start+M-1: rope_kv_reference row by row."""
    from nq.kernels.rope_kv import rope_kv_reference
    rows = [rope_kv_reference(cfg, r, start + i) for i, r in enumerate(np.asarray(qkv))]
    return tuple(np.stack([r[j] for r in rows]) for j in range(3))


# ---- kernels -------------------------------------------------------------------------------------

# Each factory returns (body, signature, name) for _jit; the bodies compile offline for the
# PTX checks of tests/kernels/test_rows_cpu.py.

@functools.cache
def _embed_rows(hidden: int):
    from numba.cuda.types import float32

    from nq.ptx import griddepcontrol_launch_dependents, griddepcontrol_wait

    H = hidden

    def embed_rows(emb, ids, x):
        # emb (vocab, H) f16; ids (M_max,) int32; x (M_max, H) f32; grid (ceil(H/256), m)
        griddepcontrol_wait()   # PDL (nq/ptx/griddep.py): ids may come from upstream
        griddepcontrol_launch_dependents()
        row = cuda.blockIdx.y
        i = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        if i < H:
            x[row, i] = float32(emb[ids[row], i])

    return (embed_rows, "void(float16[:, ::1], int32[::1], float32[:, ::1])",
            kernel_name("embed_rows", h=H))


@functools.cache
def _rope_kv_rows(num_heads: int, num_kv: int, head_dim: int):
    import math

    from numba.cuda.types import float16, float32

    from nq.ptx import griddepcontrol_launch_dependents, griddepcontrol_wait

    HQ, HKV, D, HALF = num_heads, num_kv, head_dim, head_dim // 2
    if ROPE_THREADS % HALF:
        raise ValueError(f"rope_kv_rows: head_dim {D}: D/2 must divide {ROPE_THREADS}")
    NHG = ROPE_THREADS // HALF      # head slots a block works on at once
    NB = HQ + 2 * HKV               # q heads, then k heads, then v heads

    def rope_kv_rows(qkv, inv_freq, table, kv, q_out, start, m):
        # qkv (M_max, qkv_size) f32; inv_freq (D/2,) f32; table (max_pages,) int32
        # kv (n_pages, HKV, 2, 16, D) f16; q_out (M_max, HQ, D) f32; grid (m,), block
        # ROPE_THREADS: thread (hg, i) rotates pair (i, i + D/2) of heads hg, hg + NHG, ...
        # of the token at start + row, so its cos/sin are computed once for NB / NHG heads
        griddepcontrol_wait()   # PDL: qkv comes from the GEMM before
        griddepcontrol_launch_dependents()
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        i = tid % HALF
        pos = start + row
        page = table[pos // PAGE]
        slot = pos % PAGE
        ang = float32(pos) * inv_freq[i]
        c = math.cos(ang)
        s = math.sin(ang)
        for b in range(tid // HALF, NB, NHG):
            if b < HQ + HKV:
                x1 = qkv[row, b * D + i]
                x2 = qkv[row, b * D + i + HALF]
                y1 = cuda.fma(x1, c, -(x2 * s))   # rope_kv's x1*c - x2*s as compiled (module doc)
                y2 = cuda.fma(x1, s, x2 * c)      # rope_kv's x2*c + x1*s as compiled
                if b < HQ:
                    q_out[row, b, i] = y1
                    q_out[row, b, i + HALF] = y2
                else:
                    h = b - HQ
                    kv[page, h, 0, slot, i] = float16(y1)
                    kv[page, h, 0, slot, i + HALF] = float16(y2)
            else:
                h = b - HQ - HKV
                base = (HQ + HKV + h) * D
                kv[page, h, 1, slot, i] = float16(qkv[row, base + i])
                kv[page, h, 1, slot, i + HALF] = float16(qkv[row, base + i + HALF])

    sig = ("void(float32[:, ::1], float32[::1], int32[::1], float16[:, :, :, :, ::1], "
           "float32[:, :, ::1], int32, int32)")
    return rope_kv_rows, sig, kernel_name("rope_kv_rows", h=HQ, kv=HKV, d=D)


@functools.cache
def _jit(factory, *key):
    """factory(*key) -> (body, signature, name), compiled once.  No fastmath for any of them:
    rope_kv_rows needs precise cosf/sinf (rope_kv.py's module doc), the others do no math."""
    return compile_kernel(*factory(*key))


# ---- launchers -----------------------------------------------------------------------------------

def _rows(who, m, m_max):
    m = int(m)
    if not 1 <= m <= m_max:
        raise ValueError(f"{who}: m={m}, want 1 <= m <= {m_max} (the buffers' rows)")
    return m


def embed_rows_launcher(emb, ids, x):
    """Check once; return `launch(m, stream=0)`: x[:m] = emb[ids[:m]].  emb (vocab, H) fp16,
    ids (M_max,) int32 (each < vocab: not checked on device), x (M_max, H) fp32."""
    from nq.kernels.common import need
    m_max, hid = ids.shape[0], emb.shape[1]
    need(emb, "embed_rows: emb", np.float16, (emb.shape[0], hid), align=4)
    need(ids, "embed_rows: ids", np.int32, (m_max,), align=4)
    need(x, "embed_rows: x", np.float32, (m_max, hid), align=4)
    kern = _jit(_embed_rows, hid)
    blocks = -(-hid // THREADS)

    fast = FastLaunch(kern, emb, ids, x)

    def launch(m, stream=0):
        fast((blocks, _rows("embed_rows", m, m_max)), THREADS, stream, 0)

    return launch


def rmsnorm_rows_launcher(x, w, h, eps: float):
    """Check once; return `launch(m, stream=0)`: h[:m] = rmsnorm(x[:m]) * w, rmsnorm.py's
    kernel (one block a row) over an m-row grid.  x (M_max, H) fp32, w (H,) fp16, h (M_max, H)
    fp16, eps from the config (cfg.rms_norm_eps)."""
    from nq.kernels import rmsnorm
    from nq.kernels.common import need
    m_max, hid = x.shape
    need(x, "rmsnorm_rows: x", np.float32, (m_max, hid), align=4)
    need(w, "rmsnorm_rows: w", np.float16, (hid,), align=2)
    need(h, "rmsnorm_rows: h", np.float16, (m_max, hid), align=2)
    kern = rmsnorm.rmsnorm_kernel(hid, float(eps), False)

    fast = FastLaunch(kern, x, x, w, h)

    def launch(m, stream=0):
        fast(_rows("rmsnorm_rows", m, m_max), rmsnorm.THREADS, stream, 0)

    return launch


def rope_kv_rows_launcher(cfg, qkv, inv_freq, table, kv_layer, q_out):
    """Check once; return `launch(m, start, stream=0)`: rows i < m of qkv are the tokens at
    positions start + i; q_out[:m] gets their rotated q, the cache their k and v.  qkv
    (M_max, qkv_size) fp32; inv_freq from rope_kv.rope_inv_freq(D, theta), uploaded once;
    q_out (M_max, num_heads, head_dim) fp32; table must map positions 0..start+m-1."""
    from nq.kernels.common import need
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    m_max = qkv.shape[0]
    need(qkv, "rope_kv_rows: qkv", np.float32, (m_max, cfg.qkv_size), align=4)
    need(inv_freq, "rope_kv_rows: inv_freq", np.float32, (d // 2,), align=4)
    need(q_out, "rope_kv_rows: q_out", np.float32, (m_max, hq, d), align=4)
    check_paged_args("rope_kv_rows", cfg, kv_layer, table, table)  # no state: start is an arg
    kern = _jit(_rope_kv_rows, hq, hkv, d)
    max_pos = table.shape[0] * PAGE

    fast = FastLaunch(kern, qkv, inv_freq, table, kv_layer, q_out, 0, 0)

    def launch(m, start, stream=0):
        m, start = _rows("rope_kv_rows", m, m_max), int(start)
        if not 0 <= start <= max_pos - m:
            raise ValueError(f"rope_kv_rows: positions {start}..{start + m - 1} are past the "
                             f"block table's {max_pos}")
        fast(m, ROPE_THREADS, stream, 0, start, m)

    return launch
