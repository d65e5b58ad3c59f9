"""wgmma (nq/ptx/wgmma.py) on the H200: one warpgroup, one 64 x N x 32 product (two k16 steps,
scale-d 0 then 1) with B -- and A for the "ss" form -- read from shared memory through matrix
descriptors, against NumPy, bit for bit (the operands make every sum exact in fp32).

This is what says the descriptor fields, the swizzle model (`smem_offset`) and the fragment
layouts are read as the hardware reads them; a failure prints which D elements differ.  The
layouts: swizzle none with LBO = 128 (the core matrices along K) and SBO = 512 (along M/N), and
the 128B swizzle the GEMM uses (nq/kernels/int4/gemm_wgmma.py)."""
import numpy as np
import pytest

import wgmma_probe as W
from nq.ptx.wgmma import SWIZZLE_128B, SWIZZLE_NONE

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("swizzle", [SWIZZLE_NONE, SWIZZLE_128B], ids=["none", "128B"])
@pytest.mark.parametrize("form", ["rs", "ss"])
@pytest.mark.parametrize("n", [64, 128, 256])
def test_wgmma_tile_matches_numpy(n, form, swizzle):
    got, want = W.run(n, form, swizzle, seed=n + (form == "ss"))
    assert np.array_equal(got, want), (
        f"m64n{n}k16 {form} swizzle {'none' if swizzle == SWIZZLE_NONE else '128B'}:\n"
        + W.describe_mismatch(got, want))
