"""The INT4 lm_head's candidates rescored by the fp16 head: the fp16 head's logits where they
decide the token, at the INT4 head's bytes.

Public API:

    bound = row_bounds(file_scales)            # host: fp32 (V,), each row's largest group scale
                                               # (nq.loader.quant's; rescore_rows, K_SIGMA: nq.ref's)
    r = make_rescore(cfg, nb)                  # Rescore, after an INT4 head of nb blocks
    head(x, norm_w, qw, sc, logits, bound, r.bmax, stream)   # int4/launch.py's HeadBoundGemv:
                                               # the logits, and r.bmax the blocks' bound maxima
    r(x, norm_w, exact, logits, bound, stream) # the candidates' logits replaced by the fp16
                                               # head's (exact fp16 (V, H): lm_head or the
                                               # tied embedding)
    ref_rescore(logits, bound, x, norm_w, eps, exact)   # NumPy reference -> (logits, candidates)
    rescore_rows(logits, bound, h, exact)      # the same from h (the reference model's head)

Why: the INT4 head reads a quarter of the fp16 head's bytes (0.26 ms of a 7B token on an H100,
docs/PERF.md 0.36) but changes about a quarter of the greedy tokens of a random model, whose
logits sit near ties (scripts/lm_head_quality.py).  The token is decided by a handful of ids
near the top; only their logits need the fp16 rows, ~0.1 % of the head's bytes.

Which ids: rounding to a group scale s moves a weight by at most s/2, uniformly, so a row's
logit error is a sum of independent bounded terms with variance at most
    sigma_i^2 = sum_g s_ig^2 |h_g|^2 / 12  <=  (max_g s_ig)^2 |h|^2 / 12 = (c_i |h| / sqrt 12)^2,
and such a sum is sub-Gaussian with that variance: P(|error| > K sigma) <= 2 exp(-K^2 / 2),
3e-8 at K = 6 (K_SIGMA).  With b_i = K c_i |h| / sqrt 12 every id whose INT4 logit l_i
satisfies l_i + b_i >= M = max_j (l_j - b_j) is a candidate and gets the fp16 head's logit.
The fp16 head's argmax t is then a candidate (l_t + b_t >= exact_t >= exact_r >= l_r - b_r
for the r that sets M), and no other id can beat it: a non-candidate's INT4 logit is below M,
which is at most r's exact logit, and r is a candidate.  So greedy decoding gives the fp16
head's token unless an error passes 6 bounds (two comparisons a token: ~6e-8).  Sampling's
top-k / top-p see the fp16 logits of every id within ~2 b of the top and the INT4 logits of
the rest (ids e^(-2b/T) or more less likely than the top).

Two passes, in two kernels:
    bound   the INT4 head's own epilogue (gemv.py's lm_head_bound kind): each block computes
            s = K |h| / sqrt 12 after staging h, keeps the max of l_i - bound_i * s over the
            rows it writes, and puts it in bmax[block]; block 0 also puts s in bmax[grid].  No
            atomics, no reset: the next kernel reads every block's entry.  (It was a kernel of
            its own, reading every logit again behind one more boundary: ~10 us of the
            +0.025 ms the rescoring first cost on the H200, docs/PERF.md 0.37-0.38.)
    rescore a persistent grid (a block an SM: the candidates are few, and each block stages h
            once) of the fp16 head's blocks (256 threads, unroll 7): stages h with the fp16
            head's own device functions (common.head_parts) *before* its
            griddepcontrol.wait -- x is the last layer's output, complete before the INT4 head
            let this kernel launch (the head triggers only after its own wait) -- so after
            the wait only M = max of the blocks' entries is left before the candidates: a
            warp takes 32 ids at a time, a ballot of the candidates, then each candidate's
            row dot by the whole warp, as the fp16 head computes it -- so a candidate's logit
            is the fp16 head's bit for bit.
Bytes: logits and bounds once more (1.2 MB each, from L2) and 7 KB a candidate.  A step whose
logits sit near ties reads more rows (every row: the fp16 head's cost, never more).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, uint32

from nq.config import ModelConfig
from nq.kernels.build import compile_kernel, kernel_name
from nq.kernels.common import dev, head_parts, need, sm_count, warp_max
from nq.ptx import SIMULATOR, griddepcontrol_launch_dependents, griddepcontrol_wait
from nq.loader.quant import row_bounds
from nq.ref import K_SIGMA, rescore_rows, rms_norm

THREADS = 256          # the fp16 head's (its h, bit for bit)
UNROLL = 7             # the fp16 head's
__all__ = ["K_SIGMA", "Rescore", "build_kernel", "make_rescore", "ref_rescore", "rescore_kernel",
           "rescore_name", "rescore_rows", "row_bounds"]
NEG_INF = np.float32(-np.inf)
ALIGN16 = None if SIMULATOR else 16
ONE = np.uint32(1)


def ref_rescore(logits, bound, x, norm_w, eps, exact, k_sigma: float = K_SIGMA):
    """NumPy reference: (logits with the candidates' replaced by exact . h in fp32, the
    candidates as a bool mask).  logits fp32 (V,) of the INT4 head, bound (V,) row_bounds'."""
    h = rms_norm(np.asarray(x, np.float32), norm_w, eps).astype(np.float32)
    return rescore_rows(logits, bound, h, exact, k_sigma)


def rescore_name(vocab: int, k: int, eps: float) -> str:
    return kernel_name("lm_head_rescore", v=vocab, k=k, eps=float(eps))


@functools.lru_cache(maxsize=None)
def build_kernel(vocab: int, k: int, eps: float):
    """The rescoring kernel's body and its signature (the module doc)."""
    SH, stage, row_dot = head_parts(k, THREADS, UNROLL)
    WARPS = THREADS // 32
    EPS = np.float32(eps)
    INV_K = np.float32(1.0 / k)
    wmax = dev(warp_max)

    def block_max(v, red, warp, lane):
        # v's max over the block (every thread gets it); red: a float a warp, free on entry
        v = wmax(v)
        if lane == 0:
            red[warp] = v
        cuda.syncthreads()
        m = red[0]
        for w in range(1, WARPS):
            m = max(m, red[w])
        return m

    block_max = dev(block_max)

    def rescore_kernel(x, norm_w, exact, logits, bound, bmax, nb):
        hA = cuda.shared.array(SH, float32, alignment=ALIGN16)
        hB = cuda.shared.array(SH, float32, alignment=ALIGN16)
        red = cuda.shared.array(WARPS, float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        stage(x, norm_w, hA, hB, red, EPS, INV_K)          # syncs the block after; x is
        griddepcontrol_wait()                               # older than the head (module doc)
        griddepcontrol_launch_dependents()
        m = NEG_INF
        for j in range(tid, nb, THREADS):
            m = max(m, bmax[j])
        top = block_max(m, red, warp, lane)                 # M = max_j (l_j - b_j)
        scale = bmax[nb]
        nwarps = cuda.gridDim.x * WARPS
        for base in range((cuda.blockIdx.x * WARPS + warp) * 32, vocab, nwarps * 32):
            i = base + lane
            cand = False
            if i < vocab:
                cand = logits[i] + bound[i] * scale >= top
            # numba types the ballot int32: lane 31's bit would sign-extend into the
            # 64-bit arithmetic below and name ids past the warp's
            mask = uint32(cuda.ballot_sync(0xFFFFFFFF, cand))
            while mask != 0:
                j = cuda.popc((mask & (~mask + ONE)) - ONE)   # the lowest candidate left
                acc = row_dot(exact, base + j, lane, hA, hB)
                if lane == 0:
                    logits[base + j] = acc
                mask &= mask - ONE

    rescore_kernel.__name__ = rescore_kernel.__qualname__ = rescore_name(vocab, k, eps)
    return (rescore_kernel, "void(float32[::1], float16[::1], float16[:, ::1], float32[::1], "
                            "float32[::1], float32[::1], int32)")


@functools.lru_cache(maxsize=None)
def rescore_kernel(vocab: int, k: int, eps: float):
    """The kernel compiled for sm_90 (launch bounds: THREADS)."""
    body, sig = build_kernel(vocab, k, eps)
    return compile_kernel(body, sig, body.__name__, launch_bounds=(THREADS,))


class Rescore:
    """The candidates of an INT4 head's logits rescored by its fp16 rows, after a
    HeadBoundGemv of `nb` blocks wrote the logits and `bmax`; see the module doc."""

    def __init__(self, cfg: ModelConfig, nb: int, grid: int | None = None,
                 blocks_per_sm: int = 1):
        self.vocab, self.k = cfg.vocab_size, cfg.hidden_size
        self.kernel = rescore_kernel(self.vocab, self.k, float(cfg.rms_norm_eps))
        self.nb = int(nb)
        self.grid = grid or min(-(-self.vocab // THREADS), sm_count() * blocks_per_sm)
        self.bmax = cuda.to_device(np.zeros(self.nb + 1, np.float32))
        self.name = rescore_name(self.vocab, self.k, float(cfg.rms_norm_eps))

    def __call__(self, x, norm_w, exact, logits, bound, stream=0):
        need(x, f"{self.name} x", np.float32, (self.k,), 4)
        need(norm_w, f"{self.name} norm_w", np.float16, (self.k,), 2)
        need(exact, f"{self.name} exact (the fp16 head)", np.float16, (self.vocab, self.k))
        need(logits, f"{self.name} logits", np.float32, (self.vocab,), 4)
        need(bound, f"{self.name} bound", np.float32, (self.vocab,), 4)
        self.kernel[self.grid, THREADS, stream](x, norm_w, exact, logits, bound, self.bmax,
                                                np.int32(self.nb))


def make_rescore(cfg: ModelConfig, nb: int, **grids) -> Rescore:
    """The rescoring launcher for cfg, after an INT4 head of nb blocks (grid=,
    blocks_per_sm= to override)."""
    return Rescore(cfg, nb, **grids)
