"""Every nq.ptx wrapper compiles for sm_90 on a machine with no GPU, emits the instruction it
promises, inline (no call), and leaves no local-memory traffic behind."""
import numpy as np
import pytest
from numba import cuda, uint32, uint64
from numba.core.errors import TypingError

import nq.ptx as P
from nq.ptx import LUT_AND_XOR
from ptx_util import (assert_no_local_memory, assert_uses, compile_ptx_sm90, count, have_ptxas,
                      ptxas_report)

pytestmark = pytest.mark.skipif(P.SIMULATOR, reason="the simulator compiles nothing")

U32 = "uint32[::1]"


def gemv_set(w, x, out, o16):
    i = cuda.threadIdx.x
    a, b, c, d = P.ld_global_nc_v4_u32(w, i * 4)
    e, f, g, h = P.ld_global_nc_na_v4_u32(w, i * 4)
    e2, f2, g2, h2 = P.ld_global_nc_hint_v4_u32(w, i * 4, P.createpolicy_evict_first_b64())
    y = P.prmt_b32(a, b, 0x5410)
    z = P.lop3_b32(y, 0x000F000F, 0x64086408, LUT_AND_XOR)
    t = P.fma_rn_f16x2(z, e ^ e2, f + f2)
    t = P.mul_rn_f16x2(t, g ^ g2)
    t = P.add_rn_f16x2(t, h + h2 + c + d)
    lo, hi = P.unpack_f16x2_to_f32(t)
    p = P.pack_f16x2_from_f32(lo + x[i], hi)
    q = P.cvt_rn_f16_f32(x[i])
    o16[i] = P.cvt_rn_f16_f32(P.cvt_f32_f16(q) * 2)
    P.st_global_v4_u32(out, i * 4, p, y, z, uint32(q))


@pytest.fixture(scope="module")
def gemv_ptx():
    return compile_ptx_sm90(gemv_set, f"void({U32}, float32[::1], {U32}, uint16[::1])")


@pytest.mark.parametrize("instruction,times", [
    ("ld.global.nc.v4.u32", 1),
    ("ld.global.nc.L1::no_allocate.L2::256B.v4.u32", 1),
    ("createpolicy.fractional.L2::evict_first.b64", 1),
    ("ld.global.nc.L2::cache_hint.v4.u32", 1),
    ("prmt.b32", 1),
    ("lop3.b32", 1),
    ("fma.rn.f16x2", 1),
    ("mul.rn.f16x2", 1),
    ("add.rn.f16x2", 1),
    ("cvt.rn.f16x2.f32", 1),
    ("cvt.rn.f16.f32", 2),
    ("cvt.f32.f16", 3),   # two from unpack, one from cvt_f32_f16
    ("st.global.v4.u32", 1),
])
def test_gemv_set_emits_each_instruction_inline(gemv_ptx, instruction, times):
    assert_uses(gemv_ptx, instruction)
    assert count(gemv_ptx, instruction) == times
    assert "call.uni" not in gemv_ptx and count(gemv_ptx, "call") == 0


needs_ptxas = pytest.mark.skipif(not have_ptxas(), reason="neither nvJitLink (cuda.core) nor ptxas")


def test_gemv_set_has_no_local_memory(gemv_ptx):
    assert_no_local_memory(gemv_ptx)


@needs_ptxas
def test_gemv_set_assembles_for_sm90_without_spills(gemv_ptx):
    regs, spill_bytes = ptxas_report(gemv_ptx)
    assert spill_bytes == 0
    assert 0 < regs <= 64


def test_lop3_lut_is_an_immediate(gemv_ptx):
    # LUT_AND_XOR == 0x6A == 106 spliced into the instruction, not a register
    assert "lop3.b32" in gemv_ptx and ", 106;" in gemv_ptx


def test_lop3_rejects_a_runtime_lut():
    def k(out, lut):
        out[0] = P.lop3_b32(out[0], out[1], out[2], lut[0])

    with pytest.raises(TypingError, match="must be a compile-time integer constant"):
        compile_ptx_sm90(k, f"void({U32}, {U32})")

    def via_module_attribute(out):
        out[0] = P.lop3_b32(out[0], out[1], out[2], P.LUT_AND_XOR)

    with pytest.raises(TypingError, match="imported by name"):
        compile_ptx_sm90(via_module_attribute, f"void({U32})")


def test_lop3_accepts_a_closure_constant():
    lut = 0x96

    def k(out):
        out[0] = P.lop3_b32(out[0], out[1], out[2], lut)

    assert ", 150;" in compile_ptx_sm90(k, f"void({U32})")


def test_loads_take_nd_arrays_and_tuple_indices():
    def k(w, out):
        i = cuda.threadIdx.x
        a, b, c, d = P.ld_global_nc_v4_u32(w, (i, 4))
        P.st_global_v4_u32(out, (i, 0), d, c, b, a)

    ptx = compile_ptx_sm90(k, "void(uint32[:, ::1], uint32[:, ::1])")
    assert_uses(ptx, "ld.global.nc.v4.u32", "st.global.v4.u32")
    assert_no_local_memory(ptx)


def test_pure_loads_are_merged_but_stores_are_not():
    # ld.global.nc is pure asm (read-only data): two identical loads become one.  A store is
    # volatile with a memory clobber: two identical stores both stay.
    def k(w, out):
        a, b, c, d = P.ld_global_nc_v4_u32(w, 0)
        e, f, g, h = P.ld_global_nc_v4_u32(w, 0)
        P.st_global_v4_u32(out, 0, a + e, b + f, c + g, d + h)
        P.st_global_v4_u32(out, 0, a + e, b + f, c + g, d + h)

    ptx = compile_ptx_sm90(k, f"void({U32}, {U32})")
    assert count(ptx, "ld.global.nc.v4.u32") == 1
    assert count(ptx, "st.global.v4.u32") == 2


def test_wrappers_inside_a_device_function():
    # kernels call wrappers from device functions too; compile_ptx_sm90 stubs the device lookup
    @cuda.jit(device=True)
    def dequant_pair(word, s2):
        v = P.lop3_b32(word, 0x000F000F, 0x64086408, LUT_AND_XOR)
        return P.fma_rn_f16x2(v, s2, 0xE408E408)

    def k(w, out):
        i = cuda.threadIdx.x
        out[i] = dequant_pair(w[i], w[i + 1])

    ptx = compile_ptx_sm90(k, f"void({U32}, {U32})")
    assert_uses(ptx, "lop3.b32", "fma.rn.f16x2")
    assert_no_local_memory(ptx)


def pipeline_set(w, out, f):
    tile = cuda.shared.array(2048, dtype=np.uint32, alignment=128)
    bars = cuda.shared.array(2, dtype=np.uint64, alignment=8)
    sbase = P.cvta_to_shared_u32(tile)
    bar = P.cvta_to_shared_u32(bars)
    tid = cuda.threadIdx.x
    if tid == 0:
        P.mbarrier_init(bar, 1)
        P.mbarrier_init(bar + 8, 1)
        P.fence_mbarrier_init()
    cuda.syncthreads()
    if tid == 0:
        P.fence_proxy_async_shared()
        P.mbarrier_arrive_expect_tx(bar, 8192)
        P.cp_async_bulk_g2s(sbase, w, 0, 4096, bar)
        P.cp_async_bulk_g2s_hint(sbase + 4096, w, 1024, 4096, bar,
                                 P.createpolicy_evict_first_b64())
        out[1] = np.int32(P.mbarrier_arrive(bar + 8))
    while not P.mbarrier_try_wait_parity(bar, 0):
        pass
    P.mbarrier_wait_parity(bar + 8, 0)
    lane = tid % 32
    a0, a1, a2, a3 = P.ldmatrix_x4(sbase + (lane % 16) * 32 + (lane // 16) * 16)
    b0, b1, b2, b3 = P.ldmatrix_x4_trans(sbase + 1024 + lane * 16)
    d0, d1, d2, d3 = P.mma_sync_m16n8k16_f16_f32(a0, a1, a2, a3, b0, b1, f[0], f[1], f[2], f[3])
    d0, d1, d2, d3 = P.mma_sync_m16n8k16_f16_f32(a0, a1, a2, a3, b2, b3, d0, d1, d2, d3)
    f[4 * tid] = d0
    f[4 * tid + 1] = d1
    f[4 * tid + 2] = d2
    f[4 * tid + 3] = d3
    out[tid] = P.dp4a_s32(a0, b0, 5)


@pytest.fixture(scope="module")
def pipeline_ptx():
    return compile_ptx_sm90(pipeline_set, "void(uint32[::1], int32[::1], float32[::1])")


@pytest.mark.parametrize("instruction,times", [
    ("cvta.to.shared.u64", 2),
    ("mbarrier.init.shared::cta.b64", 2),
    ("fence.mbarrier_init.release.cluster", 1),
    ("fence.proxy.async.shared::cta", 1),
    ("mbarrier.arrive.expect_tx.shared::cta.b64", 1),
    ("mbarrier.arrive.shared::cta.b64", 1),
    ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", 2),
    ("mbarrier.try_wait.parity.shared::cta.b64", None),  # the polling loop may be rotated
    ("ldmatrix.sync.aligned.m8n8.x4.shared.b16", 1),
    ("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", 1),
    ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", 2),
    ("dp4a.s32.s32", 1),
])
def test_pipeline_set_emits_each_instruction_inline(pipeline_ptx, instruction, times):
    assert_uses(pipeline_ptx, instruction)
    if times is not None:
        assert count(pipeline_ptx, instruction) == times
    assert count(pipeline_ptx, "call") == 0


def test_pipeline_set_has_no_local_memory(pipeline_ptx):
    assert_no_local_memory(pipeline_ptx)


@needs_ptxas
def test_pipeline_set_assembles_for_sm90_without_spills(pipeline_ptx):
    # also the check that every template is valid sm_90 PTX (the `_` sink of arrive.expect_tx,
    # the braces-scoped wait label inlined twice, the .L2::cache_hint operand order)
    regs, spill_bytes = ptxas_report(pipeline_ptx)
    assert spill_bytes == 0 and 0 < regs <= 64


@needs_ptxas
def test_blocking_wait_inlines_many_times():
    def k(out):
        bars = cuda.shared.array(2, dtype=np.uint64)
        bar = P.cvta_to_shared_u32(bars)
        P.mbarrier_wait_parity(bar, 0)
        P.mbarrier_wait_parity(bar + 8, 1)
        P.mbarrier_wait_parity(bar, 1)
        out[0] = 1

    ptx = compile_ptx_sm90(k, "void(int32[::1])")
    assert ptx.count("nq_wait:") == 3
    ptxas_report(ptx)  # raises if the duplicated labels clash


def extras_set(w, h, f, out, o16):
    P.griddepcontrol_launch_dependents()
    tile = cuda.shared.array((4, 8), dtype=np.uint32, alignment=16)
    P.cp_async_bulk_prefetch_l2(w, 0, 64)
    P.griddepcontrol_wait()
    i = cuda.threadIdx.x
    ftile = cuda.shared.array(8, dtype=np.float32, alignment=16)
    tile[i // 8, i % 8] = w[i]
    if i < 8:
        ftile[i] = f[i]
    ctile = cuda.shared.array(64, dtype=np.uint32, alignment=16)
    P.cp_async_cg_shared_global_16_zfill(P.cvta_to_shared_u32(ctile) + 16 * (i % 16), w, 4 * (i % 16), 16 * (i % 2))
    P.cp_async_cg_shared_global_16_zfill_off(P.cvta_to_shared_u32(ctile) + 16 * (i % 16), w, 16 * (i % 16), 16)
    P.cp_async_commit_group()
    P.cp_async_wait_group(0)
    cuda.syncthreads()
    a3 = ctile[i % 64]
    a, b, c, d = P.ld_shared_v4_u32(tile, (i // 8, 4 * (i % 2)))
    a2, b2, c2, d2 = P.ld_shared_v4_u32_at(P.cvta_to_shared_u32(tile) + 16 * (i % 8))
    a += a2 ^ b2 ^ c2 ^ d2
    e2, f2 = P.ld_shared_v2_u32_at(P.cvta_to_shared_u32(tile) + 8 * (i % 16))
    a += e2 - f2
    a += P.mul_hi_u32(a, f2)
    e, g = P.ld_global_nc_v2_u32(w, 2 * i)
    e += P.ld_global_nc_u32(w, i)
    x0, x1, x2, x3 = P.ld_global_nc_v4_f32(f, 4 * i)
    y0, y1, y2, y3 = P.ld_shared_v4_f32(ftile, 4 * (i % 2))
    x0 += y0 + y1 + y2 + y3
    z0, z1 = P.ld_global_nc_v2_f32(f, 2 * i)
    x1 += z0 * z1
    hb = P.ld_global_nc_u16(h, i)
    bits = P.mov_b32_u32_from_f32(x0 + x1 + x2 + x3)
    tick = P.clock64()
    out[i] = a + b + c + d + e + g + bits + P.cvta_to_shared_u32_at(tile, (1, 2)) + a3 \
        + (P.clock64() - tick > 1 << 40)
    P.st_global_u16(o16, i, P.cvt_rn_f16_f32(P.mov_b32_f32_from_u32(bits) + P.cvt_f32_f16(hb)))
    m0, m1, m2, m3 = P.mma_sync_m16n8k32_s8_s32(a, b, c, d, e, g, P.cvt_rni_s32_f32(x0), 1, 2, 3)
    out[i + 32] = m0 + m1 + m2 + m3
    P.st_shared_u8_at(P.cvta_to_shared_u32(ctile) + i, m0)


@pytest.fixture(scope="module")
def extras_ptx():
    return compile_ptx_sm90(extras_set, f"void({U32}, float16[::1], float32[::1], {U32}, "
                                        f"float16[::1])")


@pytest.mark.parametrize("instruction", [
    "ld.shared.v4.u32", "ld.shared.v4.f32", "ld.global.nc.v2.u32", "ld.global.nc.v2.f32",
    "ld.global.nc.v4.f32", "ld.global.nc.u16", "ld.global.nc.u32",
    "st.global.u16", "mov.b32", "cvta.to.shared.u64", "griddepcontrol.wait",
    "griddepcontrol.launch_dependents", "cp.async.bulk.prefetch.L2.global", "mul.hi.u32",
    "cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group", "%clock64",
    "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32", "cvt.rni.s32.f32", "st.shared.u8",
])
def test_extras_emit_each_instruction(extras_ptx, instruction):
    assert_uses(extras_ptx, instruction)
    assert_no_local_memory(extras_ptx)
    assert count(extras_ptx, "call") == 0


def cluster_set(out):
    # each CTA writes its rank to shared memory; after the cluster barrier a thread reads the
    # next rank's value through distributed shared memory
    cell = cuda.shared.array(1, dtype=np.float32)
    r = P.cluster_ctarank()
    if cuda.threadIdx.x == 0:
        cell[0] = np.float32(r)
    P.barrier_cluster_sync()
    peer = P.mapa_shared_cluster_u32(P.cvta_to_shared_u32(cell), (r + 1) % 2)
    out[cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x] = P.ld_shared_cluster_f32(peer)
    P.barrier_cluster_sync()


@pytest.fixture(scope="module")
def cluster_ptx():
    return compile_ptx_sm90(cluster_set, "void(float32[::1])")


@pytest.mark.parametrize("instruction", [
    "%cluster_ctarank", "barrier.cluster.arrive.release.aligned",
    "barrier.cluster.wait.acquire.aligned", "mapa.shared::cluster.u32", "ld.shared::cluster.f32",
])
def test_cluster_set_emits_each_instruction(cluster_ptx, instruction):
    assert_uses(cluster_ptx, instruction)
    assert_no_local_memory(cluster_ptx)
    assert count(cluster_ptx, "call") == 0


def gridsync_set(flag, data, out):
    # a grid barrier in miniature (gridsync.py's doc): arrive, the last publishes, the rest
    # spin; then read what the other blocks wrote through L2
    if cuda.threadIdx.x == 0:
        gen = P.ld_acquire_gpu_u32(flag, 1)
        P.fence_acq_rel_gpu()
        if P.atom_add_acq_rel_gpu_u32(flag, 0, 1) == cuda.gridDim.x - 1:
            flag[0] = 0
            P.st_release_gpu_u32(flag, 1, gen + 1)
        else:
            while P.ld_acquire_gpu_u32(flag, 1) == gen:
                P.nanosleep_u32(64)
        P.red_release_gpu_add_u32(flag, 2, 1)   # the lean form: arrive, spin to the count
        while P.ld_acquire_gpu_u32(flag, 2) < cuda.gridDim.x:
            pass
    cuda.syncthreads()
    a, b, c, d = P.ld_global_cg_v4_u32(data, 4 * cuda.threadIdx.x)
    out[cuda.threadIdx.x] = a + b + c + d
    P.red_relaxed_gpu_add_u64(data, 2 * cuda.threadIdx.x, uint64(a))   # fixed-point sums


@pytest.fixture(scope="module")
def gridsync_ptx():
    return compile_ptx_sm90(gridsync_set, f"void({U32}, {U32}, {U32})")


@pytest.mark.parametrize("instruction", [
    "atom.add.acq_rel.gpu.global.u32", "red.release.gpu.global.add.u32", "ld.acquire.gpu.global.u32", "st.release.gpu.global.u32",
    "fence.acq_rel.gpu", "ld.global.cg.v4.u32", "nanosleep.u32", "red.relaxed.gpu.global.add.u64",
])
def test_gridsync_set_emits_each_instruction(gridsync_ptx, instruction):
    assert_uses(gridsync_ptx, instruction)
    assert_no_local_memory(gridsync_ptx)
    assert count(gridsync_ptx, "call") == 0


@needs_ptxas
def test_gridsync_set_assembles_for_sm90(gridsync_ptx):
    regs, spill_bytes = ptxas_report(gridsync_ptx)
    assert spill_bytes == 0 and regs > 0


def test_every_exported_wrapper_is_covered(gemv_ptx, pipeline_ptx, extras_ptx, cluster_ptx,
                                           gridsync_ptx):
    # a new wrapper must get a compile check: its template's opcode appears in some PTX here
    from test_async_copy import async_copy_ptx
    from test_tensormap_cpu import tensor_copy_ptx
    names = [n for n in P.__all__ if callable(getattr(P, n))]
    assert len(names) == 67
    sets = (gemv_ptx, pipeline_ptx, extras_ptx, async_copy_ptx(), cluster_ptx, tensor_copy_ptx(),
            gridsync_ptx)
    for n in names:
        words = getattr(P, n).ptx_template.replace("{", " ").replace(":", " ").split()
        opcode = next(w for w in words if "." in w and not w.startswith(".") and w != "nq_wait")
        assert any(opcode in p for p in sets), \
            f"{n}: {opcode} never compiled"


_U, _U2, _F2 = "uint32[::1]", "uint32[:, ::1]", "float32[:, ::1]"
GPU_TEST_KERNELS = {
    "k_clock": "void(uint64[::1], uint64[::1])",
    "k_prmt": f"void({_U},{_U},{_U},{_U})", "k_prmt_const": f"void({_U},{_U},{_U},{_U})",
    "k_lop3": f"void({_U},{_U},{_U},{_U2})", "k_half2_math": f"void({_U},{_U},{_U},{_U2})",
    "k_cvt_f32_f16": "void(uint16[::1], float32[::1])",
    "k_cvt_f16_f32": f"void(float32[::1], uint16[::1], {_U})",
    "k_unpack": f"void({_U}, float32[::1], float32[::1])",
    "k_dequant": f"void({_U},{_U},{_U2})", "k_copy16": f"void({_U},{_U2})",
    "k_copy16_2d": f"void({_U2},{_U2})", "k_dp4a": f"void({_U},{_U},int32[::1],int32[::1])",
    "k_ldmatrix": f"void({_U2},{_U2},{_U2})", "k_mma": f"void({_U2},{_U2},{_F2},{_F2})",
    "k_mma_s8": f"void({_U2},{_U2},int32[:, ::1],int32[:, ::1],float32[::1],int32[::1])",
    "k_bulk_pipeline": f"void({_U},{_U},{_U})",
    "k_extras": f"void({_U}, float16[::1], float32[::1], {_U2}, float16[::1], {_U}, {_U}, "
                f"{_F2})",
}


@pytest.mark.parametrize("name", sorted(GPU_TEST_KERNELS))
def test_gpu_test_kernels_compile_offline(name):
    # the kernels of test_ptx_gpu.py type-check and assemble here, before they cost GPU time
    import test_ptx_gpu

    ptx = compile_ptx_sm90(getattr(test_ptx_gpu, name), GPU_TEST_KERNELS[name])
    assert_no_local_memory(ptx)
    if have_ptxas():
        assert ptxas_report(ptx)[1] == 0
