"""The INT4 (g128, ValueShuffle) GEMVs of the decode step, and the weight layouts they read.

    tiling.py     Tiling (CUDA cores), MmaTiling (tensor cores), default_tiling: the measured table
    layout.py     the prepared weight layouts as NumPy models (row chunks, mma fragments)
    dequant.py    the shared 9-instruction dequant and the activations' power-of-two scaling
    gemv.py       the CUDA-core kernel factory: qkv, qkv_rope, o_proj, gate_up, down
    gemv_digits.py  its activations as signed-byte digits summed by dp4a (qkv's default)
    rope_epilogue.py  qkv_rope's epilogue (rope_kv's arithmetic, bit for bit)
    gemv_mma.py   the tensor-core kernel factory: o_proj, down, gate_up (their default)
    launch.py     the launchers and the make_* functions below (the one module above both kernels)
    retile.py     the upload's re-tiling kernels (file layout -> a kernel's layout, on the GPU)
    reference.py  the NumPy references

Public API (docs/KERNELS_GEMV.md has the design and the figures):

    g = make_down_gemv(cfg)                # or a Tiling / MmaTiling of one's own
    qw, sc = g.prepare([(qweight, scales)])
    g(a, qw, sc, x, stream)
"""
from nq.kernels.int4.launch import (make_down_gemv, make_gate_up_gemv, make_o_proj_gemv,
                                    make_qkv_gemv, make_qkv_rope_gemv)
from nq.kernels.int4.reference import ref_down, ref_gate_up, ref_o_proj, ref_qkv, ref_qkv_rope
from nq.kernels.int4.tiling import KINDS, MmaTiling, Tiling, default_tiling, mma_tiling

__all__ = ["make_qkv_gemv", "make_qkv_rope_gemv", "make_o_proj_gemv", "make_gate_up_gemv",
           "make_down_gemv", "Tiling", "MmaTiling", "default_tiling", "mma_tiling", "KINDS",
           "ref_qkv", "ref_qkv_rope", "ref_o_proj", "ref_down", "ref_gate_up"]
