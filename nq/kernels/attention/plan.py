"""How one decode attention call is cut up: the split plan, the measured defaults, the split
kernel's shared-memory layout, the partial buffers and the launcher's argument check.

Kernels, launcher, NumPy models and tests all read the numbers from here, so the plan has one
definition (the kernels repeat its arithmetic on the device, from `state`, each step).

Split plan (`plan_body`: one function for the kernels and `split_plan`):
    n_pages  = ceil(length / PAGE)                    length = state[STATE_POS] + 1
    pps      = max(min_pps, ceil(n_pages / max_splits))      pages per split
    n_splits = ceil(n_pages / pps)                            every split has >= 1 page
The grid is fixed at max_splits CTAs a kv head (so one captured graph serves every length);
CTAs with split >= n_splits exit at once.

Partials (one set per call site, reusable across layers; `decode_workspace`):
    part_acc (max_splits, num_heads, head_dim) fp32   sum of exp2(score - m) v over the split
    part_ml  (max_splits, num_heads, 2) fp32          (m, l): the split's max score (log2
                                                      domain) and sum of exp2(score - m)

Shared memory of attn_split: nstage x consumers page slots, each the page's 32 token rows
(K rows 0-15, V rows 16-31) of 2*head_dim bytes, with PAD bytes after every rows_per_copy
rows (`row_offset`): at one row a copy the 8 rows an ldmatrix phase reads fall in 8 different
16-byte bank groups; 2**k rows a copy give a 2**k-way conflict and 1/2**k the copies.
"""
from __future__ import annotations

import functools

import numpy as np

from nq.paged import PAGE, check_paged_args

NEG_BIG = -1e30  # finite "-inf": exp2(NEG_BIG - m) == 0 and NEG_BIG - NEG_BIG is not NaN
LOG2E = 1.4426950408889634
PAD = 16         # bytes between padded row groups (one bank group)
ALIGN = 16       # ldmatrix rows and bulk copies need 16-byte shared addresses

# Defaults measured on the H200 (scripts/bench_attn.py, 28 layers of the 7B, us per layer at
# 512 / 8K / 32K; docs/KERNELS_ATTN.md has the whole sweep):
#   1 consumer, 3 stages, 4 rows a copy, 66 splits    9.8 / 16.5 / 33.4   <- the defaults
#   2 consumers, 3 stages, 1 row a copy, 66 splits   10.6 / 18.2 / 48.2   (512 bulk copies a
#       page-pair: the copy engine's issue rate, not bandwidth, bounded it at long contexts)
#   2 consumers, 3 stages, 32 rows (one copy a page)  11.0 / 19.6 / 37.0   (8-way ldmatrix conflicts)
#   max_splits 33 (1 CTA an SM)                       ~10 / 25.6 / 82.9
#   max_splits 132: 10.5 / 18.2 / 33.0; 4 consumers x 2 stages: 11.6-12.4 / 18.7-21.2 / 39-45
# Alone, one consumer warp a page for all GQA heads looked enough: more consumers only added
# merge work; short contexts stay launch- and latency-bound (~10 us).  In the whole step graph
# (docs/PERF.md 0.3, 0.9) 2 rows a copy and min_pps 2 won instead, and four consumers at long
# contexts (-0.21 ms a step at 32K: the one consumer walking a split's pages was the chain),
# one at short ones, which decode_launcher's `ppc` gives in one kernel: the engine passes
# them (nq/runtime/step.py ATTN_OPTIONS).  Six or eight consumers need more registers than
# two CTAs an SM leave (159 a thread): one CTA an SM, +0.67 ms at 32K.  Since be0e83b the step
# runs one CTA an SM on purpose -- one wave of `one_wave_splits`, four stages, every page by
# tensor map: -0.104 ms a step at 8K (docs/PERF.md 0.19); the defaults here stay the
# two-CTA grid that bench_attn and the tests take.
CONSUMERS = 1       # consumer warps = pages per stage
NSTAGE = 3          # stages of CONSUMERS pages each
ROWS_PER_COPY = 4   # token rows per cp.async.bulk (4: 2-way ldmatrix conflicts, 1/4 the copies)
MIN_PPS = 1         # fewest pages a split takes: 1 won alone (first kernel, 512 tokens: 15.7 vs
#                     20.7 us at 4); in the step graph 2 won by 0.013 ms at 512 (engine's)
CTAS_PER_SM = 2     # default max_splits = ceil(CTAS_PER_SM * n_sms / num_kv_heads): 66 for the 7B
#                     (the decode step runs one CTA an SM instead: one_wave_splits, step.py)


@functools.cache
def plan_body(max_splits: int, min_pps: int):
    """The split plan for baked-in (max_splits, min_pps): plan(length) -> (n_pages, pages per
    split, splits), the module doc's arithmetic.  A plain function: the kernels wrap it in
    `dev` (attn_split, attn_o_proj; attn_combine writes it out, combine.py
    says why), `split_plan` calls it."""
    MAXS, MINP = max_splits, min_pps

    def plan(length):
        n_pages = (length + PAGE - 1) // PAGE
        pps = max(MINP, (n_pages + MAXS - 1) // MAXS)
        return n_pages, pps, (n_pages + pps - 1) // pps

    return plan


def split_plan(length: int, max_splits: int, min_pps: int = MIN_PPS) -> tuple[int, int]:
    """(pages per split, number of splits) for a context of `length` tokens (module doc)."""
    _, pps, n_splits = plan_body(max_splits, min_pps)(length)
    return pps, n_splits


def default_max_splits(num_kv_heads: int, n_sms: int = 132, ctas_per_sm: int = CTAS_PER_SM) -> int:
    return max(1, -(-ctas_per_sm * n_sms // num_kv_heads))


SM_SMEM = 228 * 1024    # an sm_90 SM's shared memory, of which each resident CTA takes 1 KB more


def ctas_an_sm(smem: int, most: int = CTAS_PER_SM) -> int:
    """How many split CTAs of `smem` bytes of shared memory (slots and barriers) one SM holds,
    at least 1 and at most `most` (two: the registers of five warps at ~160-185 a thread)."""
    return max(1, min(most, SM_SMEM // (smem + 1024)))


def one_wave_splits(num_kv_heads: int, n_sms: int = 132, per_sm: int = 1) -> int:
    """The most splits a kv head whose CTAs all fit at once, per_sm an SM (33 for the 7B's
    d128 slots, one CTA an SM, on 132 SMs): the decode step's grid width (nq/runtime/step.py
    `split_width`, with its figures)."""
    return max(1, per_sm * n_sms // num_kv_heads)


# ---- attn_split's shared memory ------------------------------------------------------------------

def row_offset(r: int, head_dim: int, rows_per_copy: int = ROWS_PER_COPY) -> int:
    """Byte offset of token row r (0-15 K, 16-31 V) in a page slot of shared memory."""
    return r * 2 * head_dim + (r // rows_per_copy) * PAD


def page_slot_bytes(head_dim: int, rows_per_copy: int = ROWS_PER_COPY) -> int:
    return 2 * PAGE * 2 * head_dim + (2 * PAGE // rows_per_copy) * PAD


def smem_bytes(head_dim: int, consumers: int = CONSUMERS, nstage: int = NSTAGE,
               rows_per_copy: int = ROWS_PER_COPY, tma: bool = False, tma_from: int = 0) -> int:
    """Dynamic shared memory of the split kernel: nstage x consumers padded page slots (with
    tma: swizzled slots; with tma_from too: the larger of the two), plus slack to align them
    (numba declares the dynamic array `.align 4`)."""
    bulk = nstage * consumers * page_slot_bytes(head_dim, rows_per_copy) + ALIGN
    if not tma:
        return bulk
    swz = nstage * consumers * tma_slot_bytes(head_dim) + TMA_ALIGN
    return max(bulk, swz) if tma_from else swz


# ---- attn_split's shared memory with tensor-map copies (`tma`) ----------------------------------
# One tensor copy a 64-dim half of a page: a 4 KB box of 32 rows of 128 bytes (K token rows 0-15,
# then V rows 16-31, dims 64h..64h+63), 128-byte swizzled (nq/ptx/tensormap.py): chunk c of row r
# lands at chunk c ^ (r % 8), so the 8 token rows of an ldmatrix phase fall in 8 bank groups with
# no padding.  A slot is the page's halves in turn, 1024-byte aligned (the swizzle's period).
# Measured against one copy a page ([K/V][half][row], non-monotonic strides: the same or up to
# 0.005 ms slower a step) and one a page in memory order ([K/V][row][half]: rows t and t+4 of a
# phase share a bank group; 0.01-0.02 slower), and L2 promotion 0 / 256 against 128
# (docs/PERF.md 0.10); those forms are at 85f95dc.
TMA_ALIGN = 1024
TMA_HALF_BYTES = 2 * PAGE * 128     # one box: 32 rows of a 64-dim half


def tma_slot_bytes(head_dim: int) -> int:
    return 2 * PAGE * 2 * head_dim


def tma_spec(kv_layer_shape):
    """The tensor map over one layer of the KV pool (n_pages, n_kv, 2, PAGE, head_dim) fp16
    (nq/paged.py) whose box at (0, h, 0, 0, page * n_kv + kv head) is that page's half h."""
    from nq.ptx.tensormap import SWIZZLE_128B, TensorMapSpec
    n_pages, n_kv, _, _, d = kv_layer_shape
    return TensorMapSpec(dims=(64, d // 64, PAGE, 2, n_pages * n_kv),
                         strides=(128, 2 * d, 32 * d, 64 * d), box=(64, 1, PAGE, 2, 1),
                         swizzle=SWIZZLE_128B, l2_promotion=128)


def barrier_bytes(nstage: int) -> int:
    """Static shared memory of the split kernel: full[nstage], empty[nstage], merge and one
    spare mbarrier (an even count keeps the array 16 bytes long)."""
    return 8 * (2 * nstage + 2)


def cta_smem_bytes(head_dim: int, consumers: int = CONSUMERS, nstage: int = NSTAGE,
                   rows_per_copy: int = ROWS_PER_COPY, tma: bool = False,
                   tma_from: int = 0) -> int:
    """All the shared memory of one split CTA: its slots (smem_bytes) and its mbarriers --
    what decides whether it needs the opt-in and how many CTAs an SM holds (ctas_an_sm)."""
    return (smem_bytes(head_dim, consumers, nstage, rows_per_copy, tma=tma, tma_from=tma_from)
            + barrier_bytes(nstage))


# ---- partials and arguments ----------------------------------------------------------------------

def decode_workspace(cfg, max_splits: int | None = None):
    """Device partial buffers (part_acc, part_ml) for one attention call site (module doc)."""
    from numba import cuda
    ms = max_splits or default_max_splits(cfg.num_kv_heads)
    part_acc = cuda.device_array((ms, cfg.num_heads, cfg.head_dim), np.float32)  # (max_splits, Hq, D)
    part_ml = cuda.device_array((ms, cfg.num_heads, 2), np.float32)              # (max_splits, Hq, (m, l))
    return part_acc, part_ml


def check_attention_args(cfg, q, state, table, kv_layer, o, part_acc, part_ml) -> None:
    """Refuse arguments the decode kernels cannot take, with what was given and what is wanted."""
    gqa, d, hq = cfg.gqa_ratio, cfg.head_dim, cfg.num_heads
    if not 1 <= gqa <= 8:
        raise ValueError(f"attention supports 1..8 query heads per kv head, got {gqa}")
    if d not in (64, 128):
        raise ValueError(f"attention supports head_dim 64 or 128, got {d}")
    ms = part_acc.shape[0]
    want = {"q": (q, (hq * d,), np.float32), "o": (o, (hq * d,), np.float16),
            "part_acc": (part_acc, (ms, hq, d), np.float32),
            "part_ml": (part_ml, (ms, hq, 2), np.float32)}
    for name, (a, shape, dt) in want.items():
        if tuple(a.shape) != shape or a.dtype != dt:
            raise ValueError(f"attention: {name} is {a.dtype}{tuple(a.shape)}, want "
                             f"{np.dtype(dt)}{shape} (decode_workspace makes part_acc, part_ml)")
    check_paged_args("attention", cfg, kv_layer, table, state)
    from nq.ptx import SIMULATOR  # the simulator's arrays are host arrays, aligned as numpy likes
    if not SIMULATOR and kv_layer.__cuda_array_interface__["data"][0] % 128:
        raise ValueError("attention: kv_layer must be 128-byte aligned (bulk copies); pass a "
                         "layer of the pool nq/runtime/kv_cache.py allocates")
