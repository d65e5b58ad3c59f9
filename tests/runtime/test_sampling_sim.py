"""The engine's sampled path with the real device sampler under the CUDA simulator (CPU).

The engine is nq.runtime.engine.Engine with simulator arrays and a toy model in place of the
transformer (its logits a fixed function of token and position, padded ids at 1e4); the
sampler is the real Sampler (its kernels at 2 blocks of 32 threads, 32 bins) inside
nq.runtime.sampling.DeviceSampling, eager (the simulator has no graphs).  What this adds to
test_sampling_host.py: the real kernels and numba's array API behind the bookkeeping (prompt
appended from the device prompt buffer, host catch-up uploads, truncate, reset), checked
against the NumPy reference's tokens and count table.  The GPU twin is test_sampling_gpu.py.
"""
import pytest

from ptx_util import run_under_simulator

SCRIPT = r"""
import warnings
import numpy as np
from numba import cuda
warnings.simplefilter("ignore")      # numpy scalar overflow in the Philox twin's products
import nq.runtime.engine as E
from nq.generate import generate
from nq.kernels.feed import feed_reference
from nq.kernels.sampler import Sampler, sample_reference
from nq.kernels.sampler.reference import history_counts
from nq.paged import STATE_LEN, STATE_POS, STATE_STEP, STATE_TOKEN, pages_for
from nq.runtime.kv_cache import PageAllocator, Sequence
from nq.runtime.sampling import DeviceSampling
from nq.sample import SamplingParams


class Event:
    def record(self, stream):
        pass

    def synchronize(self):
        pass


cuda.event = lambda timing=False: Event()
V, VALID, MAX = 512, 500, 64


def toy_logits(tok, pos):
    i = np.arange(V)
    x = (np.sin(i * 0.37 + tok * 1.3 + pos * 0.11) * 2.0).astype(np.float32)
    x[(tok * 7 + pos) % VALID] += 3.0
    x[VALID:] = 1e4
    return x


e = E.Engine.__new__(E.Engine)
e.max_len, e.stream = MAX, cuda.stream()
e.alloc = PageAllocator(pages_for(MAX) + 1)
e.seq = Sequence(max_pages=pages_for(MAX))
e.d_table = cuda.to_device(e.seq.table)
e.state = cuda.to_device(np.zeros(STATE_LEN, np.int32))
e.out_ids, e.prompt = cuda.device_array(MAX, np.int32), cuda.device_array(MAX, np.int32)
e.feed_meta, e.logits = cuda.to_device(np.zeros(2, np.int32)), cuda.device_array(V, np.float32)
e._h_state, e._h_tok = np.zeros(STATE_LEN, np.int32), cuda.pinned_array(2, np.int32)
e.graph, e.pdl, e.startup, e.prefiller = None, True, {}, None
e._ids, e.valid_vocab = np.full(MAX, -1, np.int32), VALID


def model(st):
    s, meta, prompt = e.state.copy_to_host(), e.feed_meta.copy_to_host(), e.prompt.copy_to_host()
    feed_reference(prompt, meta, s)
    e.state.copy_to_device(s)
    e.logits.copy_to_device(toy_logits(int(s[STATE_TOKEN]), int(s[STATE_POS])))


def argmax(st):
    s, out = e.state.copy_to_host(), e.out_ids.copy_to_host()
    t = int(np.argmax(e.logits.copy_to_host()[:VALID]))
    out[s[STATE_STEP] % MAX] = t
    s[STATE_TOKEN], s[STATE_POS], s[STATE_STEP] = t, s[STATE_POS] + 1, s[STATE_STEP] + 1
    e.state.copy_to_device(s)
    e.out_ids.copy_to_device(out)


e.steps = [("embed", model), ("sample", argmax)]
e.sampling = DeviceSampling(e, Sampler(V, VALID, max_len=MAX, nb=2, threads=32, bits=5))
e.reset()


def check_tokens(name, context, prompt_len, got, params):
    # teacher-forced: each token against the reference over the engine's own context
    block = e.sampling._params
    ctx, bad = list(context), 0
    for k, t in enumerate(got):
        want, info = sample_reference(toy_logits(ctx[-1], len(ctx) - 1), ctx, block,
                                      prompt_len - 1 + k, VALID)
        if t != want and not (info["margin"] < 1e-4 or info["p_margin"] < 1e-5):
            bad += 1
        ctx.append(t)
    print(name, bad + int(max(got) >= VALID))


def check_history(name, ids):
    s = e.sampling.sampler
    window = int(e.sampling._params[7])
    ok = (s.history_length() == len(ids) == e.length == e.sampling.hist_n
          and (s.counts.copy_to_host() == history_counts(ids, window, V)).all()
          and (s.ctx.copy_to_host()[:len(ids)] == np.asarray(ids)).all())
    print(name, int(not ok))


whole = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.0, repeat_penalty=1.5,
                       repeat_last_n=-1, seed=3)
window = SamplingParams(temperature=1.1, top_k=0, top_p=0.95, min_p=0.0, repeat_penalty=2.0,
                        repeat_last_n=3, presence_penalty=0.5, frequency_penalty=0.25, seed=8)
greedy = SamplingParams(temperature=0.0, repeat_penalty=1.0)
prompt = [3, 4, 5, 6, 7]
first = list(e.generate_ids(prompt, 6, whole))
check_tokens("tokens_whole", prompt, 5, first, whole)
check_history("history_after_generation", prompt + first[:-1])
e.reset()
check_history("history_after_reset", [])
out, stats = generate(e, prompt, 6, whole, stop_ids=[first[2]])
print("seed_reproduces", int(out != first[:first.index(first[2]) + 1]))
check_history("history_after_stop", prompt + out[:-1])
e.truncate(6)
check_history("history_after_truncate", prompt + out[:1])
ctx = prompt + out[:1]
g = list(e.generate_ids([9], 3, greedy))      # the argmax step: no history upkeep
ctx += [9] + g[:-1]
s = list(e.generate_ids([1, 2], 5, window))   # catch-up upload, then the prompt from the device
check_tokens("tokens_window_after_greedy", ctx + [1, 2], 2, s, window)
check_history("history_window", ctx + [1, 2] + s[:-1])
"""


@pytest.mark.slow
def test_sampled_engine_path_under_the_simulator():
    errs, out = run_under_simulator(SCRIPT, timeout=1800)
    assert len(errs) == 8 and not any(errs.values()), out
