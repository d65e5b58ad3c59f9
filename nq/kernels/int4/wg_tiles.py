"""The wgmma GEMM's tiles (nq/kernels/int4/gemm_wgmma.py): a block's shape (`WgTiles`), the
measured table of which tiles run which M for each projection, and the checks a tiling must
pass before a kernel is built from it.  Kept apart from the kernel as tiling.py is from the
GEMVs: the table is what a sweep (scripts/bench_gemm.py --wgmma --wg-all) edits."""
from __future__ import annotations

import dataclasses

from nq.config import GROUP_SIZE
from nq.kernels.common import SMEM_OPTIN_LIMIT
from nq.kernels.int4.gemm_kernel import KINDS, TILE, layout_tag


@dataclasses.dataclass(frozen=True)
class WgTiles:
    """A block: `wg` warpgroups, each `ta` m64 weight tiles x `bt` tokens (wgmma N); `stages`
    groups of 128 k in the ring (stages - 2 of them ahead of the one multiplied); `depth` k16
    chunks of wgmmas left in flight while the next chunk's fragments are dequantised."""
    ta: int
    wg: int
    bt: int
    stages: int
    depth: int = 1

    @property
    def rows(self) -> int:
        return 64 * self.ta * self.wg

    @property
    def tokens(self) -> int:
        return self.bt

    @property
    def threads(self) -> int:
        return 128 * self.wg

    def stage_bytes(self) -> int:
        return self.rows * GROUP_SIZE // 2 + self.bt * GROUP_SIZE * 2

    def smem_bytes(self) -> int:
        ring = self.stages * self.stage_bytes()
        epilogue = self.bt * (self.rows + 4) * 4            # the fp32 tile of the epilogue
        return max(ring, epilogue) + 1024                   # + the 1024-alignment pad

    def out_tiles(self, kind: str) -> int:
        """Output 16-row tiles of a block: gate_up's SwiGLU pairs a gate tile with an up tile
        -- inside a warpgroup (ta = 2) or across the two halves of the warpgroups (ta = 1)."""
        if kind != "gate_up":
            return self.wg * self.ta * 4
        return self.wg * 4 if self.ta == 2 else (self.wg // 2) * 4

    def tag(self) -> str:
        d = f"d{self.depth}" if self.depth != 1 else ""
        return f"wg{self.wg}a{self.ta}t{self.bt}s{self.stages}{d}"


WG_WIDE = WgTiles(ta=2, wg=2, bt=128, stages=4)
WG_TALL = WgTiles(ta=1, wg=2, bt=128, stages=4, depth=2)
WG_SHORT = WgTiles(ta=1, wg=2, bt=64, stages=4, depth=2)

# Each kind's tiles by M: ((max_m, tiles), ...), the first entry whose max_m >= M (None: any
# M).  The fastest of scripts/bench_gemm.py --wgmma --wg-all (H200, 2026-12-01; TFLOP/s at
# M = 512 / 2048 / 8192 against the tiles before this table):
#   qkv     WG_TALL   197 / 318 / 339   (WG_WIDE 183 / 248 / 330)
#   o_proj  WG_SHORT  321 / 326 / 334   (WG_TALL depth 1: 306 / 235 / 273)
#   gate_up WG_TALL   359 at 512 (gate and up in the two warpgroups; WG_WIDE 326), WG_WIDE
#           373 / 372 at 2048 / 8192 (WG_TALL 365 / 348)
#   down    WG_TALL   455 / 441 / 466   (depth 1: 427 / 414 / 429)
DEFAULT_TILES = {"qkv": ((None, WG_TALL),), "o_proj": ((None, WG_SHORT),),
                 "gate_up": ((1024, WG_TALL), (None, WG_WIDE)), "down": ((None, WG_TALL),)}


def tiles_by_m(kind: str) -> tuple:
    return DEFAULT_TILES.get(kind, ((None, WG_WIDE if kind == "gate_up" else WG_TALL),))


def default_tiles(kind: str, m: int | None = None) -> WgTiles:
    """The tiles that run m tokens of `kind` (m None: the largest M's)."""
    table = tiles_by_m(kind)
    if m is not None:
        for max_m, t in table:
            if max_m is None or m <= max_m:
                return t
    return table[-1][1]


def check(kind: str, n: int, k: int, layout, t: WgTiles) -> None:
    layout_tag(layout)
    if kind not in KINDS:
        raise ValueError(f"gemm_wgmma: kind {kind!r} is not one of {KINDS}")
    if n % TILE or k % GROUP_SIZE or n <= 0 or k <= 0:
        raise ValueError(f"gemm_wgmma: N={n} must be a multiple of {TILE} and K={k} of "
                         f"{GROUP_SIZE}")
    if t.ta not in (1, 2) or t.wg < 1 or t.threads > 1024 or t.stages < 3:
        raise ValueError(f"gemm_wgmma: tiles {t.tag()}: ta must be 1 or 2, stages >= 3, at "
                         f"most 1024 threads")
    if not 1 <= t.depth <= 4:
        raise ValueError(f"gemm_wgmma: tiles {t.tag()}: depth must be 1..4 chunks in flight "
                         f"(the ring frees a group's buffer only when all 8 of its chunks retired)")
    if t.bt % 8 or not 8 <= t.bt <= 256 or (t.bt * 16) % t.threads:
        raise ValueError(f"gemm_wgmma: tiles {t.tag()}: bt must be a multiple of 8 in 8..256 "
                         f"with bt * 16 copies a whole number a thread")
    if kind == "gate_up" and t.ta != 2 and t.wg % 2:
        raise ValueError(f"gemm_wgmma: gate_up needs ta = 2 (gate and up tiles of the same "
                         f"rows in one warpgroup) or an even wg (gate in the first half of the "
                         f"warpgroups, up in the second), got {t.tag()}")
    if t.smem_bytes() > SMEM_OPTIN_LIMIT:
        raise ValueError(f"gemm_wgmma: tiles {t.tag()} need {t.smem_bytes()} bytes of shared "
                         f"memory, over sm_90's {SMEM_OPTIN_LIMIT}")
