"""CPU tier of the engine's own small kernels (feed, fill): references and sm_90 compile checks.

The engine itself needs a GPU (tests/test_engine_gpu.py); what can be checked here is that its
kernels compile for sm_90 with no local memory and that their NumPy references behave.
"""
import numpy as np

from nq.kernels import feed, fill
from nq.paged import STATE_LEN, STATE_POS, STATE_TOKEN
from ptx_util import assert_no_local_memory, compile_ptx_sm90


def test_feed_reference_inside_and_past_the_prompt():
    prompt = np.array([11, 12, 13], np.int32)
    meta = np.array([5, 3], np.int32)  # the prompt occupies positions 5, 6, 7
    state = np.zeros(STATE_LEN, np.int32)
    for pos, want in [(5, 11), (7, 13)]:
        state[STATE_POS] = pos
        feed.feed_reference(prompt, meta, state)
        assert state[STATE_TOKEN] == want
    state[STATE_POS], state[STATE_TOKEN] = 8, 99  # past the prompt: the sampled token stays
    feed.feed_reference(prompt, meta, state)
    assert state[STATE_TOKEN] == 99
    state[STATE_POS] = 4  # before the prompt (the cached context): untouched too
    feed.feed_reference(prompt, meta, state)
    assert state[STATE_TOKEN] == 99


def test_fill_hash_is_deterministic_and_spread():
    idx = np.arange(1 << 16)
    a = fill.hash_u32_reference(7, idx)
    assert a.dtype == np.uint32
    np.testing.assert_array_equal(a, fill.hash_u32_reference(7, idx))
    assert not np.array_equal(a, fill.hash_u32_reference(8, idx))
    nibbles = (a & 0xF).astype(np.int64)
    counts = np.bincount(nibbles, minlength=16)
    assert counts.min() > 0.9 * len(idx) / 16  # every INT4 value about equally likely


def test_engine_kernels_compile_for_sm90_without_local_memory():
    ptx = compile_ptx_sm90(feed.feed_body, feed.FEED_SIG)
    assert_no_local_memory(ptx)
    for fn, sig in ((fill.fill_u32_body, fill.FILL_U32_SIG),
                    (fill.fill_f16_body, fill.FILL_F16_SIG)):
        assert_no_local_memory(compile_ptx_sm90(fn, sig))


def test_retile_reference_is_the_gemv_tiling_and_compiles():
    from nq.kernels.int4 import retile
    from nq.kernels.int4.layout import chunk_permutation, tile_rows
    from ptx_util import assert_uses

    rng = np.random.default_rng(0)
    src = rng.integers(0, 2**32, (24, 3584 // 8), dtype=np.uint32)
    for ks in (1, 4, 14, 16):
        perm = chunk_permutation(3584, ks)
        np.testing.assert_array_equal(retile.retile_reference(src, perm), tile_rows(src, ks))
    ptx = compile_ptx_sm90(retile._retile, retile.RETILE_SIG)
    assert_uses(ptx, "ld.global.nc.v4.u32", "st.global.v4.u32")
    assert_no_local_memory(ptx)
    assert_no_local_memory(compile_ptx_sm90(retile._retile_mma, retile.RETILE_MMA_SIG))


RETILE_SIM = """
import numpy as np
from numba import cuda
from nq.kernels.int4 import retile
from nq.kernels.int4.layout import chunk_permutation, mma_layout
rng = np.random.default_rng(1)
# (rows, K, ks): a short last step, a one-step row
for n, k, ks in ((40, 640, 2), (37, 1152, 5), (16, 256, 2)):
    src = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32)
    perm = chunk_permutation(k, ks).astype(np.int32)
    dst = cuda.to_device(np.zeros_like(src))
    retile.retile(cuda.to_device(src), dst, cuda.to_device(perm), 0)
    want = retile.retile_reference(src, perm)
    print(f"n{n}_ks{ks}_rows", int(np.count_nonzero(dst.copy_to_host() != want)))
# the tensor-core GEMV's fragment layout: whole 16-row tiles, 1 and 3 groups a row
for n, k in ((16, 128), (48, 384)):
    src = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32)
    dst = cuda.to_device(np.zeros_like(src))
    retile.retile_mma(cuda.to_device(src), dst)
    print(f"n{n}_k{k}_mma", int(np.count_nonzero(dst.copy_to_host() != mma_layout(src))))
"""


def test_retile_kernels_under_the_simulator():
    """The re-tiling kernels (row and mma destinations) against the NumPy references."""
    from ptx_util import run_under_simulator
    errs, out = run_under_simulator(RETILE_SIM, timeout=600)
    assert len(errs) == 5 and not any(errs.values()), out
