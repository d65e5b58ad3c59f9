"""cp.async.bulk.tensor: the Hopper copy engine driven by a tensor map (TMA proper), global ->
shared, and the tensor map it reads.

A plain bulk copy (bulk.py) moves one contiguous run of bytes, so a tile that must land
padded or permuted in shared memory costs one copy per run.  A tensor map (128 opaque bytes the
driver's cuTensorMapEncodeTiled encodes on the host) describes a strided tensor of up to five
dimensions in global memory and the box one copy moves; with the 128-byte swizzle the box lands
with the 16-byte chunks of each 128-byte row permuted, chunk c of row r at chunk c ^ (r % 8), so
eight rows read at the same logical column (one ldmatrix phase) hit eight different bank
groups.  One instruction then fetches a whole tile, conflict-free, with no padding.

The map lives in global memory here (a (16,) uint64 device array from `encode`), written by a
host copy before any kernel reads it, so no tensormap proxy fence is needed; the instruction
takes its generic address.

Rules (the GPU faults or corrupts silently otherwise): the map 64-byte aligned (device
allocations are 256-byte aligned), the destination 128-byte aligned and, with the 128-byte
swizzle, 1024-byte aligned so that a box's row r is the swizzle's row r % 8 (the twin insists
on it); the barrier's expect_tx announced for the box's bytes in the same phase.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from nq.ptx import _sim
from nq.ptx._asm import SIMULATOR, ptx

SWIZZLE_NONE = 0      # CUtensorMapSwizzle values
SWIZZLE_128B = 3
_SIM_MAGIC = 0x6E71746D6170  # "nqtmap": a simulator map's word 0 (a real map never starts so)
_sim_maps: dict[int, tuple[np.ndarray, "TensorMapSpec"]] = {}
_L2 = {0: 0, 64: 1, 128: 2, 256: 3}  # promotion bytes -> CUtensorMapL2promotion


@dataclass(frozen=True)
class TensorMapSpec:
    """A tiled fp16 tensor map: dims (elements) and box, innermost first; strides the bytes
    between steps of dims 1.. (len(dims) - 1 of them, multiples of 16)."""
    dims: tuple
    strides: tuple
    box: tuple
    swizzle: int = SWIZZLE_128B
    l2_promotion: int = 128   # bytes an L2 miss fetches: 0 (none), 64, 128 or 256
    elem_bytes: int = 2

    def __post_init__(self):
        rank = len(self.dims)
        if not 1 <= rank <= 5 or len(self.box) != rank or len(self.strides) != rank - 1:
            raise ValueError(f"tensor map: rank 1..5 with a box of the same rank and rank - 1 "
                             f"strides, got dims {self.dims}, strides {self.strides}, box {self.box}")
        if any(s % 16 for s in self.strides):
            raise ValueError(f"tensor map: strides must be multiples of 16 bytes, got {self.strides}")
        if any(not 1 <= b <= 256 for b in self.box) or (self.box[0] * self.elem_bytes) % 16:
            raise ValueError(f"tensor map: box sides 1..256 and an inner side of a multiple of 16 "
                             f"bytes, got {self.box}")
        if self.l2_promotion not in _L2:
            raise ValueError(f"tensor map: l2_promotion must be one of {sorted(_L2)}, got "
                             f"{self.l2_promotion}")
        if self.swizzle == SWIZZLE_128B and self.box[0] * self.elem_bytes > 128:
            raise ValueError("tensor map: the 128-byte swizzle takes an inner box side of at most "
                             f"128 bytes, got {self.box[0] * self.elem_bytes}")

    @property
    def box_bytes(self) -> int:
        return int(np.prod(self.box)) * self.elem_bytes


def swizzle_128b(offset):
    """Where byte `offset` of a box (from a 1024-byte aligned start) lands under the 128-byte
    swizzle: its 16-byte chunk XOR the 128-byte row's index mod 8 (works on arrays too)."""
    return offset ^ (((offset >> 7) & 7) << 4)


def box_bytes(src: np.ndarray, spec: TensorMapSpec, coords) -> np.ndarray:
    """The box at `coords` (innermost first) of the tensor spec describes over src's bytes, in
    box order (dimension 0 fastest), before any swizzle; elements out of bounds are zero."""
    raw = np.asarray(src).reshape(-1).view(np.uint8)
    out = np.zeros(spec.box_bytes, np.uint8)
    eb = spec.elem_bytes
    strides = (eb,) + tuple(spec.strides)
    pos = 0
    inner = spec.box[0]
    for idx in itertools.product(*[range(b) for b in reversed(spec.box[1:])]):
        outer = tuple(reversed(idx))          # box index of dims 1.. (innermost first)
        c = [int(coords[k + 1]) + outer[k] for k in range(len(outer))]
        row_ok = all(0 <= c[k] < spec.dims[k + 1] for k in range(len(c)))
        base = sum(c[k] * strides[k + 1] for k in range(len(c)))
        for e in range(inner):
            x = int(coords[0]) + e
            if row_ok and 0 <= x < spec.dims[0]:
                out[pos + e * eb: pos + (e + 1) * eb] = raw[base + x * eb: base + (x + 1) * eb]
        pos += inner * eb
    return out


def encode(array, spec: TensorMapSpec):
    """The tensor map of `spec` over device array `array` (its element 0 is the tensor's
    origin), as a (16,) uint64 device array for the kernels.  Under the simulator the words
    name a host-side model instead (the twin reads it)."""
    from numba import cuda
    if SIMULATOR:
        host = np.asarray(getattr(array, "_ary", array))
        key = len(_sim_maps) + 1
        _sim_maps[key] = (host, spec)
        words = np.zeros(16, np.uint64)
        words[0], words[1] = _SIM_MAGIC, key
        return cuda.to_device(words)
    from cuda.bindings import driver as cu
    ptr = array.__cuda_array_interface__["data"][0]
    if ptr % 16:
        raise ValueError("tensor map: the tensor's origin must be 16-byte aligned")
    rank = len(spec.dims)
    err, tmap = cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, rank, ptr,
        [cu.cuuint64_t(int(d)) for d in spec.dims],
        [cu.cuuint64_t(int(s)) for s in spec.strides],
        [cu.cuuint32_t(int(b)) for b in spec.box],
        [cu.cuuint32_t(1)] * rank,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        cu.CUtensorMapSwizzle(spec.swizzle),
        cu.CUtensorMapL2promotion(_L2[spec.l2_promotion]),
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise ValueError(f"tensor map: cuTensorMapEncodeTiled refused {spec} ({err.name}); "
                         f"the strides, box and swizzle must meet the driver's rules")
    words = np.array([int(w) for w in tmap.opaque], np.uint64)
    return cuda.to_device(words)


def _model(tmap) -> tuple[np.ndarray, TensorMapSpec]:
    w = np.asarray(getattr(tmap, "_ary", tmap)).view(np.uint64)
    assert int(w[0]) == _SIM_MAGIC and int(w[1]) in _sim_maps, \
        "cp.async.bulk.tensor under the simulator needs a map from nq.ptx.tensormap.encode"
    return _sim_maps[int(w[1])]


@ptx("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
     "[%0], [%1, {%2, %3, %4, %5, %6}], [%7];",
     args=("u32", "base", "s32", "s32", "s32", "s32", "s32", "u32"), effect="memory")
def cp_async_bulk_tensor_5d_g2s(dst, tmap, c0, c1, c2, c3, c4, bar):
    """`cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes
    [dst], [tmap, {c0, c1, c2, c3, c4}], [bar];`

    Copy the box at coordinates (c0..c4, innermost first) of tmap's rank-5 tensor to shared
    address dst, swizzled as the map says; completion counts the box's bytes off bar's
    transaction count.  tmap: the (16,) uint64 device array `encode` returns."""
    src, spec = _model(tmap)
    assert len(spec.dims) == 5, "cp_async_bulk_tensor_5d_g2s needs a rank-5 map"
    dst = int(dst)
    data = box_bytes(src, spec, (c0, c1, c2, c3, c4))
    n = len(data)
    if spec.swizzle == SWIZZLE_128B:
        assert dst % 1024 == 0, "a 128-byte swizzled box needs a 1024-byte aligned destination"
        where = swizzle_128b(np.arange(0, n, 16))
        out = _sim.shared_bytes(dst, n)
        for i, o in enumerate(where):
            out[o:o + 16] = data[16 * i:16 * i + 16]
    else:
        assert dst % 128 == 0, "cp.async.bulk.tensor needs a 128-byte aligned destination"
        _sim.shared_bytes(dst, n)[:] = data
    _sim.locked(lambda: _sim.mbarrier(bar).complete_tx(n))

