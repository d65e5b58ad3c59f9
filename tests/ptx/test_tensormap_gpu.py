"""cp.async.bulk.tensor on the H200 against its twin's model (nq/ptx/tensormap.py): the driver
encodes the attention's tensor maps (plan.tma_spec), the copy engine moves a page of a KV pool
into 1024-byte aligned shared memory, and every byte lands where box_bytes + swizzle_128b say."""
import numpy as np
import pytest

from nq.kernels.attention import plan
from nq.paged import PAGE

pytestmark = pytest.mark.gpu


def _kernel(d: int):
    from numba import cuda
    from numba.cuda.types import uint32, uint64

    import nq.ptx as P
    slot = plan.tma_slot_bytes(d)
    words = slot // 4
    halves = d // 64
    half = plan.TMA_HALF_BYTES

    @cuda.jit
    def k(tmap, pk, out):
        sm = cuda.shared.array(words, uint32, alignment=1024)
        bars = cuda.shared.array(2, uint64, alignment=16)
        tid = cuda.threadIdx.x
        base = P.cvta_to_shared_u32(sm)
        bar = P.cvta_to_shared_u32(bars)
        if tid == 0:
            P.mbarrier_init(bar, 1)
            P.fence_mbarrier_init()
        cuda.syncthreads()
        if tid == 0:
            P.mbarrier_arrive_expect_tx(bar, slot)
            for hf in range(halves):
                P.cp_async_bulk_tensor_5d_g2s(base + hf * half, tmap, 0, hf, 0, 0, pk[0], bar)
        P.mbarrier_wait_parity(bar, 0)
        for i in range(tid, words, cuda.blockDim.x):
            out[i] = sm[i]
    return k


@pytest.mark.parametrize("d", [64, 128])
def test_tensor_copy_of_a_page_matches_the_twin(d):
    from numba import cuda

    from nq.ptx.tensormap import box_bytes, encode, swizzle_128b
    rng = np.random.default_rng(d)
    n_pages, n_kv = 9, 4
    pool = rng.standard_normal((n_pages, n_kv, 2, PAGE, d)).astype(np.float16)
    dpool = cuda.to_device(pool)
    spec = plan.tma_spec(pool.shape)
    tmap = encode(dpool, spec)
    slot = plan.tma_slot_bytes(d)
    for pid, kvh in ((0, 0), (5, 3), (8, 1)):
        pk = pid * n_kv + kvh
        out = cuda.device_array(slot // 4, np.uint32)
        _kernel(d)[1, 128](tmap, cuda.to_device(np.array([pk], np.int32)), out)
        got = out.copy_to_host().view(np.uint8)
        want = np.zeros(slot, np.uint8)
        for hf in range(d // 64):
            data = box_bytes(pool, spec, (0, hf, 0, 0, pk))
            n = len(data)
            for i, o in enumerate(swizzle_128b(np.arange(0, n, 16))):
                want[hf * n + o:hf * n + o + 16] = data[16 * i:16 * i + 16]
        np.testing.assert_array_equal(got, want)
