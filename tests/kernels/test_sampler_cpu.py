"""CPU tier of the device sampler: Philox against Random123's known answers, the parameter
block, the NumPy reference chain against nq/sample.py's semantics, the kernels under the CUDA
simulator against the reference, and the sm_90 PTX (no local memory, no spills)."""
import numpy as np
import pytest

from nq.kernels.philox import philox4x32_10_np, uniform_open01_np
from nq.kernels.sampler import pack_params, sample_reference, unpack_params
from nq.kernels.sampler import kernels as K
from nq.kernels.sampler.reference import (composites, history_counts, keys_of, penalize,
                                          survivors, values_of)
from nq.ptx import mul_hi_u32
from nq.sample import Sampler as HostSampler, SamplingParams

from ptx_util import assert_no_local_memory, assert_uses, compile_ptx_sm90, have_ptxas, \
    ptxas_report, run_under_simulator

# Random123 tests/kat_vectors, "philox4x32 10" lines: counter, key, output (hex words)
KAT = [("00000000 00000000 00000000 00000000", "00000000 00000000",
        "6627e8d5 e169c58d bc57ac4c 9b00dbd8"),
       ("ffffffff ffffffff ffffffff ffffffff", "ffffffff ffffffff",
        "408f276d 41c83b0e a20bc7c6 6d5451fd"),
       ("243f6a88 85a308d3 13198a2e 03707344", "a4093822 299f31d0",
        "d16cfe09 94fdcceb 5001e420 24126ea1")]


def words(text):
    return [int(w, 16) for w in text.split()]


def test_philox_twin_known_answers():
    ctr = np.array([words(c) for c, _, _ in KAT], np.uint32)
    key = np.array([words(k) for _, k, _ in KAT], np.uint32)
    np.testing.assert_array_equal(philox4x32_10_np(ctr, key),
                                  np.array([words(o) for _, _, o in KAT], np.uint32))


def test_uniform_is_open_and_exact():
    u = uniform_open01_np(np.array([0, 1, 511, 512, 2**31, 2**32 - 1], np.uint32))
    assert u.dtype == np.float32 and (u > 0).all() and (u < 1).all()
    assert u[0] == np.float32(2.0 ** -24) and u[-1] == np.float32(1 - 2.0 ** -24)
    assert np.isfinite(-np.log(-np.log(u))).all()


def test_mul_hi_twin():
    rng = np.random.default_rng(0)
    for a, b in rng.integers(0, 2**32, (100, 2), dtype=np.uint64).tolist() + [(2**32 - 1,) * 2]:
        assert int(mul_hi_u32.twin(a, b)) == (a * b) >> 32


# ---- parameters ------------------------------------------------------------------------------

def pk(**kw):
    return pack_params(valid_vocab=kw.pop("valid_vocab", 1000), max_top_k=64,
                       history_cap=128, **kw)


def test_pack_round_trip_and_greedy():
    p = unpack_params(pk(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repeat_penalty=1.05,
                         repeat_last_n=64, presence_penalty=0.5, frequency_penalty=0.25,
                         seed=2**40 + 3))
    assert p["top_k"] == 20 and p["top_p"] == np.float32(0.8) and p["window"] == 64
    assert p["log_min_p"] == np.float32(np.log(0.05)) and p["temperature"] == np.float32(0.7)
    assert (p["seed_lo"], p["seed_hi"]) == (3, 2**8)
    g = unpack_params(pk(temperature=0, top_k=50, top_p=0.5, min_p=0.3))
    assert g["top_k"] == 1 and g["top_p"] == 1 and g["log_min_p"] == -np.inf
    assert unpack_params(pk(top_k=5000))["top_k"] == 0      # >= the vocabulary: off


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=65), dict(top_p=0),
                                 dict(min_p=2), dict(repeat_penalty=0), dict(repeat_last_n=-2),
                                 dict(repeat_last_n=129), dict(seed=-1)])
def test_pack_refuses(bad):
    with pytest.raises(ValueError, match="sampling parameters"):
        pk(**bad)


# ---- the reference chain ---------------------------------------------------------------------

def distinct_logits(n, seed):
    """No ties, no near-ties: a shuffled ramp with steps of 0.05 plus a small jitter."""
    rng = np.random.default_rng(seed)
    x = np.linspace(-12, 12, n) + rng.uniform(-0.01, 0.01, n)
    return rng.permutation(x).astype(np.float32)


def test_keys_order_like_floats():
    x = np.array([-np.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, np.inf], np.float32)
    k = keys_of(x)
    assert (np.diff(k[[0, 1, 2, 3, 5, 6, 7]]) > 0).all() and k[3] == k[4]
    np.testing.assert_array_equal(values_of(k[[0, 1, 2, 4, 5, 6, 7]]), x[[0, 1, 2, 4, 5, 6, 7]])


HOST_CASES = [dict(top_k=40, top_p=1.0, min_p=0.0), dict(top_k=0, top_p=0.9, min_p=0.0),
              dict(top_k=0, top_p=1.0, min_p=0.05), dict(top_k=30, top_p=0.7, min_p=0.1),
              dict(top_k=0, top_p=0.5, min_p=0.0, repeat_penalty=1.3, repeat_last_n=6),
              dict(top_k=25, top_p=0.95, min_p=0.0, repeat_penalty=0.8, repeat_last_n=-1)]


@pytest.mark.parametrize("case", range(len(HOST_CASES)))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_survivors_equal_host_sampler(case, seed):
    """Same survivor set as nq/sample.py (llama.cpp's chain) on logits away from every cut."""
    kw = HOST_CASES[case]
    logits = distinct_logits(600, seed)
    ctx = list(np.argsort(-logits)[:12:2]) + [3, 3]
    params = pk(temperature=0.8, valid_vocab=600, **kw)
    prm = unpack_params(params)
    pen = penalize(logits, history_counts(ctx, prm["window"], 600), prm, 600)
    ids, info = survivors(pen, prm)
    assert info["p_margin"] > 1e-6, "pick another seed: this cut sits on a rounding edge"
    host = HostSampler(SamplingParams(temperature=0.8, seed=0, **kw))
    want, _ = host.distribution(logits, ctx)
    assert sorted(ids.tolist()) == sorted(want.tolist())


def test_top_k_one_is_greedy_and_padding_never_drawn():
    logits = distinct_logits(600, 5)
    logits[590:] = 1e9                   # padded rows (ids >= valid) with the largest logits
    for seed in range(20):
        params = pk(temperature=1.5, top_k=1, valid_vocab=590, seed=seed)
        tok, _ = sample_reference(logits, [1], params, seed, 590)
        assert tok == int(np.argmax(logits[:590]))
        tok, _ = sample_reference(logits, [1], pk(top_k=0, top_p=1.0, valid_vocab=590,
                                                  seed=seed), seed, 590)
        assert tok < 590


def test_greedy_ties_to_lowest_id():
    logits = np.zeros(64, np.float32)
    logits[[40, 9, 33]] = 3.0
    logits[5] = -0.0
    tok, _ = sample_reference(logits, [0], pk(temperature=0, valid_vocab=64), 0, 64)
    assert tok == 9
    assert composites(penalize(np.array([0.0, -0.0], np.float32), [0, 0],
                               unpack_params(pk()), 2), 2).argmax() == 0


def test_penalties_by_hand():
    """logit 2 / 1.5, -1 * 1.5, then - (presence + frequency * count), both window kinds."""
    logits = np.array([2.0, -1.0, 0.5, 3.0, 1.0], np.float32)
    ctx = [0, 1, 1, 3, 1]
    for window, counts in ((-1, [1, 3, 0, 1, 0]), (2, [0, 1, 0, 1, 0])):
        np.testing.assert_array_equal(history_counts(ctx, window, 5), counts)
        prm = unpack_params(pk(repeat_penalty=1.5, presence_penalty=0.25,
                               frequency_penalty=0.125, repeat_last_n=window, valid_vocab=5))
        got = penalize(logits, history_counts(ctx, window, 5), prm, 5)
        want = logits.astype(np.float64).copy()
        for i, c in enumerate(counts):
            if c:
                want[i] = want[i] / 1.5 if want[i] > 0 else want[i] * 1.5
                want[i] -= 0.25 + 0.125 * c
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert not history_counts(ctx, 0, 5).any()


# ---- the kernels under the simulator -----------------------------------------------------------

SIM_SCRIPT = r"""
import warnings
import numpy as np
from numba import cuda
warnings.simplefilter("ignore")      # numpy scalar overflow in the Philox twin's products
from nq.kernels.philox import philox4x32_10
from nq.kernels.common import dev
from nq.kernels.sampler import Sampler, sample_reference
from nq.paged import STATE_LEN, STATE_POS, STATE_STEP, STATE_TOKEN

ph = dev(philox4x32_10)

@cuda.jit
def kat(out):
    x = ph(out[0], out[1], out[2], out[3], out[4], out[5])
    for i in range(4):
        out[6 + i] = x[i]

for n, (c, k, o) in enumerate(KAT):
    a = np.array(c + k + [0] * 4, np.int64)
    d = cuda.to_device(a)
    kat[1, 1](d)
    print(f"kat{n}", int((d.copy_to_host()[6:] != np.array(o)).sum()))

V, VALID = 512, 500
s = Sampler(V, VALID, max_len=64, nb=2, threads=32, bits=5)
rng = np.random.default_rng(3)
cases = {"k20": dict(top_k=20), "k32_p": dict(top_k=32, top_p=0.95, temperature=1.2),
         "p": dict(top_k=0, top_p=0.9), "minp": dict(top_k=0, top_p=1.0, min_p=0.02),
         "all": dict(top_k=0, top_p=1.0), "greedy": dict(temperature=0),
         "pen": dict(top_k=10, repeat_penalty=1.4, presence_penalty=0.5,
                     frequency_penalty=0.25, repeat_last_n=3)}
for name, kw in cases.items():
    for rep in range(2):
        logits = (rng.standard_normal(V) * 2).astype(np.float32)
        logits[VALID:] = 1e4
        if name == "all":
            logits[:VALID:7] = 1.5          # exact ties inside the survivors: composite order
        ctx = [int(t) for t in rng.integers(0, VALID, 5)] + [7, 7]
        prm = s.pack(seed=int(rng.integers(2**63)), **kw)
        s.reset(); s.set_params(prm); s.seed_history(ctx[:-1])
        st = np.zeros(STATE_LEN, np.int32)
        step = int(rng.integers(1000))
        st[STATE_TOKEN], st[STATE_POS], st[STATE_STEP] = ctx[-1], len(ctx) - 1, step
        d_state = cuda.to_device(st)
        out = cuda.to_device(np.full(4, -1, np.int32))
        s.launch(cuda.to_device(logits), d_state, out)
        got = d_state.copy_to_host()
        want, info = sample_reference(logits, ctx, prm, step, VALID)
        ok = (got[STATE_TOKEN] == want or info["margin"] < 1e-4 or info["p_margin"] < 1e-5)
        ok = ok and got[STATE_POS] == len(ctx) and got[STATE_STEP] == step + 1
        ok = ok and out.copy_to_host()[step % 4] == got[STATE_TOKEN] and got[STATE_TOKEN] < VALID
        ok = ok and s.ctl.copy_to_host()[2] == 0          # the plan ended DONE
        ok = ok and (s.counts.copy_to_host() == np.bincount(
            ctx[-3:] if name == "pen" else ctx, minlength=V)).all()
        print(f"{name}_{rep}", int(not ok))
"""


@pytest.mark.slow
def test_kernels_under_the_simulator():
    """Philox's device body on the known answers; then every select path (levels, compaction,
    boundary with the Gumbel-max above it, ties, greedy, penalties with a window) on a
    512-token vocabulary with 32 bins, against the reference's token, plus the state contract
    and the committed history."""
    script = f"KAT = {[(words(c), words(k), words(o)) for c, k, o in KAT]!r}\n" + SIM_SCRIPT
    errs, out = run_under_simulator(script, timeout=1200)
    assert len(errs) == 3 + 14 and not any(errs.values()), out


# ---- sm_90 PTX -------------------------------------------------------------------------------

QWEN = (152064, 151665, 128, 256, 11, 4096)


@pytest.mark.parametrize("which", ["penalize", "select", "history"])
def test_ptx_sm90(which):
    fn, sig = {"penalize": (K.penalize_kernel(*QWEN), K.PENALIZE_SIG),
               "select": (K.select_kernel(*QWEN), K.SELECT_SIG),
               "history": (K.history_kernel(152064, 4096), K.HISTORY_SIG)}[which]
    ptx = compile_ptx_sm90(fn, sig)
    assert_no_local_memory(ptx)
    if which != "history":
        assert_uses(ptx, "griddepcontrol.wait", "atom.shared.add", "atom.global.exch", "bar.sync")
    if which == "select":
        assert_uses(ptx, "mul.hi.u32")
    # 64-bit shared atomics are compare-and-swap loops on sm_90 (blockops.block_max)
    assert "atom.shared.add.u64" not in ptx and "atom.shared.max.s64" not in ptx
    if not have_ptxas():
        pytest.skip("no ptxas / nvJitLink here")
    regs, spills = ptxas_report(ptx)
    assert spills == 0 and regs <= 255, (regs, spills)


def test_pass_count_covers_the_worst_case():
    """n_select_passes: the deepest plan (all ties) resolves before the last select launch."""
    for vocab, bits in ((152064, 11), (512, 5), (2048, 6)):
        w = 32 + (vocab - 1).bit_length()
        assert w - bits * (K.n_select_passes(vocab, bits) - 1) <= bits
