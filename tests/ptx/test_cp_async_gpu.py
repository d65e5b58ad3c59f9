"""cp.async (nq/ptx/async_copy.py) on the GPU against its twin: a two-stage ring of 16-byte copies,
some zero-filled, into an XOR-swizzled tile, read back by ordinary loads."""
import numpy as np
import pytest
from numba import cuda

import nq.ptx as P

pytestmark = pytest.mark.gpu

CHUNKS = 64  # 16-byte chunks a stage: one per thread
TILE_WORDS = 2 * CHUNKS * 4
ALIGN = None if P.SIMULATOR else 16  # the simulator refuses alignment=; None suits both


@cuda.jit
def k_cp_async_ring(src, keep, out):
    tile = cuda.shared.array(TILE_WORDS, dtype=np.uint32, alignment=ALIGN)
    tid = cuda.threadIdx.x
    base = P.cvta_to_shared_u32(tile)
    for s in range(2):  # both stages in flight, then waited for one group at a time
        slot = s * CHUNKS + (tid ^ (tid // 8 % 8))
        if s == 0:
            P.cp_async_cg_shared_global_16_zfill(base + 16 * slot, src, 4 * (s * CHUNKS + tid), 16 * keep[tid])
        else:     # the byte-offset form: the same element, named in bytes
            P.cp_async_cg_shared_global_16_zfill_off(base + 16 * slot, src, 16 * (s * CHUNKS + tid),
                                                     16 * keep[tid])
        P.cp_async_commit_group()
    P.cp_async_wait_group(1)
    cuda.syncthreads()
    for j in range(4):
        out[4 * tid + j] = tile[4 * (tid ^ (tid // 8 % 8)) + j]
    P.cp_async_wait_group(0)
    cuda.syncthreads()
    for j in range(4):
        out[4 * (CHUNKS + tid) + j] = tile[4 * (CHUNKS + (tid ^ (tid // 8 % 8))) + j]


def test_cp_async_ring_matches_the_twin():
    rng = np.random.default_rng(3)
    src = rng.integers(0, 2**32, 2 * CHUNKS * 4, dtype=np.uint64).astype(np.uint32)
    keep = rng.integers(0, 2, CHUNKS).astype(np.uint32)
    out = cuda.to_device(np.full(2 * CHUNKS * 4, 0xFFFFFFFF, np.uint32))
    k_cp_async_ring[1, CHUNKS](cuda.to_device(src), cuda.to_device(keep), out)
    want = src.reshape(2, CHUNKS, 4) * keep[None, :, None]
    np.testing.assert_array_equal(out.copy_to_host(), want.reshape(-1))
