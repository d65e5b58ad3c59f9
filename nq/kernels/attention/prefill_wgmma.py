"""Causal prefill attention on wgmma (sm_90a): prefill.py's kernel with each warpgroup's
S = Q K^T and O += P V issued as asynchronous m64nNk16 wgmmas instead of per-warp mma.sync.

Same launch and semantics as nq/kernels/attention/prefill.py (read its docstring first): a CTA
is (kv head h, T query tokens) with the GQA group stacked into rows -- row r is token r // G,
query head h*G + r % G -- so every K/V tile staged in shared memory serves all G heads; q
fp32 rounded once to fp16(q * log2(e)/sqrt(D)), online softmax in the log2 domain, fp16 P,
fp32 S and O, rows past start + M of the cache zero filled by the copies (stale slots may
hold NaN), padding rows with q = 0 never stored.  Its NumPy reference and tolerance hold here.

Why wgmma.  prefill.py's mma.sync kernel runs at ~210-220 TFLOP/s, ~47 % of the ~450 TFLOP/s
that mma.sync reaches through numba; wgmma reaches 634+ (cuBLAS) and nq's own wgmma GEMM
330-460 (nq/kernels/int4/gemm_wgmma.py).  A wgmma also needs no ldmatrix: K and V are read by
the tensor core from shared memory through a descriptor, which frees the issue slots the
mma.sync kernel spent on 64 ldmatrix.x4 a warp a tile.

The CTA: `warpgroups` (default 2) x 64 rows = 128 rows, T = 18 tokens at G = 7 (126 rows), the
same stacking and grid (Hkv, ceil(M/T)) as prefill.py, longest rows first.  Warpgroup j holds
rows 64j..64j+63; its warp w rows 16w..16w+15, so a thread's rows, Q fragments, S and O
fragments are exactly the mma.sync kernel's (the wgmma "rs" A fragment and D layouts are
mma.m16n8k16's, nq/ptx/wgmma.py).

Shared memory: a ring of `nstage` stages (default 3), each a tile of BN = 128 keys of K then
of V, both in the 128B-swizzled layout: 64-dim halves of BN x 128-byte key rows (chunk c of
key r at 16 (c ^ r % 8)), the ring 1024-aligned because the hardware swizzles absolute
addresses.  That one layout is both operands' (nq/ptx/wgmma.py):
    K as S's B, K-major (N = keys, k = dims): k16 step c at half c // 4, + 32 (c % 4) bytes;
        SBO = 1024 (8 keys), LBO unused -- gemm_wgmma's activations, GPU-tested.
    V as O's B, MN-major (k = keys, N = dims; trans-b = 1, `wgmma_rs_tb`): k16 step kk at
        + 2048 kk (16 keys); SBO = 1024 (8 keys), LBO = the 64-dim half's offset (BN x 128).
So V needs no transpose (prefill.py's ldmatrix.trans), and one copy plan fills both tiles:
16-byte cp.async.cg by every thread (16 a tile at d128 BN 128, 256 threads), zero filled
past start + M.  64 KiB a stage at d128: 3 stages + 1 KiB of alignment = 193 KiB.

The pipeline, a warpgroup's view (FlashAttention-3's intra-warpgroup overlap, without its
producer warps):

    tile 0:  wait + barrier; S0 = Q K0; refill; wait 0; softmax S0 -> P0
    tile j:  cp.async.wait_group(nstage - 3); fence.proxy.async; bar.sync
             fence; S_j = Q K_j (D/16 wgmmas, commit); O += P_{j-1} V_{j-1} (BN/16, commit)
             refill the stage of tile j - 2 with tile j + nstage - 2 (issued behind the
             wgmmas, which do not read that stage)
             wait_group 1     -- S_j is done, P V still running on the tensor core
             mask, row max, exp2, row sums of S_j (the softmax overlaps the P V)
             wait_group 0     -- now O may be rescaled and P_{j-1}'s registers rewritten
             O *= exp2(m_old - m_new); P_j = fp16(S_j)
    after:   O += P_last V_last; wait 0; O / l to o

and the other warpgroup's softmax fills the tensor core while this one's exp2 run.  A tile j
reads K_j and V_{j-1}: two stages, so the refill goes to the stage of tile j - 2, which every
warpgroup has retired (wait 0 ended tile j - 1) by the barrier -- hence nstage >= 3 and
nstage - 2 tiles in flight.  The copies are cp.async, not bulk copies: a page's bulk copy
keeps the pool's 256-byte rows, which no wgmma layout reads; a TMA tensor copy could swizzle
but needs a host-built tensor map per layer.

Every warpgroup runs every tile of its CTA (no per-warp skipping as in prefill.py: a wgmma is
warpgroup-collective, and the rows of a CTA's two warpgroups are 9 tokens apart, one tile at
most); keys past a row are masked to NEG_BIG, and every row sees key 0 in tile 0, so m is a
real score from then on and a fully masked tile adds p = 0.

Registers (ptxas sm_90a; the CPU test prints them): 253-255 at d128, 229-235 at d64 -- 64 O,
64 S, 32 Q, 32 P, addresses, the softmax's chains; no spill in the default loop, no local
memory, no serialised wgmma (each a test); fragments are local arrays indexed by unrolled
constants (nq/ptx/wgmma.py's rule).  One CTA an SM, as 193 KiB asks.

Performance (H200, 2026-12-02, a21c076): one layer at m 2048 runs at 383 / 402 TFLOP/s of
the causal work from start 6144 / 30000 (272 from 0), 28 layers of a 7B prompt's attention
35.0 ms at 8K and 508 ms at 32K.  What a tile's cycles go to (ncu and the SASS), why the loop
body exists twice (tiles below the diagonal skip the mask), why the refill names its source by
a constant-stride byte offset, the overlap=True loop (measured slower, off) and each
prediction against its outcome: docs/KERNELS_ATTN.md, "Prefill attention on wgmma".

overlap=True (off: slower) orders a tile S_j; O *= alpha; P V; wait 1; softmax; refill; wait 0
tying O and P (wgmma_wait_group_acc_a); docs/KERNELS_ATTN.md has its hazards and figures.
"""
from __future__ import annotations

import functools
import math
import os

from numba import cuda  # a module global: the simulator swaps it for its fake module
from numba.cuda.types import float32, int32, uint32, uint64

from nq.kernels.attention.prefill import (LOG2E, NEG_BIG, SIG, check_arrays, out_body, paged_launch,
                                          prefill_attention_reference, rounded_q,
                                          tokens_per_cta)
from nq.kernels.build import compile_kernel, kernel_name
from nq.paged import PAGE

__all__ = ["prefill_attention_launcher", "prefill_attention_reference", "rounded_q",
           "smem_bytes", "tile_offset"]

WARPGROUPS = 2     # 64 rows each: 128 rows (18 tokens at G = 7) share every K/V tile
BN = 128           # keys a tile: S is 64 x 128 a warpgroup (64 fp32 a thread)
NSTAGE = 3         # stages of the ring; a tile reads two (K_j, V_{j-1}), nstage - 2 in flight
ALIGN = 1024       # the 128B swizzle repeats every 1024 bytes of absolute shared address
ROW = 128          # bytes of a key row of one 64-dim half
CHAINS_BASE = 4    # independent max / sum chains a row in the softmax (2 more registers each)
CHAINS_OV = 2      # ... in the overlap loop, where P_{j-1}'s 32 registers are live too
# the launcher's default loop (module doc, "overlap=True"); NQ_ATTN_OVERLAP=1 sets it for a process
OVERLAP = os.environ.get("NQ_ATTN_OVERLAP") == "1"


def tile_offset(key: int, chunk: int, bn: int = BN) -> int:
    """Byte offset in a K or V tile of 16-byte chunk `chunk` (dims 8c..8c+7) of key row `key`:
    the 64-dim half c // 8 (bn x 128 bytes each), the key's 128-byte row, chunk c % 8 at
    (c % 8) ^ (key % 8) -- the 128B swizzle of nq/ptx/wgmma.py with the tile 1024-aligned."""
    return (chunk // 8) * bn * ROW + key * ROW + (((chunk % 8) ^ (key % 8)) * 16)


def smem_bytes(head_dim: int, bn: int = BN, nstage: int = NSTAGE) -> int:
    """Dynamic shared memory: nstage x (K tile + V tile) + the 1024-alignment slack."""
    return nstage * 2 * bn * 2 * head_dim + ALIGN


def _name(gqa, head_dim, num_kv, warpgroups, bn, nstage, overlap=False):
    return kernel_name("prefill_attn_wgmma" + ("_ov" if overlap else ""), g=gqa, d=head_dim,
                       kv=num_kv, wg=warpgroups, bn=bn, st=nstage)


@functools.cache
def _prefill_kernel(gqa: int, head_dim: int, num_kv: int, warpgroups: int, bn: int,
                    nstage: int, overlap: bool = False):
    """The kernel body for one head shape; see the module doc."""
    from nq.kernels.common import dev
    from nq.ptx import (cp_async_cg_shared_global_16_zfill_off, cp_async_commit_group,
                        cp_async_wait_group, cvta_to_shared_u32_at, fence_proxy_async_shared,
                        griddepcontrol_wait, pack_f16x2_from_f32)
    from nq.ptx.wgmma import (SWIZZLE_128B, desc_hi, wgmma_commit_group, wgmma_fence_acc,
                              wgmma_rs, wgmma_rs_tb, wgmma_wait_group_acc,
                              wgmma_wait_group_acc_a, wgmma_zero_acc)

    G, D, NWG, NST = gqa, head_dim, warpgroups, nstage   # num_kv: in the name (the grid x)
    NW = 4 * NWG                       # warps
    T = tokens_per_cta(G, NW)          # query tokens a CTA
    assert T >= 1 and D in (64, 128) and bn in (64, 128) and NST >= 3
    NTH = 32 * NW
    KS = D // 16                       # k16 steps of S = Q K^T
    KB = bn // 16                      # k16 steps of O += P V (16 keys each)
    NTS = bn // 8                      # key n-tiles of S in a thread's fragment
    NTO = D // 8                       # dim n-tiles of O
    NS, NO = bn // 2, D // 2           # fp32 accumulators a thread: S, O
    QW, PW = 4 * KS, 4 * KB            # fp16x2 A-fragment registers: Q, P
    CPR = D // 8                       # 16-byte chunks of a key row
    RPP = NTH // CPR                   # key rows one copy pass covers
    PASSES = bn // RPP
    assert NTH % CPR == 0 and bn % RPP == 0 and RPP % 8 == 0
    assert RPP % PAGE == 0 or PAGE % RPP == 0   # a pass's page and row in it: constants + rr
    # the pool's byte strides, compile-time constants (kv (n_pages, num_kv, 2, PAGE, D) fp16):
    # a copy's source is table[page] * PSTRIDE + this thread's fixed offset in the page
    PSTRIDE = num_kv * 2 * PAGE * D * 2    # a page, all kv heads
    HSTRIDE = 2 * PAGE * D * 2             # a kv head's K and V rows in a page
    VG = PAGE * D * 2                      # V's rows after K's
    KH = bn * ROW                      # a 64-dim half of a tile
    VOFF = (D // 64) * KH              # V's tile after K's
    STAGE = 2 * VOFF
    PENDING = NST - 3                  # copy groups left in flight when a tile is consumed
    K_HI = desc_hi(16, 1024, SWIZZLE_128B)        # K-major: SBO 8 keys, LBO unused
    V_HI = desc_hi(KH, 1024, SWIZZLE_128B)        # MN-major: LBO next 64 dims, SBO 8 keys
    mma_s = wgmma_rs(bn)               # S (64 x bn) += Q (64 x 16) . K^T
    mma_o = wgmma_rs_tb(D)             # O (64 x D) += P (64 x 16) . V (16 keys x D)
    fence_s, fence_o = wgmma_fence_acc(NS), wgmma_fence_acc(NO)
    wait_s, wait_o = wgmma_wait_group_acc(NS), wgmma_wait_group_acc(NO)
    wait_op = wgmma_wait_group_acc_a(NO, PW)
    OVERLAP = bool(overlap)
    CHAINS = CHAINS_OV if OVERLAP else CHAINS_BASE   # the softmax's reduction chains a row
    CH2 = 2 * CHAINS
    zero_s, zero_o = wgmma_zero_acc(NS), wgmma_zero_acc(NO)
    QSCALE = float32(LOG2E / math.sqrt(D))
    NEG = float32(NEG_BIG)
    ZERO = float32(0.0)
    Z = uint32(0)
    FULL = 0xFFFFFFFF
    PG = PAGE

    def load_tile(kv, table, sbase, pos0, kv_len, last_pg, goff, soff, rr):
        """This thread's cp.async copies of the K and V tile of keys pos0..pos0+bn-1 into the
        stage at sbase (tile_offset's layout), zero filled from kv_len on.  goff: its byte
        offset in a page (kv head, row rr % PAGE, chunk); soff: its chunk's place in a tile row
        (one swizzle: row % 8 == rr % 8 every pass).  A pass is a table load, a multiply and
        two copies, every stride a constant; 32-bit indices (numba's int64 index and its
        negative-index fix-up cost ~16 instructions a table load)."""
        p0 = int32(pos0)
        pg0 = uint32(p0 // PG + rr // PG)
        lpg = uint32(last_pg)
        for i in range(PASSES):
            row = rr + RPP * i
            # rr < RPP, so pass i's page is pg0 + (RPP i) // PG and its row in the page
            # rr % PG + (RPP i) % PG (one of the two terms is 0)
            pid = table[min(pg0 + uint32((RPP * i) // PG), lpg)]
            nbytes = uint32(16) if p0 + row < int32(kv_len) else Z
            src = uint64(pid) * uint64(PSTRIDE) + uint64(goff + ((RPP * i) % PG) * (D * 2))
            dst = sbase + soff + row * ROW
            cp_async_cg_shared_global_16_zfill_off(dst, kv, src, nbytes)
            cp_async_cg_shared_global_16_zfill_off(dst + VOFF, kv, src + uint64(VG), nbytes)
        cp_async_commit_group()

    def tile_landed():
        """Every thread's copies of the next tile have landed and are visible to the wgmmas;
        and every warpgroup has retired its reads of the stage the next refill overwrites."""
        cp_async_wait_group(PENDING)
        fence_proxy_async_shared()     # cp.async's writes -> wgmma's async proxy
        cuda.syncthreads()

    def refill(kv, table, wbase, jn, n_tiles, kv_len, last_pg, goff, soff, rr):
        """The copies of tile jn into the stage at wbase (an empty group past the end keeps
        wait_group's count a count of tiles)."""
        if jn < n_tiles:
            load_tile(kv, table, wbase, jn * bn, kv_len, last_pg, goff, soff, rr)
        else:
            cp_async_commit_group()

    def issue_s(sacc, qf, kbase):
        """S = Q K^T of the tile whose K starts at shared address kbase: D/16 wgmmas."""
        kd = uint64(K_HI) | uint64((kbase >> 4) & 0x3FFF)
        for ks in range(KS):
            mma_s(sacc, qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3],
                  kd + uint64((ks // 4) * (KH >> 4) + 2 * (ks % 4)), 1 if ks else 0)
        wgmma_commit_group()

    def issue_o(oacc, pf, vbase):
        """O += P V of the tile whose V starts at shared address vbase: bn/16 wgmmas."""
        vd = uint64(V_HI) | uint64((vbase >> 4) & 0x3FFF)
        for kk in range(KB):
            mma_o(oacc, pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3],
                  vd + uint64(kk * (16 * ROW >> 4)), 1)
        wgmma_commit_group()

    def make_softmax(masked):
        """softmax(sacc, pos0, qp0, qp1, t, m0, m1) -> (m0, m1, alpha0, alpha1, sum0, sum1):
        mask S (keys past a row's position -> NEG_BIG; masked=False below the diagonal, where
        it is the identity), the quad's row max, p = exp2(s - m_new) in place, this lane's
        row sums (CHAINS independent chains a row: 2 warps a scheduler hide no 32-long one);
        alpha = exp2(m_old - m_new) rescales O and l."""
        def softmax(sacc, pos0, qp0, qp1, t, m0, m1):
            if masked:
                # key pos0 + 8 nt + 2t + e is visible iff 8 nt + e <= lim
                lim0 = int32(qp0 - pos0 - 2 * t)
                lim1 = int32(qp1 - pos0 - 2 * t)
                for nt in range(NTS):
                    for e in range(2):
                        i = 4 * nt + e
                        col = int32(8 * nt + e)
                        if col > lim0:
                            sacc[i] = NEG
                        if col > lim1:
                            sacc[i + 2] = NEG
            ch = cuda.local.array(CH2, float32)   # [row][chain], constant indices
            for k in range(2 * CHAINS):
                ch[k] = NEG
            for nt in range(NTS):
                for e in range(2):
                    k = (2 * nt + e) % CHAINS
                    ch[k] = max(ch[k], sacc[4 * nt + e])
                    ch[CHAINS + k] = max(ch[CHAINS + k], sacc[4 * nt + e + 2])
            mx0 = ch[0]
            mx1 = ch[CHAINS]
            for k in range(1, CHAINS):
                mx0 = max(mx0, ch[k])
                mx1 = max(mx1, ch[CHAINS + k])
            mx0 = max(mx0, cuda.shfl_xor_sync(FULL, mx0, 1))
            mx1 = max(mx1, cuda.shfl_xor_sync(FULL, mx1, 1))
            mx0 = max(mx0, cuda.shfl_xor_sync(FULL, mx0, 2))
            mx1 = max(mx1, cuda.shfl_xor_sync(FULL, mx1, 2))
            mn0 = max(m0, mx0)
            mn1 = max(m1, mx1)
            for k in range(2 * CHAINS):
                ch[k] = ZERO
            for nt in range(NTS):
                for e in range(2):
                    k = (2 * nt + e) % CHAINS
                    i = 4 * nt + e
                    p0 = math.exp2(sacc[i] - mn0)
                    p1 = math.exp2(sacc[i + 2] - mn1)
                    sacc[i] = p0
                    sacc[i + 2] = p1
                    ch[k] += p0
                    ch[CHAINS + k] += p1
            ps0 = ch[0]
            ps1 = ch[CHAINS]
            for k in range(1, CHAINS):
                ps0 += ch[k]
                ps1 += ch[CHAINS + k]
            return mn0, mn1, math.exp2(m0 - mn0), math.exp2(m1 - mn1), ps0, ps1
        return softmax

    def rescale(oacc, al0, al1):
        """O *= alpha by row."""
        for jd in range(NTO):
            oacc[4 * jd] *= al0
            oacc[4 * jd + 1] *= al0
            oacc[4 * jd + 2] *= al1
            oacc[4 * jd + 3] *= al1

    def pack(sacc, pf):
        """P's A fragments from S's C fragments (key n-tiles 2kk, 2kk+1 are k16 step kk), fp16
        as prefill.py's."""
        for kk in range(KB):
            i = 8 * kk
            pf[4 * kk] = pack_f16x2_from_f32(sacc[i], sacc[i + 1])
            pf[4 * kk + 1] = pack_f16x2_from_f32(sacc[i + 2], sacc[i + 3])
            pf[4 * kk + 2] = pack_f16x2_from_f32(sacc[i + 4], sacc[i + 5])
            pf[4 * kk + 3] = pack_f16x2_from_f32(sacc[i + 6], sacc[i + 7])

    load_tile, tile_landed, refill, issue_s, issue_o, rescale, pack = (
        dev(f) for f in (load_tile, tile_landed, refill, issue_s, issue_o, rescale, pack))
    softmax_masked, softmax_full = dev(make_softmax(True)), dev(make_softmax(False))

    def make_step(softmax):
        """Tile j >= 1 of the loop (module doc) with the given softmax -> the loop's carried
        scalars; two copies (full / masked), so no branch sits inside a loop body."""
        def step(kv, table, qf, pf, sacc, oacc, j, rd, wr, ring, last, m0, m1, l0, l1, al0,
                 al1, n_tiles, kv_len, last_pg, qp0, qp1, t, goff, soff, rr):
            tile_landed()
            cur = rd + STAGE if rd != last else ring
            fence_s(sacc)
            issue_s(sacc, qf, cur)
            if OVERLAP:
                rescale(oacc, al0, al1)           # tile j - 1's alpha, under S_j
            fence_o(oacc)
            issue_o(oacc, pf, rd + VOFF)
            if not OVERLAP:
                # the copies are issued behind the wgmmas, which they do not touch (the stage
                # of tile j - 2)
                refill(kv, table, wr, j + NST - 2, n_tiles, kv_len, last_pg, goff, soff, rr)
                wr = wr + STAGE if wr != last else ring
            wait_s(sacc, 1)                       # S_j done; P_{j-1} V_{j-1} in flight
            m0, m1, al0, al1, ps0, ps1 = softmax(sacc, j * bn, qp0, qp1, t, m0, m1)
            l0 = l0 * al0 + ps0                   # this lane's share; the quad summed at the end
            l1 = l1 * al1 + ps1
            if OVERLAP:
                # unconditional (zero filled past the end): no branch between the commits and
                # wait 0, and the copies' registers are not live in the softmax
                load_tile(kv, table, wr, (j + NST - 2) * bn, kv_len, last_pg, goff, soff, rr)
                wr = wr + STAGE if wr != last else ring
                wait_op(oacc, pf, 0)              # P V retired; pf held in its registers till now
            else:
                wait_o(oacc, 0)                   # P V retired: O and pf may be rewritten
                rescale(oacc, al0, al1)
            pack(sacc, pf)
            return cur, wr, m0, m1, l0, l1, al0, al1
        return step

    step_full, step_masked = dev(make_step(softmax_full)), dev(make_step(softmax_masked))
    store_out = dev(out_body(D))

    def prefill_attn_wgmma(q, kv, table, o, start, m):
        # q (M_max, HQ, D) f32; kv (n_pages, HKV, 2, 16, D) f16; table (max_pages,) int32
        # o (M_max, HQ*D/2) uint32 = fp16 pairs; start, m: the chunk (keys 0..start+m-1 cached)
        smu = cuda.shared.array(0, uint32)     # NST stages of [K tile | V tile], 128B-swizzled
        qf = cuda.local.array(QW, uint32)      # Q's A fragments (fp16, pre-scaled), per k16
        pf = cuda.local.array(PW, uint32)      # P's A fragments, per 16 keys
        sacc = cuda.local.array(NS, float32)   # S's D fragments: [key n-tile][c0..c3]
        oacc = cuda.local.array(NO, float32)   # O's D fragments: [dim n-tile][c0..c3]
        griddepcontrol_wait()   # PDL (nq/ptx/griddep.py): q and the chunk's K/V come from upstream
        tid = int32(cuda.threadIdx.x)
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        kvh = cuda.blockIdx.x
        t0 = (cuda.gridDim.y - 1 - cuda.blockIdx.y) * T   # the longest rows start first
        n_tok = min(T, m - t0)
        kv_len = start + m
        n_tiles = (start + t0 + n_tok + bn - 1) // bn
        last_pg = (kv_len - 1) // PG
        rr = tid // CPR                           # this thread's first tile row ...
        c = tid % CPR                             # ... and 16-byte chunk of it
        goff = kvh * HSTRIDE + (rr % PG) * (D * 2) + 16 * c
        soff = (c // 8) * KH + (((c % 8) ^ (rr % 8)) * 16)
        sm0 = cvta_to_shared_u32_at(smu, 0)
        ring = sm0 + (ALIGN - sm0 % ALIGN) % ALIGN
        last = ring + (NST - 1) * STAGE

        # This lane's rows g and g + 8 of its warp's 16, as prefill.py: padding rows (past the
        # CTA's tokens) get q = 0 and see every cached key, finite and never stored.
        r0 = 16 * warp + g
        r1 = r0 + 8
        ok0 = r0 // G < n_tok
        ok1 = r1 // G < n_tok
        tk0 = t0 + min(r0 // G, n_tok - 1)
        tk1 = t0 + min(r1 // G, n_tok - 1)
        h0 = kvh * G + r0 % G
        h1 = kvh * G + r1 % G
        qp0 = start + tk0 if ok0 else kv_len - 1   # row 0 sees keys 0..qp0
        qp1 = start + tk1 if ok1 else kv_len - 1
        for ks in range(KS):
            for half in range(2):                 # a0/a1 (dims 2t..), a2/a3 (dims 8+2t..)
                d = 16 * ks + 8 * half + 2 * t
                x0 = pack_f16x2_from_f32(q[tk0, h0, d] * QSCALE, q[tk0, h0, d + 1] * QSCALE)
                x1 = pack_f16x2_from_f32(q[tk1, h1, d] * QSCALE, q[tk1, h1, d + 1] * QSCALE)
                qf[4 * ks + 2 * half] = x0 if ok0 else Z
                qf[4 * ks + 2 * half + 1] = x1 if ok1 else Z
        zero_s(sacc)
        zero_o(oacc)
        m0 = NEG
        m1 = NEG
        l0 = ZERO
        l1 = ZERO

        for s in range(NST - 2):                  # tiles 0 .. NST-3 in flight
            if s < n_tiles:
                load_tile(kv, table, ring + s * STAGE, s * bn, kv_len, last_pg, goff, soff, rr)
            else:
                cp_async_commit_group()
        wr = ring + (NST - 2) * STAGE             # where tile j + NST - 2 goes
        tile_landed()
        fence_s(sacc)
        issue_s(sacc, qf, ring)
        refill(kv, table, wr, NST - 2, n_tiles, kv_len, last_pg, goff, soff, rr)
        wr = wr + STAGE if wr != last else ring
        wait_s(sacc, 0)
        m0, m1, al0, al1, ps0, ps1 = softmax_masked(sacc, 0, qp0, qp1, t, m0, m1)
        l0 = ps0                                  # al = exp2(NEG - m) = 0: O and l were 0
        l1 = ps1
        pack(sacc, pf)                            # O is 0: no rescale
        rd = ring                                 # the stage of tile j - 1 (its V)
        # tiles 1 .. n_full - 1 end at or below every row's position (start + t0): no mask
        n_full = max(1, min(n_tiles, (start + t0 + 1) // bn))
        for j in range(1, n_full):
            rd, wr, m0, m1, l0, l1, al0, al1 = step_full(
                kv, table, qf, pf, sacc, oacc, j, rd, wr, ring, last, m0, m1, l0, l1, al0, al1,
                n_tiles, kv_len, last_pg, qp0, qp1, t, goff, soff, rr)
        for j in range(n_full, n_tiles):
            rd, wr, m0, m1, l0, l1, al0, al1 = step_masked(
                kv, table, qf, pf, sacc, oacc, j, rd, wr, ring, last, m0, m1, l0, l1, al0, al1,
                n_tiles, kv_len, last_pg, qp0, qp1, t, goff, soff, rr)
        if OVERLAP:
            rescale(oacc, al0, al1)
        fence_o(oacc)
        issue_o(oacc, pf, rd + VOFF)
        wait_o(oacc, 0)
        cp_async_wait_group(0)                    # the empty tail groups: nothing in flight

        store_out(o, oacc, l0, l1, h0, h1, t, tk0, tk1, ok0, ok1)

    return prefill_attn_wgmma


@functools.cache
def _jit(gqa, head_dim, num_kv, warpgroups, bn, nstage, overlap=False):
    body = _prefill_kernel(gqa, head_dim, num_kv, warpgroups, bn, nstage, overlap)
    # fastmath: 1/l becomes div.approx (an IEEE division is a call, and ptxas serialises every
    # wgmma of a kernel that holds one), exp2 ex2.approx
    return compile_kernel(body, SIG, _name(gqa, head_dim, num_kv, warpgroups, bn, nstage,
                                           overlap),
                          launch_bounds=(128 * warpgroups,), fastmath=True)


# ---- launcher ------------------------------------------------------------------------------------

def check_shape(cfg, warpgroups: int, bn: int, nstage: int) -> None:
    """Refuse a configuration the kernel does not build (ValueError, 'prefill attention')."""
    from nq.kernels.common import SMEM_OPTIN_LIMIT
    d = cfg.head_dim
    if d not in (64, 128) or bn not in (64, 128) or warpgroups not in (1, 2) or nstage < 3:
        raise ValueError(f"prefill attention (wgmma): unsupported head_dim={d}, bn={bn}, "
                         f"warpgroups={warpgroups}, nstage={nstage} (want d 64 or 128, bn 64 "
                         f"or 128, 1 or 2 warpgroups, nstage >= 3)")
    if tokens_per_cta(cfg.gqa_ratio, 4 * warpgroups) < 1:
        raise ValueError(f"prefill attention (wgmma): {cfg.gqa_ratio} query heads a kv head "
                         f"need more than {warpgroups} warpgroups (64 rows each)")
    if smem_bytes(d, bn, nstage) > SMEM_OPTIN_LIMIT:
        raise ValueError(f"prefill attention (wgmma): {nstage} stages of {bn} keys at d {d} "
                         f"need {smem_bytes(d, bn, nstage)} bytes of shared memory, over "
                         f"{SMEM_OPTIN_LIMIT}")


def prefill_attention_launcher(cfg, q, kv_layer, table, o, *, warpgroups: int = WARPGROUPS,
                               bn: int = BN, nstage: int = NSTAGE, overlap: bool = OVERLAP):
    """prefill.prefill_attention_launcher's contract on the wgmma kernel: check the arrays once;
    return `launch(m, start, stream=0)`, which attends the m query rows q[:m] (positions
    start..start+m-1, rotated; their K/V already in the cache) to keys 0..start+i and writes
    o[:m].

    q (M_max, num_heads, head_dim) float32; o (M_max, num_heads*head_dim) float16 (o_proj's
    input); kv_layer (n_pages, num_kv_heads, 2, 16, head_dim) float16; table int32 block table
    (positions 0..start+m-1 must be mapped).  One compiled kernel serves every m and start.
    Needs sm_90a (wgmma).  overlap=True: the loop order that lets the softmax run under P V
    (module doc, "overlap")."""
    check_arrays(cfg, q, kv_layer, table, o)
    check_shape(cfg, warpgroups, bn, nstage)
    d = cfg.head_dim
    kern = _jit(cfg.gqa_ratio, d, cfg.num_kv_heads, warpgroups, bn, nstage, bool(overlap))
    return paged_launch(cfg, q, kv_layer, table, o, kern, smem_bytes(d, bn, nstage),
                        tokens_per_cta(cfg.gqa_ratio, 4 * warpgroups), 128 * warpgroups)
