"""nq.ptx: one wrapper per PTX instruction, each with a pure-Python twin (`wrapper.twin`).

Kernels import the wrappers from here; under the CUDA simulator each name is its twin.
See nq/ptx/_asm.py for how a wrapper is built and what its operand kinds mean.
"""
from nq.ptx._asm import SIMULATOR
from nq.ptx.half import (add_rn_f16x2, cvt_f32_f16, cvt_rn_f16_f32, fma_rn_f16x2, mul_rn_f16x2,
                         pack_f16x2_from_f32, unpack_f16x2_to_f32)
from nq.ptx.memory import (createpolicy_evict_first_b64, ld_global_nc_hint_v4_u32,
                           ld_global_nc_na_v4_u32, ld_global_nc_v4_u32, st_global_v4_u32)
from nq.ptx.permute import LOP3_A, LOP3_B, LOP3_C, LUT_AND_OR, LUT_AND_XOR, lop3_b32, prmt_b32

__all__ = [
    "SIMULATOR",
    "add_rn_f16x2", "cvt_f32_f16", "cvt_rn_f16_f32", "fma_rn_f16x2", "mul_rn_f16x2",
    "pack_f16x2_from_f32", "unpack_f16x2_to_f32",
    "createpolicy_evict_first_b64", "ld_global_nc_hint_v4_u32", "ld_global_nc_na_v4_u32",
    "ld_global_nc_v4_u32", "st_global_v4_u32",
    "LOP3_A", "LOP3_B", "LOP3_C", "LUT_AND_OR", "LUT_AND_XOR", "lop3_b32", "prmt_b32",
]
