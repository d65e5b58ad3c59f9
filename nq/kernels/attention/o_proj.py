"""attn_o_proj: the attention's merge (attn_combine's job) and o_proj in one kernel.

Why: at 512 tokens a layer's attn_combine and o_proj take ~3 + ~3.6 us of the step's critical
path for 0.23 MB of partials and 6.4 MB of weights (docs/PERF.md 0.12, 0.16, step_timeline):
two kernel boundaries and two prologues in a row, with nothing beside them.  o_proj's K is the
heads' outputs side by side, and a 128-wide K group of the tensor-core layout is exactly one
head (two at head_dim 64), so o_proj splits along K by head with no extra work: block (group
gk, row chunk rc) merges only its own head's splits (8 KB of partials at 512 tokens, 17 KB at
32K, from L2) and multiplies them by its rows' single group of weights, which it loaded before
griddepcontrol.wait.  The heads' contributions to a row then meet in `part_o` (GROUPS, N) fp32,
and the last block of a row chunk to arrive (an acq_rel counter a chunk, reset by that block)
adds them in head order to x -- fixed order, so a replay equals an eager launch bit for bit,
and one writer an element of x, as every GEMV here.

Grid (GROUPS * chunks,), 32 * WARPS threads (256): WARPS warps, each TPW tiles of 16 rows, so a
chunk is 16 * WARPS * TPW rows.  Block b takes group b % GROUPS of chunk b // GROUPS.

  before the wait  the split plan from `state` (nothing in the step writes it) and each warp's
                   TPW tiles' words and scales of group gk (gemv_mma_weights.load_group);
                   griddepcontrol.launch_dependents right after the wait, as o_proj's.
  merge            attn_combine's, for the block's 128 dims: thread (split group G = tid // 32,
                   q = tid % 32) merges dims 4q..4q+3 of splits G, G + 8, ... (all loaded at
                   once, rows past the plan read row 0 and weigh 0), the eight groups meet in
                   shared memory (each rescaled by exp2(m_group - max m)); warp 0 writes o as
                   fp16 into the B-fragment order gemv_mma's `stage` gives a group (so o is
                   rounded where attn_combine rounds it).
  o_proj           each warp: the dequant-mma of its tiles' group (gemv_mma_weights.group_dot),
                   rows g and g + 8 times their scales, stored by lanes t = 0 to part_o[gk].
  fold             __syncthreads, thread 0 adds 1 to the chunk's counter (atom.add.acq_rel.gpu:
                   its release covers the block's stores, cumulatively), __syncthreads; the block that brings it to GROUPS reads the chunk's
                   GROUPS partial rows (ld.global.cg: L2, coherent), sums them in head order,
                   adds the sum to x and puts the counter back to 0.

The acc form (`acc`, the step's attn.fuse_o=2) has no fold: each block adds its rows' shares
to xacc as fixed-point int64 (units of 2^-32 of x, `red.relaxed.gpu.global.add.u64`: integer
adds commute, so any order leaves the same bits), gate_up reads x + xacc * 2^-32 and down
folds xacc into x and zeroes it (gemv_mma.py "xacc").  It takes the counter's round trip, the
shares' loads and x's update off the critical path, for two loads beside x's in gate_up and
down.

The split kernel ahead of it may trigger its dependents at its start (decode_launcher's
`trigger`), so that these blocks are resident and their weights in registers before the
partials exist.  Measured: docs/PERF.md 0.23.

Reference: ref_o_proj(merge(partials), W, x) (tests/kernels/attention/test_o_proj_cpu.py).
"""
from __future__ import annotations

import functools
import math

from numba import cuda  # a module global: the simulator swaps it for its fake module
from numba import float32, int64, uint32, uint64

from nq.config import GROUP_SIZE
from nq.kernels.attention.plan import NEG_BIG, plan_body
from nq.kernels.build import compile_kernel, kernel_name
from nq.kernels.common import dev
from nq.paged import STATE_POS

SPLIT_GROUPS = 8   # split groups a block's merge (256 threads: 32 four-dim threads a group)
VEC = 4            # dims a merging thread
WARPS = 8          # 256 threads: the merge's 8 x 32
MAX_TPW = 4        # tiles a warp (written out below)
HEAD_DIMS = (64, 128)   # a 128-wide K group holds whole heads
O_SIG = ("void(int32[::1], float32[::1], float32[::1], uint32[::1], float16[::1], "
         "float32[::1], float32[::1], uint32[::1])")
O_SIG_ACC = "void(int32[::1], float32[::1], float32[::1], uint32[::1], float16[::1], uint32[::1])"


def chunk_rows(tpw: int) -> int:
    """Rows a block's warps cover: WARPS warps x tpw tiles x 16."""
    return WARPS * tpw * 16


def n_chunks(n_out: int, tpw: int) -> int:
    return -(-n_out // chunk_rows(tpw))


def check_o_proj(n_out: int, k: int, head_dim: int, num_heads: int, tpw: int) -> None:
    """Refuse what the kernel cannot do, with what to use instead."""
    if k != num_heads * head_dim:
        raise ValueError(f"attn_o_proj: K={k} must be num_heads * head_dim ({num_heads} x "
                         f"{head_dim}): o_proj's input is the heads side by side")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"attn_o_proj: head_dim {head_dim} is not 64 or 128 (a 128-wide K "
                         f"group must hold whole heads); use attn_combine + o_proj")
    if n_out % 16 or k % GROUP_SIZE:
        raise ValueError(f"attn_o_proj: N={n_out} must be a multiple of 16 and K={k} of "
                         f"{GROUP_SIZE}")
    if not 1 <= tpw <= MAX_TPW:
        raise ValueError(f"attn_o_proj: tpw={tpw} (tiles a warp) must be 1..{MAX_TPW}")


@functools.cache
def o_proj_body(n_out: int, k: int, head_dim: int, num_heads: int, max_splits: int,
                min_pps: int, tpw: int, acc: bool = False, i8: bool = False):
    """The kernel body for one set of constants (o_proj_name spells them).  Legend: D head_dim,
    HQ query heads, MAXS the split plan's max_splits, `plan` the plan itself (plan.plan_body; the split kernel's), G
    split groups, R splits a thread may own, HPG heads a K group, TPW tiles a warp, TPB tiles a
    block (a chunk), CH rows a chunk.  acc: the heads' shares go into xacc as fixed-point int64
    (red.add, any order, the same bits) instead of part_o and the last block's fold; gate_up
    reads x + xacc and down folds it into x (gemv_mma.py "xacc"); the kernel is then
    O_SIG_ACC's.  i8: o (rounded to fp16 as ever) staged as gemv_mma's digits and multiplied
    on the int8 tensor cores (gemv_mma.py "i8")."""
    from nq.kernels.common import FULL, warp_max
    from nq.kernels.int4.dequant import pow2_scale_f32
    from nq.kernels.int4.gemv_mma_shape import shape_of
    from nq.kernels.int4.gemv_mma_stage import act_path
    from nq.kernels.int4.gemv_mma_weights import weight_path
    from nq.kernels.int4.tiling import MmaTiling
    from nq.ptx import (SIMULATOR, atom_add_acq_rel_gpu_u32, cvta_to_shared_u32,
                        griddepcontrol_launch_dependents,
                        griddepcontrol_wait, ld_global_cg_v4_u32, ld_global_nc_v2_f32,
                        red_relaxed_gpu_add_u64,
                        ld_global_nc_v4_f32, mov_b32_f32_from_u32, pack_f16x2_from_f32,
                        unpack_f16x2_to_f32)

    check_o_proj(n_out, k, head_dim, num_heads, tpw)
    ACC = bool(acc)
    FIX = float32(2.0 ** 32)            # xacc's unit: 2^-32 of x (int4.dequant.FIXED_ONE)
    D, HQ, MAXS, TPW, G = head_dim, num_heads, max_splits, tpw, SPLIT_GROUPS
    plan = dev(plan_body(max_splits, min_pps))   # (n_pages, pps, n_splits) of a length
    GROUPS = k // GROUP_SIZE
    HPG = GROUP_SIZE // D
    N_TILES = n_out // 16
    TPB = WARPS * TPW
    CH = TPB * 16
    R = -(-MAXS // G)
    RED, GH = G * GROUP_SIZE, G * HPG   # the groups' sums; their (m, l) a head
    QUADS = CH // 4                     # the fold: row quads of a chunk,
    PARTS = 32 * WARPS // QUADS         # threads a quad (their sums in `red`: PARTS * CH = RED)
    HPP = -(-GROUPS // PARTS)           # heads a thread sums
    NEG = float32(NEG_BIG)
    ZERO = float32(0.0)
    # the weight side is o_proj's (its mma layout; warps and threads do not enter group_dot)
    I8 = bool(i8)
    shape = shape_of("o_proj", n_out, k, MmaTiling(warps=1, threads=32 * WARPS, i8=int(I8)), None)
    w = weight_path(shape)
    tile_bases, load_group, group_dot, group_dot_i8, b_lane = (
        w.tile_bases, w.load_group, w.group_dot, w.group_dot_i8, w.b_lane)
    ap = act_path(shape)
    put_digits, finite_or_nan = ap.put_digits, ap.finite_or_nan
    ACT_W = 96 if I8 else 64            # a group staged: 384 bytes of digits, or 128 fp16

    def stage_o_i8(act, fi_s, q, u0, u1, u2, u3):
        """Warp 0 with i8: o's dims 4q..4q+3 of the block's group, rounded to fp16 as
        attn_combine writes them, staged as digits after a power of two f that puts the
        group's absmax in [128, 256) (fi_s[0] = 1/f)."""
        o0, o1 = unpack_f16x2_to_f32(pack_f16x2_from_f32(u0, u1))
        o2, o3 = unpack_f16x2_to_f32(pack_f16x2_from_f32(u2, u3))
        f, fi = pow2_scale(wmax(max(max(abs(o0), abs(o1)), max(abs(o2), abs(o3)))))
        fi = finite_or_nan(fi, o0, o1, o2, o3)
        put_digits(act, 0, q, o0 * f, o1 * f, o2 * f, o3 * f)
        if q == 0:
            fi_s[0] = fi

    if I8:
        def tile_dot(c, abase, t4, fi):
            # rows g and g + 8 of one tile times the digits: lanes t = 0 and 1 together, their
            # sums joined, times 1/f
            v = group_dot_i8(c, c, abase, 0, t4)
            v0 = v[0] * fi
            v1 = v[1] * fi
            return (v0 + cuda.shfl_xor_sync(FULL, v0, 1), v1 + cuda.shfl_xor_sync(FULL, v1, 1))
    else:
        def tile_dot(c, abase, t4, fi):
            # rows g and g + 8 of one tile times the staged fp16 o (fi: 1, unused)
            return group_dot(c, c, abase, 0, t4)

    pow2_scale, wmax = dev(pow2_scale_f32), dev(warp_max)
    stage_o_i8, tile_dot = dev(stage_o_i8), dev(tile_dot)

    def warp_tile(rc, warp, j):
        # tile j of the warp in chunk rc, clamped into the matrix (a spare tile loads words
        # that exist and stores nothing)
        return min(rc * TPB + warp * TPW + j, N_TILES - 1)

    def store_rows(part_o, xa, gk, tile, g, t4, v):
        # lane t = 0 of a row pair: rows g and g + 8 of the tile, group gk's share (ACC: added
        # to xacc's int64 of the row, in units of 2^-32)
        if t4 == 0 and tile < N_TILES:
            r = tile * 16 + g
            if ACC:
                red_relaxed_gpu_add_u64(xa, 2 * r, uint64(int64(v[0] * FIX)))
                red_relaxed_gpu_add_u64(xa, 2 * r + 16, uint64(int64(v[1] * FIX)))
            else:
                part_o[gk * n_out + r] = v[0]
                part_o[gk * n_out + r + 8] = v[1]

    warp_tile, store_rows = dev(warp_tile), dev(store_rows)

    def body(state, part_acc, part_ml, qw, sc, x, part_o, counters, xa):
        # part_acc / part_ml flat (attn_combine's flat_partials); part_o (GROUPS * N,) f32;
        # counters (chunks,) u32, zero between launches; xa: xacc's words (ACC; else any
        # stand-in, as x, part_o and counters are with ACC)
        act = cuda.shared.array(ACT_W, uint32, alignment=None if SIMULATOR else 16)
        red = cuda.shared.array(RED, float32)
        gm = cuda.shared.array(GH, float32)
        gl = cuda.shared.array(GH, float32)
        if I8:
            fi_s = cuda.shared.array(1, float32)   # 1/f of the digits
        else:
            fi_s = gl                              # (a stand-in, never touched)
        last = cuda.shared.array(1, uint32)
        ms = cuda.local.array(R, float32)
        ls = cuda.local.array(R, float32)
        x0 = cuda.local.array(R, float32)
        x1 = cuda.local.array(R, float32)
        x2 = cuda.local.array(R, float32)
        x3 = cuda.local.array(R, float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t4 = lane & 3
        gk = cuda.blockIdx.x % GROUPS
        rc = cuda.blockIdx.x // GROUPS
        # weights first: they wait for nothing (TPW <= 4, written out: registers)
        b = tile_bases(warp_tile(rc, warp, 0), lane, g)
        c0 = load_group(qw, sc, b[0], b[1], gk)
        c1 = c0
        c2 = c0
        c3 = c0
        if TPW > 1:
            b = tile_bases(warp_tile(rc, warp, 1), lane, g)
            c1 = load_group(qw, sc, b[0], b[1], gk)
        if TPW > 2:
            b = tile_bases(warp_tile(rc, warp, 2), lane, g)
            c2 = load_group(qw, sc, b[0], b[1], gk)
        if TPW > 3:
            b = tile_bases(warp_tile(rc, warp, 3), lane, g)
            c3 = load_group(qw, sc, b[0], b[1], gk)
        length = state[STATE_POS] + 1
        n_pages, pps, n_splits = plan(length)
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        # the merge (attn_combine's, module doc): dims 4q.. of the group's 128, head hq.
        # Repeated here, not shared: as one device function it changed attn_combine's PTX
        # (NVVM ordered its loads otherwise), and that kernel's form is measured
        q = tid & 31
        sg = tid >> 5
        dk = gk * GROUP_SIZE + q * VEC          # the dim in K (heads side by side)
        hq = dk // D
        d = dk % D
        for i in range(R):
            split = sg + i * G
            row = split if split < n_splits else 0
            rh = row * HQ + hq
            x0[i], x1[i], x2[i], x3[i] = ld_global_nc_v4_f32(part_acc, rh * D + d)
            ms[i], ls[i] = ld_global_nc_v2_f32(part_ml, rh * 2)
        cuda.syncwarp()
        top = NEG
        for i in range(R):
            if sg + i * G >= n_splits:
                ms[i] = NEG
            top = max(top, ms[i])
        a0 = ZERO
        a1 = ZERO
        a2 = ZERO
        a3 = ZERO
        den = ZERO
        for i in range(R):
            wt = math.exp2(ms[i] - top)
            a0 += x0[i] * wt
            a1 += x1[i] * wt
            a2 += x2[i] * wt
            a3 += x3[i] * wt
            den += ls[i] * wt
        base = sg * GROUP_SIZE + q * VEC
        red[base] = a0
        red[base + 1] = a1
        red[base + 2] = a2
        red[base + 3] = a3
        hs = (q * VEC) // D                     # the head in the group (0, or 1 at d64)
        if d == 0:
            gm[sg * HPG + hs] = top
            gl[sg * HPG + hs] = den
        cuda.syncthreads()
        if sg == 0:
            mx = gm[hs]
            for s_ in range(1, G):
                mx = max(mx, gm[s_ * HPG + hs])
            u0 = ZERO
            u1 = ZERO
            u2 = ZERO
            u3 = ZERO
            den = ZERO
            for s_ in range(G):   # group order: the same sums every run
                wt = math.exp2(gm[s_ * HPG + hs] - mx)
                u0 += red[s_ * GROUP_SIZE + q * VEC] * wt
                u1 += red[s_ * GROUP_SIZE + q * VEC + 1] * wt
                u2 += red[s_ * GROUP_SIZE + q * VEC + 2] * wt
                u3 += red[s_ * GROUP_SIZE + q * VEC + 3] * wt
                den += gl[s_ * HPG + hs] * wt
            if I8:
                stage_o_i8(act, fi_s, q, u0 / den, u1 / den, u2 / den, u3 / den)
            else:
                # o rounded to fp16 as attn_combine writes it, at the word gemv_mma's stage
                # puts dims 4q..4q+3 of group 0 (pairs j, j + 1 of chunk q // 4, j = 2 (q % 4))
                j = (q & 3) * 2
                wd = (q >> 2) * 8 + (2 * j if j < 4 else 2 * j - 7)
                act[wd] = pack_f16x2_from_f32(u0 / den, u1 / den)
                act[wd + 2] = pack_f16x2_from_f32(u2 / den, u3 / den)
        cuda.syncthreads()
        abase = b_lane(uint64(cvta_to_shared_u32(act)), g, t4)
        fi = float32(1.0)
        if I8:
            fi = fi_s[0]
        store_rows(part_o, xa, gk, rc * TPB + warp * TPW, g, t4, tile_dot(c0, abase, t4, fi))
        if TPW > 1:
            store_rows(part_o, xa, gk, rc * TPB + warp * TPW + 1, g, t4,
                       tile_dot(c1, abase, t4, fi))
        if TPW > 2:
            store_rows(part_o, xa, gk, rc * TPB + warp * TPW + 2, g, t4,
                       tile_dot(c2, abase, t4, fi))
        if TPW > 3:
            store_rows(part_o, xa, gk, rc * TPB + warp * TPW + 3, g, t4,
                       tile_dot(c3, abase, t4, fi))
        # the fold (module doc): the last block of the chunk adds the GROUPS shares to x.  The
        # barrier makes the block's stores thread 0's to release (PTX's release is cumulative),
        # its acquire and the second barrier the other blocks' shares the readers'
        if ACC:
            return
        cuda.syncthreads()
        if tid == 0:
            last[0] = uint32(atom_add_acq_rel_gpu_u32(counters, rc, uint32(1)) == GROUPS - 1)
        cuda.syncthreads()
        if last[0]:
            # PARTS threads a row quad, each summing GROUPS / PARTS heads' shares in head order
            # (one round trip of loads, ~40 registers), then the parts in order
            quad = tid % QUADS
            part = tid // QUADS
            r = rc * CH + quad * 4
            s0 = ZERO
            s1 = ZERO
            s2 = ZERO
            s3 = ZERO
            if r < n_out:
                for i in range(HPP):
                    h = part * HPP + i
                    if h < GROUPS:
                        p0, p1, p2, p3 = ld_global_cg_v4_u32(part_o, h * n_out + r)
                        s0 += mov_b32_f32_from_u32(p0)
                        s1 += mov_b32_f32_from_u32(p1)
                        s2 += mov_b32_f32_from_u32(p2)
                        s3 += mov_b32_f32_from_u32(p3)
            f = part * CH + quad * 4
            red[f] = s0
            red[f + 1] = s1
            red[f + 2] = s2
            red[f + 3] = s3
            cuda.syncthreads()
            if part == 0 and r < n_out:
                for p_ in range(1, PARTS):
                    s0 += red[p_ * CH + quad * 4]
                    s1 += red[p_ * CH + quad * 4 + 1]
                    s2 += red[p_ * CH + quad * 4 + 2]
                    s3 += red[p_ * CH + quad * 4 + 3]
                x[r] += s0
                x[r + 1] += s1
                x[r + 2] += s2
                x[r + 3] += s3
            if tid == 0:
                counters[rc] = uint32(0)

    body = dev(body)
    if ACC:
        def kernel(state, part_acc, part_ml, qw, sc, xa):
            body(state, part_acc, part_ml, qw, sc, part_acc, part_acc, xa, xa)
        return kernel

    def kernel(state, part_acc, part_ml, qw, sc, x, part_o, counters):
        body(state, part_acc, part_ml, qw, sc, x, part_o, counters, counters)

    return kernel


def o_proj_name(n_out, k, head_dim, num_heads, max_splits, min_pps, tpw, acc=False,
                i8=False) -> str:
    extra = {"acc": True} if acc else {}
    if i8:
        extra["i8"] = True
    return kernel_name("attn_o_proj", n=n_out, k=k, d=head_dim, hq=num_heads, splits=max_splits,
                       minpps=min_pps, tpw=tpw, **extra)


@functools.cache
def o_proj_kernel(n_out, k, head_dim, num_heads, max_splits, min_pps, tpw, acc=False, i8=False):
    """attn_o_proj compiled for sm_90, launched as [GROUPS * n_chunks, 32 * WARPS]."""
    args = (n_out, k, head_dim, num_heads, max_splits, min_pps, tpw, bool(acc), bool(i8))
    return compile_kernel(o_proj_body(*args), O_SIG_ACC if acc else O_SIG, o_proj_name(*args),
                          launch_bounds=(32 * WARPS,), fastmath=True)


def xacc_workspace(n_out: int):
    """xacc: (N,) int64 as 2N uint32 words, zero -- attn_o_proj's fixed-point sums (acc),
    which down folds into x and zeroes every layer."""
    import numpy as np
    return cuda.to_device(np.zeros(2 * n_out, np.uint32))


def o_proj_workspace(n_out: int, k: int, tpw: int):
    """Device buffers of one call site: part_o (K / 128 * N,) fp32 and the chunks' counters
    (zero, as every launch leaves them)."""
    import numpy as np
    part_o = cuda.device_array(k // GROUP_SIZE * n_out, np.float32)
    counters = cuda.to_device(np.zeros(n_chunks(n_out, tpw), np.uint32))
    return part_o, counters


def make_o_proj_launcher(cfg, state, part_acc, part_ml, x, min_pps: int, tpw: int = 2,
                         xacc=None, i8: bool = False):
    """`launch(qw, sc, stream)` for every layer of one engine (the weights change a layer; the
    partials, x and the workspace do not): checks once, allocates the workspace once.  xacc
    (xacc_workspace): the heads' shares are added there (the acc kernel) and x is not touched;
    gate_up and down then take it (MmaTiling.xacc).  i8: o multiplied as digits on the int8
    tensor cores (gemv_mma.py "i8")."""
    import numpy as np
    from nq.kernels.attention.combine import flat_partials
    n, k, d, hq = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.head_dim, cfg.num_heads
    check_o_proj(n, k, d, hq, tpw)
    ms = part_acc.shape[0]
    if tuple(part_acc.shape) != (ms, hq, d) or tuple(part_ml.shape) != (ms, hq, 2):
        raise ValueError(f"attn_o_proj: partials {part_acc.shape} / {part_ml.shape}, want "
                         f"({ms}, {hq}, {d}) / ({ms}, {hq}, 2) (decode_workspace)")
    if x.dtype != np.float32 or tuple(x.shape) != (n,):
        raise ValueError(f"attn_o_proj: x is {x.dtype}{tuple(x.shape)}, want float32({n},)")
    if xacc is not None and (xacc.dtype != np.uint32 or tuple(xacc.shape) != (2 * n,)):
        raise ValueError(f"attn_o_proj: xacc is {xacc.dtype}{tuple(xacc.shape)}, want "
                         f"uint32({2 * n},) (xacc_workspace)")
    kern = o_proj_kernel(n, k, d, hq, ms, min_pps, tpw, xacc is not None, i8)
    acc_flat, ml_flat = flat_partials(part_acc, part_ml)
    part_o, counters = o_proj_workspace(n, k, tpw) if xacc is None else (None, None)
    grid = (k // GROUP_SIZE) * n_chunks(n, tpw)

    def launch(qw, sc, stream=0):
        if qw.dtype != np.uint32 or tuple(qw.shape) != (n, k // 8) or \
                sc.dtype != np.float16 or tuple(sc.shape) != (n, k // GROUP_SIZE):
            raise ValueError(f"attn_o_proj: weights {qw.dtype}{tuple(qw.shape)} / "
                             f"{sc.dtype}{tuple(sc.shape)}, want uint32({n}, {k // 8}) / "
                             f"float16({n}, {k // GROUP_SIZE}) in the tensor-core layout")
        if xacc is not None:
            kern[grid, 32 * WARPS, stream](state, acc_flat, ml_flat, qw.reshape(qw.size),
                                           sc.reshape(sc.size), xacc)
        else:
            kern[grid, 32 * WARPS, stream](state, acc_flat, ml_flat, qw.reshape(qw.size),
                                           sc.reshape(sc.size), x, part_o, counters)

    return launch
