"""Every nq.ptx wrapper compiles for sm_90 on a machine with no GPU, emits the instruction it
promises, inline (no call), and leaves no local-memory traffic behind."""
import numpy as np
import pytest
from numba import cuda, uint32
from numba.core.errors import TypingError

import nq.ptx as P
from nq.ptx import LUT_AND_XOR
from ptx_util import assert_no_local_memory, assert_uses, compile_ptx_sm90, count, ptxas_report

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


def test_gemv_set_has_no_local_memory_and_no_spills(gemv_ptx):
    assert_no_local_memory(gemv_ptx)
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


def test_every_exported_wrapper_is_covered(gemv_ptx):
    # a new wrapper must get a compile check: its template's opcode appears in some PTX here
    names = [n for n in P.__all__ if hasattr(getattr(P, n), "ptx_template")]
    for n in names:
        opcode = getattr(P, n).ptx_template.lstrip("{ ").split()[0]
        if opcode == ".reg":  # a scoped multi-instruction template: check its cvt
            opcode = "cvt.f32.f16"
        assert opcode in gemv_ptx or opcode in COVERED_ELSEWHERE, f"{n}: {opcode} never compiled"


COVERED_ELSEWHERE: set[str] = set()
