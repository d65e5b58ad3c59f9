"""What a kernel boundary costs inside a programmatic (PDL) graph: the bound on "fewer kernels".

The 7B decode step is ~170 kernels; a persistent kernel that walked the layers would remove
the boundaries, not the bytes.  This script measures what the boundaries cost when every kernel
only streams bytes (no math, no data dependency), so the difference is the boundaries alone:

  * `one`     one kernel reads all the bytes of the step's projections (3.37 GB for the 7B);
  * `chain`   the same bytes split as the step splits them -- a layer's qkv, o_proj, gate_up,
              down and two tiny kernels for the attention's split and combine -- 28 times, each
              kernel waiting on the one before (griddepcontrol.wait first, as a GEMV's weights
              after its first group), in one graph with programmatic edges;
  * `early`   the chain again, each kernel reading its bytes before griddepcontrol.wait
              (the most a prefetch of the next kernel's weights could give);
  * `empty`   the chain's kernels with no bytes at all: the boundary's own latency;
  * `tiles`   the chain's kernels reading their weights in gemv_mma's order and grid
              (`build_tiles`): the access pattern's cost, without the kernel's math;
  * `persistent`  one kernel walking the chain's slices with a grid-wide barrier between
              them (`build_persistent`): what a persistent kernel's simplest sync costs;
  * `persistent, lean`  the same with the leanest barrier (`red.release` arrivals on a counter
              that only grows, thread 0 spinning on `ld.acquire`), and both forms with no
              bytes (`barriers`, `barriers, lean`): a barrier's own latency, against `empty`.

    python3 scripts/bench_boundary.py --reps 20

Grid: two blocks of 512 threads an SM (264 on the H200), every thread 64 bytes of loads in flight;
each kernel's slice is disjoint, so L2 holds none of it on the next replay (the projections,
3.37 GB, are 70x the L2)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nq.config import PRESETS  # noqa: E402


def build(early: bool):
    from numba import cuda, uint32

    from nq.kernels.build import compile_kernel
    from nq.ptx import griddepcontrol_launch_dependents, griddepcontrol_wait, ld_global_nc_v4_u32

    def body(buf, start, n16, out):
        # n16 16-byte vectors from word `start`, four loads in flight a thread; the xor of all
        # is written only if it equals a value it never has, so nothing is optimised away
        if not early:
            griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        stride = cuda.gridDim.x * cuda.blockDim.x
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        acc = uint32(0)
        while i + 3 * stride < n16:
            a0, a1, a2, a3 = ld_global_nc_v4_u32(buf, start + 4 * i)
            b0, b1, b2, b3 = ld_global_nc_v4_u32(buf, start + 4 * (i + stride))
            c0, c1, c2, c3 = ld_global_nc_v4_u32(buf, start + 4 * (i + 2 * stride))
            d0, d1, d2, d3 = ld_global_nc_v4_u32(buf, start + 4 * (i + 3 * stride))
            acc ^= a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1 ^ b2 ^ b3 ^ c0 ^ c1 ^ c2 ^ c3 ^ d0 ^ d1 ^ d2 ^ d3
            i += 4 * stride
        while i < n16:
            a0, a1, a2, a3 = ld_global_nc_v4_u32(buf, start + 4 * i)
            acc ^= a0 ^ a1 ^ a2 ^ a3
            i += stride
        if early:
            griddepcontrol_wait()
        if acc == uint32(0x9E3779B9):
            out[0] = acc

    return compile_kernel(body, "void(uint32[::1], int64, int64, uint32[::1])",
                          f"bench_boundary_stream{'_early' if early else ''}",
                          launch_bounds=(512,))


def build_tiles():
    """The same bytes read in gemv_mma's order: a matrix is tiles of 16 rows, each a run of
    1 KB groups ([tile][group][lane][32 bytes]); `wpt` warps share a tile's groups (warp w:
    groups w, w + wpt, ...), a lane reading its 32 bytes of a group as two 16-byte loads, the
    next group's loads issued before this one's are consumed -- the access pattern without
    the dequant, the mma or the activations."""
    from numba import cuda, uint32

    from nq.kernels.build import compile_kernel
    from nq.ptx import griddepcontrol_launch_dependents, griddepcontrol_wait, ld_global_nc_v4_u32

    def body(buf, start, n_tiles, groups, wpt, out):
        griddepcontrol_wait()
        griddepcontrol_launch_dependents()
        gw = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) >> 5
        lane = cuda.threadIdx.x & 31
        tile = gw // wpt
        acc = uint32(0)
        if tile < n_tiles:
            base = start + tile * groups * 256 + lane * 8     # words: 256 a group
            g = gw - tile * wpt
            while g + wpt < groups:
                a0, a1, a2, a3 = ld_global_nc_v4_u32(buf, base + g * 256)
                a4, a5, a6, a7 = ld_global_nc_v4_u32(buf, base + g * 256 + 4)
                b0, b1, b2, b3 = ld_global_nc_v4_u32(buf, base + (g + wpt) * 256)
                b4, b5, b6, b7 = ld_global_nc_v4_u32(buf, base + (g + wpt) * 256 + 4)
                acc ^= a0 ^ a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7
                acc ^= b0 ^ b1 ^ b2 ^ b3 ^ b4 ^ b5 ^ b6 ^ b7
                g += 2 * wpt
            if g < groups:
                a0, a1, a2, a3 = ld_global_nc_v4_u32(buf, base + g * 256)
                a4, a5, a6, a7 = ld_global_nc_v4_u32(buf, base + g * 256 + 4)
                acc ^= a0 ^ a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7
        if acc == uint32(0x9E3779B9):
            out[0] = acc

    return compile_kernel(body, "void(uint32[::1], int64, int64, int64, int64, uint32[::1])",
                          "bench_boundary_tiles", launch_bounds=(256,))


def build_persistent(lean: bool = False):
    """One kernel for the whole chain: the grid streams phase p's slice (offs[p] to offs[p+1],
    16-byte vectors, four loads in flight a thread as `build`'s), then waits at a grid-wide
    barrier before phase p + 1 -- the simplest persistent kernel, its barrier standing where a
    boundary was.  The barrier: thread 0 of each block adds 1 to a counter and spins until it
    reaches (p + 1) x blocks; with atomics both (`lean` False: the first measured form), or
    (`lean`) arriving by `red.release.gpu` (nothing returned, so nothing waited for) and
    spinning on `ld.acquire.gpu` (a load, not a read-modify-write the arrivals queue behind).
    Every block must be resident at once (the grid is two blocks of 512 an SM); `reset` zeroes
    the counter first, inside the same graph."""
    from numba import cuda, uint32

    from nq.kernels.build import compile_kernel
    from nq.ptx import ld_acquire_gpu_u32, ld_global_nc_v4_u32, red_release_gpu_add_u32

    def body(buf, offs, n_phases, ctr, out):
        stride = cuda.gridDim.x * cuda.blockDim.x
        first = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        acc = uint32(0)
        for p in range(n_phases):
            start = offs[p]
            n16 = (offs[p + 1] - start) // 4
            i = first
            while i + 3 * stride < n16:
                a0, a1, a2, a3 = ld_global_nc_v4_u32(buf, start + 4 * i)
                b0, b1, b2, b3 = ld_global_nc_v4_u32(buf, start + 4 * (i + stride))
                c0, c1, c2, c3 = ld_global_nc_v4_u32(buf, start + 4 * (i + 2 * stride))
                d0, d1, d2, d3 = ld_global_nc_v4_u32(buf, start + 4 * (i + 3 * stride))
                acc ^= a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1 ^ b2 ^ b3 ^ c0 ^ c1 ^ c2 ^ c3 ^ d0 ^ d1 ^ d2 ^ d3
                i += 4 * stride
            while i < n16:
                a0, a1, a2, a3 = ld_global_nc_v4_u32(buf, start + 4 * i)
                acc ^= a0 ^ a1 ^ a2 ^ a3
                i += stride
            cuda.syncthreads()
            if cuda.threadIdx.x == 0:
                target = uint32((p + 1) * cuda.gridDim.x)
                if lean:
                    red_release_gpu_add_u32(ctr, 0, uint32(1))
                    while ld_acquire_gpu_u32(ctr, 0) < target:
                        pass
                else:
                    cuda.threadfence()
                    cuda.atomic.add(ctr, 0, uint32(1))
                    while cuda.atomic.add(ctr, 0, uint32(0)) < target:
                        pass
            cuda.syncthreads()
        if acc == uint32(0x9E3779B9):
            out[0] = acc

    def reset(ctr):
        ctr[0] = 0

    name = "bench_boundary_persistent" + ("_lean" if lean else "")
    k = compile_kernel(body, "void(uint32[::1], int64[::1], int64, uint32[::1], uint32[::1])",
                       name, launch_bounds=(512,))
    return k, compile_kernel(reset, "void(uint32[::1])", "bench_boundary_reset")


def tile_shapes(cfg) -> list[tuple[int, int, int]]:
    """A layer's kernels as (tiles, groups a tile, warps a tile) in the engine's mma tilings
    (qkv as o_proj, 14 warps; gate_up 2; down 16); the attention's two kernels one tile each."""
    h, i, q = cfg.hidden_size, cfg.intermediate_size, cfg.qkv_size
    return [(q // 16, h // 128, 14), (1, 4, 1), (1, 4, 1),
            (h // 16, cfg.num_heads * cfg.head_dim // 128, 14), (2 * i // 16, h // 128, 2),
            (h // 16, i // 128, 16)]


def slices(cfg, layers: int) -> list[int]:
    """Bytes of each kernel of the step's layers, as the engine splits them (INT4 weights and
    their fp16 scales; 4 KB for the attention's two kernels, which stream next to nothing)."""
    h, i, q = cfg.hidden_size, cfg.intermediate_size, cfg.qkv_size

    def w(n, k):
        return n * k // 2 + n * (k // 128) * 2
    layer = [w(q, h), 4096, 4096, w(h, cfg.num_heads * cfg.head_dim), w(2 * i, h), w(h, i)]
    return layer * layers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", default="7b", choices=sorted(PRESETS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=0, help="0: two a multiprocessor")
    a = ap.parse_args(argv)
    import numpy as np
    from numba import cuda

    from nq.runtime.graphs import CapturedGraph

    cfg = PRESETS[a.random]
    sizes = [(s + 15) // 16 * 16 for s in slices(cfg, cfg.num_layers)]
    total = sum(sizes)
    dev = cuda.get_current_device()
    blocks = a.blocks or 2 * dev.MULTIPROCESSOR_COUNT
    buf = cuda.device_array(total // 4, np.uint32)
    from nq.kernels.fill import fill_u32
    fill_u32(buf, 12345)
    out = cuda.device_array(1, np.uint32)
    stream = cuda.stream()
    kern = {False: build(False), True: build(True)}
    print(f"{len(sizes)} kernels, {total / 1e9:.3f} GB, {blocks} blocks of 512", flush=True)

    def chain(early, nbytes):
        def launches():
            off = 0
            for s in sizes:
                n = s if nbytes else 0
                kern[early][blocks, 512, stream](buf, off // 4, n // 16, out)
                off += s
        return launches

    tk = build_tiles()
    shapes = tile_shapes(cfg) * cfg.num_layers

    def tiles(nbytes):
        def launches():
            off = 0
            for (n_tiles, groups, wpt) in shapes:
                grid = -(-n_tiles * wpt * 32 // 256)
                tk[grid, 256, stream](buf, off // 4, n_tiles if nbytes else 0, groups, wpt, out)
                off += n_tiles * groups * 1024
        return launches

    def one():
        kern[False][blocks, 512, stream](buf, 0, total // 16, out)

    pk, reset = build_persistent()
    pk_lean, _ = build_persistent(lean=True)
    offs = cuda.to_device(np.concatenate([[0], np.cumsum(sizes) // 4]).astype(np.int64))
    zero_offs = cuda.to_device(np.zeros(len(sizes) + 1, np.int64))   # every phase empty
    ctr = cuda.device_array(1, np.uint32)

    try:   # every block resident at once, or the barrier never opens
        pblocks = min(blocks, pk.max_cooperative_grid_blocks(512),
                      pk_lean.max_cooperative_grid_blocks(512))
    except Exception:  # noqa: BLE001 -- one block an SM always fits
        pblocks = dev.MULTIPROCESSOR_COUNT
    print(f"persistent: {pblocks} blocks of 512", flush=True)

    def persistent(k, o):
        def launches():
            reset[1, 1, stream](ctr)
            k[pblocks, 512, stream](buf, o, len(sizes), ctr, out)
        return launches

    graphs = {"one": CapturedGraph(stream, one, "one"),
              "chain": CapturedGraph(stream, chain(False, True), "chain", programmatic=True),
              "early": CapturedGraph(stream, chain(True, True), "early", programmatic=True),
              "empty": CapturedGraph(stream, chain(False, False), "empty", programmatic=True),
              "chain, no PDL": CapturedGraph(stream, chain(False, True), "chain_nopdl"),
              "tiles": CapturedGraph(stream, tiles(True), "tiles", programmatic=True),
              "persistent": CapturedGraph(stream, persistent(pk, offs), "persistent"),
              "persistent, lean": CapturedGraph(stream, persistent(pk_lean, offs), "p_lean"),
              "barriers": CapturedGraph(stream, persistent(pk, zero_offs), "barriers"),
              "barriers, lean": CapturedGraph(stream, persistent(pk_lean, zero_offs),
                                              "barriers_lean")}
    res = {}
    for name, g in graphs.items():
        res[name] = g.median_ms(a.reps)
    n = len(sizes)
    tile_bytes = sum(t * g * 1024 for t, g, _ in shapes)
    for name, ms in res.items():
        if name in ("empty", "barriers", "barriers, lean"):   # no bytes: latency alone
            print(f"{name:16s} {ms:7.3f} ms  {ms / n * 1e3:6.2f} us a boundary or barrier")
            continue
        extra = ms - res["one"]
        nb = tile_bytes if name == "tiles" else total
        vs = "" if name == "one" else \
            f"{extra:+.3f} ms against one kernel, {extra / n * 1e3:+.2f} us a boundary"
        print(f"{name:16s} {ms:7.3f} ms  {nb / ms / 1e9:6.2f} TB/s  {vs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
