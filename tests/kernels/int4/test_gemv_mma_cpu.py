"""The tensor-core residual GEMV (nq/kernels/int4/gemv_mma.py) without a GPU: its weight layout
against the mma fragment coordinates, its tiling and refusals, its sm_90 PTX, and the kernel
itself under the CUDA simulator against the NumPy reference."""
import textwrap

import numpy as np
import pytest

from nq.kernels.int4 import gemv_mma
from nq.kernels.int4.layout import mma_layout, mma_unlayout
from nq.kernels.int4.tiling import MmaTiling, Tiling, default_tiling, mma_tiling, one_wave_tiles
from nq.loader.quant import pack_value_shuffle
from nq.ptx.mma import a_coords

ptx_util = pytest.importorskip("ptx_util")

# nibble slot of a word -> (A register, half) of the lane's fragment (module doc of gemv_mma)
SLOTS = {0: (0, 0), 4: (0, 1), 1: (1, 0), 5: (1, 1), 2: (2, 0), 6: (2, 1), 3: (3, 0), 7: (3, 1)}


def test_layout_is_the_a_fragment_of_every_lane():
    rng = np.random.default_rng(0)
    n, k = 32, 256
    q = rng.integers(-8, 8, (n, k)).astype(np.int8)
    words = mma_layout(pack_value_shuffle(q)).reshape(-1)
    g = k // 128
    for tile in range(n // 16):
        for grp in range(g):
            for lane in range(32):
                for i in range(8):          # the k16 chunk in the group
                    w = int(words[((tile * g + grp) * 32 + lane) * 8 + i])
                    for slot, (reg, half) in SLOTS.items():
                        r, c = a_coords(lane, reg, half)
                        nib = (w >> (4 * slot)) & 0xF
                        assert nib - 16 * (nib > 7) == q[tile * 16 + r, grp * 128 + i * 16 + c]


def test_layout_round_trip_and_refusals():
    rng = np.random.default_rng(1)
    p = rng.integers(0, 2**32, (48, 384 // 8), dtype=np.uint32)
    assert np.array_equal(mma_unlayout(mma_layout(p)), p)
    with pytest.raises(ValueError, match="multiple of 16"):
        mma_layout(p[:40])
    t = MmaTiling(warps=2, threads=128)
    assert t.rows_per_block() == 32 and t.layout() == ("mma", 16) and t.tag() == "mma_w2_t128"
    assert t.layout() != Tiling(ks=2).layout()   # the two kernels never share uploaded weights
    with pytest.raises(ValueError, match="multiple of 32\\*warps"):
        gemv_mma.build_kernel("down", 64, 256, MmaTiling(warps=3, threads=128))
    with pytest.raises(ValueError, match="multiple of 16"):
        gemv_mma.build_kernel("down", 40, 256, t)
    with pytest.raises(ValueError, match="not one of"):
        gemv_mma.build_kernel("gate", 64, 256, t)
    with pytest.raises(ValueError, match="not one of"):   # qkv: the CUDA-core kernel's
        gemv_mma.build_kernel("qkv", 64, 256, t)
    with pytest.raises(ValueError, match="not an MmaTiling"):
        gemv_mma.check_tiling("down", 64, 256, Tiling(ks=2, threads=128))
    with pytest.raises(ValueError, match="shared memory of a block"):   # 227 KB: K = 116K
        gemv_mma.build_kernel("down", 64, 128 * 1000, MmaTiling(warps=16, threads=512))
    assert gemv_mma.dynamic_smem(18944) == 0                # up to the 14B: static, as measured
    assert gemv_mma.dynamic_smem(27648) == 2 * 27648        # the 32B's down: 55 KB, dynamic
    # early: each warp's slots (1 KB a group), its tiles' scale blocks, then an 8-byte
    # mbarrier a slot
    r = MmaTiling(warps=16, threads=1024, early=1)
    assert r.tag() == "mma_w16_t1024_early1" and r.layout() == ("mma", 16)
    assert gemv_mma.launch_smem(18944, r) == 32 * 1 * 1032 + 2 * 16 * 148 * 2
    assert gemv_mma.launch_smem(27648, MmaTiling(warps=12, threads=384, early=3)) \
        == 2 * 27648 + 12 * 3 * 1032 + 16 * 216 * 2
    assert gemv_mma.gemv_mma_name("down", 3584, 18944, r).endswith("_min_blocks0_early1")
    assert "early" not in gemv_mma.gemv_mma_name("down", 3584, 18944, t)   # names stand
    a = MmaTiling(warps=16, threads=1024, early=1, l2ahead=2)
    assert a.tag() == "mma_w16_t1024_early1_l2a2"
    assert gemv_mma.gemv_mma_name("down", 3584, 18944, a).endswith("_early1_l2ahead2")
    with pytest.raises(ValueError, match="l2ahead"):
        gemv_mma.build_kernel("down", 64, 256, MmaTiling(warps=2, threads=128, l2ahead=9))
    for bad in (7,):
        with pytest.raises(ValueError, match="early"):
            gemv_mma.build_kernel("down", 64, 256, MmaTiling(warps=2, threads=128, early=bad))
    with pytest.raises(ValueError, match="early"):   # o_proj and down only
        gemv_mma.build_kernel("gate_up", 64, 256, MmaTiling(2, 128, early=2), 1e-6)
    with pytest.raises(ValueError, match="a smaller early"):   # 32 warps x 6 KB + 37 KB
        gemv_mma.build_kernel("down", 3584, 18944, MmaTiling(warps=16, threads=1024, early=6))


def test_mma_tiling_rule():
    """o_proj and down from 16 groups up (the 32B's down with its activations in dynamic shared
    memory); the 7B's measured entries; gate_up's (opt-in) in test_gemv_mma_gate_up_cpu.py;
    nothing for qkv."""
    assert default_tiling("down", 3584, 18944) == MmaTiling(warps=16, threads=1024, early=1)
    assert default_tiling("o_proj", 3584, 3584) == MmaTiling(warps=14, threads=448, l2ahead=2)
    # the 14B's and 32B's down: 320 tiles, so 3 a block (107 blocks, one wave) of 10 warps
    assert mma_tiling("down", 5120, 13824) == MmaTiling(warps=10, threads=960)    # 108 groups
    assert mma_tiling("o_proj", 896, 896) is None          # 0.5B: 7 groups, the CUDA cores won
    assert mma_tiling("down", 5120, 27648) == MmaTiling(warps=10, threads=960)  # 216 groups
    assert mma_tiling("down", 5120, 13824, sms=320) == MmaTiling(warps=12, threads=384)
    # on 132 SMs the measured entries: the rule's 3 tiles a block at 8 warps a tile
    for k in (13824, 27648):   # the 14B's, the 32B's
        assert default_tiling("down", 5120, k, sms=132) == MmaTiling(8, 768, early=1)
        assert default_tiling("down", 5120, k, sms=114) == mma_tiling("down", 5120, k, sms=114)
        assert default_tiling("gate_up", k, 5120, sms=132) == MmaTiling(2, 448, l2ahead=1, i8=1)
    assert mma_tiling("down", 2048, 11008) == MmaTiling(warps=16, threads=512)  # 3B: 128 tiles
    # gate_up: 2 warps a tile, one block an SM where the tiles allow (one_wave_tiles)
    assert mma_tiling("gate_up", 13824, 5120) == MmaTiling(warps=2, threads=448)  # 864 tiles
    assert mma_tiling("gate_up", 27648, 5120) == MmaTiling(warps=2, threads=448)  # 1728: 2 waves
    assert mma_tiling("gate_up", 18944, 3584) == MmaTiling(warps=2, threads=576)  # 1184: 132
    assert mma_tiling("gate_up", 64, 2048) == MmaTiling(warps=2, threads=64)   # 4 tiles, 4 SMs
    assert mma_tiling("gate_up", 64, 256) == MmaTiling(warps=2, threads=256)   # K < 2048
    assert [one_wave_tiles(n, 132, 10) for n in (1184, 864, 1728, 688, 560, 304, 4)] == [
        9, 7, 7, 6, 5, 3, 1]
    assert one_wave_tiles(1184, 114, 10) == 6      # an H100 PCIe's 114 SMs: 198 blocks
    assert mma_tiling("qkv", 4608, 3584) is None
    assert isinstance(default_tiling("down", 3584, 18944, mma=False), Tiling)


@pytest.mark.parametrize("kind,n,k,tiling", [
    ("down", 3584, 18944, MmaTiling(warps=16, threads=1024, early=1)),   # the 7B default
    ("o_proj", 3584, 3584, MmaTiling(warps=14, threads=448)),
    ("down", 3584, 18944, MmaTiling(warps=8, threads=512)),
    ("o_proj", 3584, 3584, MmaTiling(warps=4, threads=256, min_blocks=2)),
    ("down", 5120, 27648, MmaTiling(warps=12, threads=384)),       # the 32B's, dynamic shared
    ("down", 5120, 27648, MmaTiling(warps=12, threads=384, early=3)),
    ("down", 3584, 18944, MmaTiling(warps=16, threads=1024, early=4)),   # one-shot, then registers
    ("o_proj", 3584, 3584, MmaTiling(warps=14, threads=448, early=2)),
    ("o_proj", 3584, 3584, MmaTiling(warps=14, threads=448, l2ahead=2)),
])
def test_mma_gemv_ptx_sm90(kind, n, k, tiling):
    fn, sig = gemv_mma.build_kernel(kind, n, k, tiling)
    bounds = (tiling.threads, tiling.min_blocks) if tiling.min_blocks else (tiling.threads,)
    ptx = ptx_util.compile_ptx_sm90(fn, sig, launch_bounds=bounds)
    ptx_util.assert_uses(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                         "ld.shared.v2.u32", "ld.global.nc.v4.u32", "lop3.b32",
                         "griddepcontrol.wait")
    ptx_util.assert_no_local_memory(ptx)
    if tiling.early:   # the first groups through bulk copies counted off a slot's mbarrier
        ptx_util.assert_uses(ptx, "cp.async.bulk.shared::cluster.global",
                             "mbarrier.try_wait.parity", "cp.async.wait_group")
    # l2ahead: a bulk L2 prefetch in the loop (two sites) and the prologue's; none without
    assert (ptx_util.count(ptx, "cp.async.bulk.prefetch.L2") >= 3) == bool(tiling.l2ahead)
    # one mma and four lop3 per word, eight words a group
    assert ptx_util.count(ptx, "mma.sync.aligned.m16n8k16") % 8 == 0
    assert ptx_util.count(ptx, "lop3.b32") == 4 * ptx_util.count(ptx, "mma.sync.aligned.m16n8k16")
    if not ptx_util.have_ptxas():
        pytest.skip("no nvJitLink or ptxas here: the PTX checks above stand")
    regs, spill = ptx_util.ptxas_report(ptx)   # a PTX ptxas rejects fails here
    assert spill == 0 and regs <= 128


@pytest.mark.parametrize("kind,n,k,tiling", [
    ("down", 3584, 18944, MmaTiling(warps=16, threads=1024, early=1, xacc=1, i8=1)),  # 7B
    ("down", 5120, 27648, MmaTiling(warps=8, threads=768, early=1, i8=1)),   # 32B: 128 KB
    ("o_proj", 3584, 3584, MmaTiling(warps=14, threads=448, i8=1)),
])
def test_mma_gemv_i8_ptx_sm90(kind, n, k, tiling):
    fn, sig = gemv_mma.build_kernel(kind, n, k, tiling)
    ptx = ptx_util.compile_ptx_sm90(fn, sig, launch_bounds=(tiling.threads,))
    ptx_util.assert_uses(ptx, "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32",
                         "st.shared.u8", "cvt.rni.s32.f32", "ld.shared.v4.u32")
    ptx_util.assert_no_local_memory(ptx)
    assert ptx_util.count(ptx, "mma.sync.aligned.m16n8k16") == 0
    assert ptx_util.count(ptx, "fma.rn.f16x2") == 0      # no fp16 dequant left
    # the digits, 3 bytes a value, in dynamic shared memory past 48 KB (with early's after)
    assert gemv_mma.dynamic_smem(k, tiling) == (3 * k if 3 * k > 48 * 1024 else 0)
    ptx_util.assert_one_block_an_sm(ptx, tiling.threads)


SIM_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from numba import cuda
    sys.path.insert(0, "tests")
    import sim_warp
    sim_warp.patch_simulator(syncwarp=True)
    import nq.kernels.int4.gemv_mma_weights as gw
    from nq.kernels.int4.launch import ResidualMmaGemv
    from nq.kernels.int4.reference import ref_down
    from nq.kernels.int4.tiling import MmaTiling
    from nq.loader.quant import dequantize_packed

    rng = np.random.default_rng(0)

    # (name, N, K, tiling): 2 tiles a block, 3 groups over 2 warps (warp 1's second iteration
    # is its second half, empty); 3 tiles over blocks of 2 (the last block's second tile is
    # clamped and not written); 4 warps a tile over 3 groups (one warp has none); one warp a
    # tile over 5 groups (three iterations, the last one half empty); early (the first groups
    # bulk-copied to shared memory before the wait): 3 tiles over blocks of 2, 5 groups over
    # 2 warps with 2 slots (warp 1's second slot past the last group: only arrived on), then
    # one warp's 3 slots of its 8 groups and 5 through the register loop; l2ahead: every
    # group after a warp's first asked of L2 once (the twin records what, below), beside early
    asked = sim_warp.record_l2_prefetches(gw)   # to_l2 lives in the weight path
    for name, n, k, t in [("t2_w2", 32, 384, MmaTiling(warps=2, threads=128)),
                          ("l2a3", 48, 640, MmaTiling(warps=2, threads=128, l2ahead=3)),
                          ("early_l2a2", 32, 1024, MmaTiling(warps=1, threads=64, early=3,
                                                             l2ahead=2)),
                          ("tail", 48, 384, MmaTiling(warps=2, threads=128)),
                          ("w4", 16, 384, MmaTiling(warps=4, threads=128)),
                          ("w1", 32, 640, MmaTiling(warps=1, threads=64)),
                          ("early", 48, 640, MmaTiling(warps=2, threads=128, early=2)),
                          ("early3", 32, 1024, MmaTiling(warps=1, threads=64, early=3)),
                          ("t2_w2_i8", 32, 384, MmaTiling(warps=2, threads=128, i8=1)),
                          ("w1_i8", 32, 640, MmaTiling(warps=1, threads=64, i8=1)),
                          ("early_i8", 48, 640, MmaTiling(warps=2, threads=128, early=2,
                                                          i8=1)),
                          # 3 bytes a value past 48 KB: the digits in dynamic shared memory,
                          # early's slots after them (the 7B's down with i8)
                          ("dyn_early_i8", 16, 16512, MmaTiling(warps=4, threads=128, early=1,
                                                                i8=1))]:
        qw = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
        sc = rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16)
        a = (rng.standard_normal(k) * 3).astype(np.float16)
        a[7] = 3000.0
        x = rng.standard_normal(n).astype(np.float32)
        g = ResidualMmaGemv("down", n, k, t)
        pq, ps = g.prepare([(qw, sc)])
        xd = cuda.to_device(x)
        asked.clear()
        g(cuda.to_device(a), cuda.to_device(pq), cuda.to_device(ps), xd)
        groups, first = k // 128, (t.early + 1) * t.warps
        want = {(tile, grp) for tile in range(n // 16) for grp in range(first, groups)}
        got_l2 = {divmod(i // 256, groups) for size, i, nb in asked if size == pq.size}
        assert all(nb == 1024 and i % 256 == 0 for _, i, nb in asked), asked
        assert got_l2 == (want if t.l2ahead else set()), (name, sorted(got_l2 ^ want))
        got = xd.copy_to_host().astype(np.float64)
        ref = ref_down(a, dequantize_packed(qw, sc).astype(np.float64), x.astype(np.float64))
        delta = got - x            # the dot products alone, against the reference's
        print(name, float(np.linalg.norm(delta - (ref - x)) / np.linalg.norm(ref - x)), flush=True)
    # i8: a NaN or an inf in `a` reaches every row (cvt.rni alone would hide it), as in fp16
    finite = 0
    for bad in (np.nan, np.inf):
        n, k = 32, 384
        g = ResidualMmaGemv("down", n, k, MmaTiling(warps=2, threads=128, i8=1))
        pq, ps = g.prepare([(rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32),
                             rng.uniform(0.002, 0.02, size=(n, k // 128)).astype(np.float16))])
        a = (rng.standard_normal(k) * 3).astype(np.float16)
        a[200] = bad
        xd = cuda.to_device(np.zeros(n, np.float32))
        g(cuda.to_device(a), cuda.to_device(pq), cuda.to_device(ps), xd)
        finite += int(np.isfinite(xd.copy_to_host()).sum())
    print("nonfinite_i8", finite, flush=True)
''')


@pytest.mark.slow
def test_mma_gemv_under_the_simulator():
    """The kernel (each mma a 32-thread rendezvous in the simulator) against the reference.
    fp16 activations times small integers are exact in fp32; only fp32 summation remains."""
    errs, stdout = ptx_util.run_under_simulator(SIM_SCRIPT, timeout=900)
    assert set(errs) == {"t2_w2", "l2a3", "early_l2a2", "tail", "w4", "w1", "early",
                         "early3", "t2_w2_i8", "w1_i8", "early_i8", "dyn_early_i8",
                         "nonfinite_i8"}, stdout
    assert errs.pop("nonfinite_i8") == 0   # finite rows left after a NaN / an inf in a
    for name, e in errs.items():
        assert e < 1e-5, (name, e)
