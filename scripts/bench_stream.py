"""What the big GEMVs' weight stream reaches without their math, and with a stand-in for it.

gate_up and down stream ~20-22 GB/s an SM alone (ncu, H200, 2026-12-03: gate_up 70 MB in 24.6
us over 132 SMs, down 35 MB in 15.9 us over 112), where bench_boundary's `tiles` kernel (the
same 1 KB runs, 8 blocks of 256 threads an SM, no math) streams ~35.  Neither more bytes in
flight a warp (gate_up sets=3) nor twice the warps (apart=1) moved gate_up (docs/PERF.md 0.17).
This kernel reads a matrix in gemv_mma's order and grid -- a tile's `wpt` warps share its
1 KB groups (warp w: w, w + wpt, ...), `mats` tiles a warp (gate_up: its gate and up tile),
each group's loads issued one group ahead of its use as mainloop issues them -- and after each
group runs `spin` dependent FMAs seeded by its words, a stand-in for the dequant-mma chain
(gate_up: ~260 instructions and ~300-400 cycles of dependent latency a group).  `form` is how
a lane reads its 32 bytes: `half` (today's layout: two 16-byte loads at 32 * lane and 32 *
lane + 16, each instruction touching 32 sectors half), `coal` (a layout where instruction h
reads bytes 512 h + 16 lane: 16 whole sectors an instruction) or `gmaj` (today's lanes, the
groups stored group-major, [group][tile]: the g-th groups of all tiles one contiguous run).

    python3 scripts/bench_stream.py                   # the sweep of SHAPES x spins x forms
    python3 scripts/bench_stream.py --only gate_up    # one family

Each case reads 4 copies of its matrix in turn (so L2 holds none of the next), one graph of 4
launches (no PDL: a ~1 us launch gap each is in the figure), median of `--reps` replays."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from numba import cuda, float32, uint32  # noqa: E402  (module globals: the simulator swaps cuda)

GROUP_WORDS = 256           # a tile's group: 16 rows x 128 INT4 = 1 KB


def stand_in(spin: int, groups: int):
    """The math's stand-in, a device function (acc, x, grp) -> acc: `spin` dependent FMAs
    seeded by the group's words (the warp waits for them, then computes); nothing past the
    last group."""
    from nq.kernels.common import dev

    def work(acc, x, grp):
        if grp < groups:
            f = float32(x & uint32(0xFFFF)) * float32(1e-6)
            for _ in range(spin):
                f = f * float32(1.0001) + float32(0.5)
            acc += f
        return acc

    return dev(work)


def build(wpt: int, mats: int, groups: int, n_tiles: int, threads: int, min_blocks: int,
          spin: int, form: str, depth: int = 2):
    from nq.kernels.build import compile_kernel
    from nq.kernels.common import dev
    from nq.ptx import ld_global_nc_v4_u32

    TILES = threads // 32 // wpt
    PAIRS = -(-groups // (2 * wpt))
    TRIPLES = -(-groups // (3 * wpt))
    UP = n_tiles * groups * GROUP_WORDS          # the up tile's offset (mats == 2)
    coal = form == "coal"
    # gmaj: the groups group-major, [group][tile] -- a tile's group g at (g * n_tiles + tile)
    # KB, so the warps of every tile reading their g-th group read one contiguous run
    GSTRIDE = n_tiles * GROUP_WORDS if form == "gmaj" else GROUP_WORDS
    TSTRIDE = GROUP_WORDS if form == "gmaj" else groups * GROUP_WORDS

    def load(buf, base, grp):
        # the lane's 8 words of group grp of its tile (base: the tile's first word)
        g = min(grp, groups - 1)
        lane = cuda.threadIdx.x & 31
        if coal:
            a = base + g * GSTRIDE + lane * 4
            w0, w1, w2, w3 = ld_global_nc_v4_u32(buf, a)
            w4, w5, w6, w7 = ld_global_nc_v4_u32(buf, a + 128)
        else:
            a = base + g * GSTRIDE + lane * 8
            w0, w1, w2, w3 = ld_global_nc_v4_u32(buf, a)
            w4, w5, w6, w7 = ld_global_nc_v4_u32(buf, a + 4)
        return w0 ^ w1 ^ w2 ^ w3 ^ w4 ^ w5 ^ w6 ^ w7

    def both(buf, base, grp):
        x = load(buf, base, grp)
        if mats == 2:
            x ^= load(buf, base + UP, grp)
        return x

    load, both = (dev(f) for f in (load, both))
    work = stand_in(spin, groups)

    def body(buf, out):
        warp = cuda.threadIdx.x >> 5
        tl = warp // wpt
        kw = warp - tl * wpt
        tile = min(cuda.blockIdx.x * TILES + tl, n_tiles - 1)
        base = tile * TSTRIDE
        acc = float32(0.0)
        c = both(buf, base, kw)
        if depth == 3:   # gemv_mma's retired sets=3: loads two groups ahead of their use
            n = both(buf, base, kw + wpt)
            for it in range(TRIPLES):
                ga = kw + 3 * it * wpt
                gc = ga + 2 * wpt
                m = both(buf, base, gc)
                acc = work(acc, c, ga)
                c = both(buf, base, gc + wpt)
                acc = work(acc, n, ga + wpt)
                n = both(buf, base, gc + 2 * wpt)
                acc = work(acc, m, gc)
        else:            # mainloop's two register sets: loads one group ahead
            for it in range(PAIRS):
                ga = kw + 2 * it * wpt
                gb = ga + wpt
                n = both(buf, base, gb)
                acc = work(acc, c, ga)
                c = both(buf, base, gb + wpt)
                acc = work(acc, n, gb)
        if acc == float32(-1.0):
            out[0] = acc

    bounds = (threads, min_blocks) if min_blocks else (threads,)
    name = (f"bench_stream_w{wpt}_m{mats}_g{groups}_n{n_tiles}_t{threads}_mb{min_blocks}"
            f"_s{spin}_{form}_d{depth}")
    k = compile_kernel(body, "void(uint32[::1], float32[::1])", name, launch_bounds=bounds)
    return k, -(-n_tiles // TILES)


def build_bulk(mats: int, groups: int, n_tiles: int, consumers: int, stages: int, spin: int):
    """The same bytes through shared memory, one producer lane a block: a block walks tiles
    b, b + grid, ... (one CTA an SM); a stage holds `consumers` consecutive groups of one tile
    (and of its up tile), one `cp.async.bulk` a matrix of up to consumers KB, counted off the
    stage's full mbarrier; consumer warp w reads group w of the stage (its lane's 32 bytes, as
    mainloop's loads), arrives on the stage's empty mbarrier, then runs `spin` dependent FMAs.
    So the bytes in flight an SM are stages x consumers x mats KB, set by shared memory, not by
    registers, and the loads are issued by a warp that does no math: whether a weight stream fed
    by the copy engine reaches the `tiles` kernel's ~35 GB/s an SM where the register loop of
    gemv_mma reaches ~20-22 (the retired `ring` copied 1 KB a warp, ~17)."""
    from nq.kernels.build import compile_kernel
    from nq.ptx import (cp_async_bulk_g2s, cvta_to_shared_u32, fence_mbarrier_init,
                        ld_shared_v4_u32_at, mbarrier_arrive, mbarrier_arrive_expect_tx,
                        mbarrier_init, mbarrier_try_wait_parity, mbarrier_wait_parity)

    C, NST = consumers, stages
    NCH = -(-groups // C)                      # stages a tile
    UP = n_tiles * groups * GROUP_WORDS        # the up tile's offset (mats == 2)
    STAGE_B = mats * C * 1024
    SLOTS0 = 1024                              # the barriers first, the stages 1 KB aligned

    work = stand_in(spin, groups)

    def body(buf, out):
        dyn = cuda.shared.array(0, uint32)
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        base = cvta_to_shared_u32(dyn)
        full0 = base
        empty0 = base + uint32(8 * NST)
        if cuda.threadIdx.x == 0:
            for s_ in range(NST):
                mbarrier_init(full0 + uint32(8 * s_), uint32(1))
                mbarrier_init(empty0 + uint32(8 * s_), uint32(C))
            fence_mbarrier_init()
        cuda.syncthreads()
        acc = float32(0.0)
        it = 0
        t = cuda.blockIdx.x
        if warp == C:
            if lane == 0:      # the producer
                while t < n_tiles:
                    for j in range(NCH):
                        st = it % NST
                        while mbarrier_try_wait_parity(empty0 + uint32(8 * st),
                                                       uint32(((it // NST) & 1) ^ 1)) == 0:
                            pass
                        g0 = j * C
                        nb = min(C, groups - g0) * 1024
                        full = full0 + uint32(8 * st)
                        mbarrier_arrive_expect_tx(full, uint32(mats * nb))
                        dst = base + uint32(SLOTS0 + st * STAGE_B)
                        cp_async_bulk_g2s(dst, buf, (t * groups + g0) * GROUP_WORDS,
                                          uint32(nb), full)
                        if mats == 2:
                            cp_async_bulk_g2s(dst + uint32(C * 1024), buf,
                                              UP + (t * groups + g0) * GROUP_WORDS,
                                              uint32(nb), full)
                        it += 1
                    t += cuda.gridDim.x
        else:
            while t < n_tiles:
                for j in range(NCH):
                    st = it % NST
                    mbarrier_wait_parity(full0 + uint32(8 * st), uint32((it // NST) & 1))
                    ok = j * C + warp < groups
                    x = uint32(0)
                    if ok:
                        a = base + uint32(SLOTS0 + st * STAGE_B + warp * 1024 + lane * 32)
                        w0, w1, w2, w3 = ld_shared_v4_u32_at(a)
                        w4, w5, w6, w7 = ld_shared_v4_u32_at(a + uint32(16))
                        x = w0 ^ w1 ^ w2 ^ w3 ^ w4 ^ w5 ^ w6 ^ w7
                        if mats == 2:
                            a += uint32(C * 1024)
                            w0, w1, w2, w3 = ld_shared_v4_u32_at(a)
                            w4, w5, w6, w7 = ld_shared_v4_u32_at(a + uint32(16))
                            x ^= w0 ^ w1 ^ w2 ^ w3 ^ w4 ^ w5 ^ w6 ^ w7
                    cuda.syncwarp(0xFFFFFFFF)
                    if lane == 0:
                        mbarrier_arrive(empty0 + uint32(8 * st))
                    acc = work(acc, x, j * C + warp)
                    it += 1
                t += cuda.gridDim.x
        if acc == float32(-1.0):
            out[0] = acc

    name = f"bench_stream_bulk_m{mats}_g{groups}_n{n_tiles}_c{C}_st{NST}_s{spin}"
    k = compile_kernel(body, "void(uint32[::1], float32[::1])", name,
                       launch_bounds=((C + 1) * 32, 1))
    return k, (C + 1) * 32, SLOTS0 + NST * STAGE_B


# (family, tiles, groups, warps a tile, mats, threads, min_blocks): the 7B's gate_up and down
# grids as the engine runs them, and the `tiles` kernel's occupancy for gate_up's runs
SHAPES = [("gate_up", 1184, 28, 2, 2, 576, 0),
          ("gate_up t256 x8", 2368, 28, 2, 1, 256, 8),
          ("down", 224, 148, 16, 1, 1024, 0)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--spins", default="0,64,128,256")
    ap.add_argument("--only", default="")
    ap.add_argument("--forms", default="half,coal,gmaj")
    ap.add_argument("--depths", default="2", help="2: loads a group ahead (mainloop), 3: two")
    ap.add_argument("--bulk", default="", help="consumers:stages,... of the copy-engine form "
                    "(build_bulk), for gate_up and down; '' none")
    a = ap.parse_args(argv)
    import numpy as np

    from nq.kernels.common import allow_smem
    from nq.kernels.fill import fill_u32
    from nq.runtime.graphs import CapturedGraph

    stream = cuda.stream()
    out = cuda.device_array(1, np.float32)
    print("| shape | form | depth | spin | us a launch | TB/s | GB/s an SM used |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    for fam, n_tiles, groups, wpt, mats, threads, mb in SHAPES:
        if a.only and not fam.startswith(a.only):
            continue
        words = n_tiles * mats * groups * GROUP_WORDS
        buf = cuda.device_array(4 * words, np.uint32)
        fill_u32(buf, 777)
        for spin in (int(s) for s in a.spins.split(",")):
            for form, depth in ((f, int(d)) for f in a.forms.split(",")
                                for d in a.depths.split(",")):
                k, grid = build(wpt, mats, groups, n_tiles, threads, mb, spin, form, depth)

                def launches():
                    for c in range(4):
                        k[grid, threads, stream](buf[c * words:(c + 1) * words], out)
                g = CapturedGraph(stream, launches, f"stream_{fam}_{spin}_{form}_{depth}")
                ms = g.median_ms(a.reps) / 4
                used = min(grid, sms)
                print(f"| {fam} | {form} | {depth} | {spin} | {ms * 1e3:.2f} | "
                      f"{words * 4 / ms / 1e9:.2f} | {words * 4 / ms / 1e6 / used:.1f} |",
                      flush=True)
            for cs in (c for c in a.bulk.split(",") if c and fam in ("gate_up", "down")):
                nc, nst = (int(v) for v in cs.split(":"))
                k, threads_b, smem = build_bulk(mats, groups, n_tiles, nc, nst, spin)
                allow_smem(k, smem)
                grid = min(n_tiles, sms)

                def launches():
                    for c in range(4):
                        k[grid, threads_b, stream, smem](buf[c * words:(c + 1) * words], out)
                g = CapturedGraph(stream, launches, f"stream_bulk_{fam}_{spin}_{cs}")
                ms = g.median_ms(a.reps) / 4
                print(f"| {fam} | bulk c{nc} st{nst} ({smem // 1024} KB) | - | {spin} | "
                      f"{ms * 1e3:.2f} | {words * 4 / ms / 1e9:.2f} | "
                      f"{words * 4 / ms / 1e6 / grid:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
