"""Sampling on the device, inside the captured decode graph: penalties, top-k, top-p, min-p,
temperature and a seeded draw over the fp32 logits (vocab,), where argmax used to stand.

Why: copying 152,064 logits to the host and sampling in NumPy made the Instruct model's default
sampling run at 232 tok/s where greedy ran at 534.  Here a sampled token costs ~28 us of GPU
time inside the step and no host round trip.

The chain (nq/sample.py's, i.e. llama.cpp's order and meaning):
  1. penalties   every id in the history window: repetition (/p if logit > 0 else *p), then
                 logit -= presence * [count > 0] + frequency * count.  The window is the last N
                 context tokens (llama.cpp) or, N = -1, the whole context (transformers).
  2. top-k       the k first by (logit desc, id asc) -- ties go to the lower id
  3. top-p       the shortest prefix whose mass (softmax at temperature 1 over the top-k
                 survivors, or over every id when top-k is off) reaches p
  4. min-p       logit >= max + log(min_p)
  5. temperature the survivors' logits / T
  6. draw        Gumbel-max: argmax over survivors of logit / T - log(-log(u_id)), u_id from
                 Philox4x32-10 keyed by the seed, counter (id / 4, step, pos, 0).  Exactly a
                 draw from softmax(logit / T) over the survivors, needs no sorted order and no
                 prefix sum (so it also works over 100k survivors), and each id's noise is its
                 own: the same seed and prompt give the same tokens, graph or eager.
Ids >= valid_vocab (the padded lm_head rows) are never read.  Temperature 0 is packed as
top-k 1: argmax of the penalised logits, lowest id on ties, bit for bit.

Selection without a sort: a radix select over one 64-bit composite key per id,
    composite = (order-preserving key of the fp32 logit) << 18 | (2^18 - 1 - id),
unique and ordered exactly as the chain ranks ids (50 bits for 152,064 ids).  Digits of 11 bits
(2,048 bins); the histogram of one digit, over the ids that share the digits above it, is one
level.  Each level's last block scans the bins from the top and finds the bin holding the cut:
the count reaching k (top-k on), the quantised mass reaching p * Z (top-k off; masses are
floor(exp(l - max) * 2^40) in int64, added with integer atomics, so sums are exact and
independent of order -- the step is deterministic), or the bin holding max + log(min_p).  Once
the bins above plus the cut bin hold at most 2,048 ids, one pass compacts them and its last
block bitonic-sorts them in shared memory and applies top-k, top-p, min-p and the draw exactly.
With top-k off the survivors can be far more than 2,048: then only the cut bin is compacted,
while every block draws the Gumbel-max of the ids above it (all survivors) on the way.

Launches a step (one graph node each, programmatic edges, every kernel waits first):
    penalize  1 x (128 x 256)  reads logits + counts (1.2 MB), writes pen (0.6 MB); block max;
                                top digit's count histogram (top-k on); its last block
                                commits the history change and writes the first plan
    select    5 x (128 x 256)  each reads the plan: a level (reads pen, 0.6 MB, from L2), the
                                final compaction, the boundary pass, or nothing (~1 us).
                                5 covers the worst case (every id tied: all 50 key bits
                                resolved); real logits need 1 (top-k on) to 3 (top-k off)
Bytes are not the cost (2-3 MB from L2 is ~1 us of the chip); the launches and the
last-block tails are, so the design counts kernels: 2 doing work at the defaults.
Measured on the H200 (scripts/bench_sampler.py, graph replays with PDL edges, 152,064 logits,
2026-12-01): argmax 4.8 us; Qwen defaults (T 0.7, k 20, p 0.8, rep 1.05) 27.7 us; greedy
through the sampler 25.7 us; top-p 0.95 with top-k off 38.7 us; min-p 0.05 37.7 us; nothing cut
27.3 us; top-k 1000 52.1 us; an idle select launch 1.07 us.  ncu (each kernel alone, so launch
latency included) at the defaults: penalize 11.4 us (10.3 in a graph), the compacting select
14.9 us, each idle select 2.5 us.  What the time is: the last blocks' serial tails (a ticket,
~10 dependent L2 round trips, a dozen __syncthreads), not bytes.
Lost experiments: 64-bit shared atomics for block maxima and bin masses (compare-and-swap loops
on sm_90): a top-k-off level 22.1 -> 17.5 us without them; integer division in the bitonic
network's index math: top-k 1000 105 -> 52 us without it (both in commit history).

Penalty history: counts (vocab,) int32 and ctx (max_len,) int32, the context's tokens by
position.  A step's input token (state.token, at state.pos) enters the history in that step:
the penalize pass applies +1 (and -1 for the token leaving a window, ctx[pos - N]) on the fly,
and its last block commits both once every block has read the table -- no step scans the
history.  A position enters only once (pos == the history length), so replaying positions
already entered (seeded, or a chat turn re-fed) changes nothing.  Host-side changes (reset,
seed_history, append_history after a batched prefill, truncate_history, a new window) rebuild
the table from ctx with two small kernels: O(context) once, outside the step.

Layout: params.py (the parameter block), reference.py (the NumPy chain and its tolerances),
blockops.py (shared-memory scan, max and sort), plan.py (the passes' shared state, masses,
scores, the level planner), kernels.py (the passes), launcher.py (Sampler, and how an engine
drives it).
"""
from nq.kernels.sampler.launcher import Sampler, make_sampler
from nq.kernels.sampler.params import (PARAMS_LEN, from_sampling_params, pack_params,
                                       unpack_params)
from nq.kernels.sampler.reference import filtered_distribution, sample_reference

__all__ = ["Sampler", "make_sampler", "PARAMS_LEN", "pack_params", "unpack_params",
           "from_sampling_params", "sample_reference", "filtered_distribution"]
