"""The prefill GEMM (nq/kernels/int4/gemm.py) without a GPU: the NumPy models of how it reads
each uploaded weight layout, its refusals, its sm_90 PTX for the 7B shapes, and the kernel
itself under the CUDA simulator against the fp64 reference."""
import textwrap

import numpy as np
import pytest

from nq.config import PRESETS
from nq.kernels.int4 import gemm as M
from nq.kernels.int4.layout import chunk_permutation, mma_layout, tile_rows
from nq.loader.quant import pack_value_shuffle
from nq.ptx.mma import a_coords

ptx_util = pytest.importorskip("ptx_util")


def fp16_pair(bits):
    return np.array([bits & 0xFFFF, bits >> 16], np.uint16).view(np.float16).astype(np.float64)


def lo_nibble_pair(word):
    """dequant's low-nibble trick, modelled in NumPy: ((w & 0x000F000F) ^ 0x64086408) - 1032."""
    return fp16_pair((int(word) & 0x000F000F) ^ 0x64086408) - 1032.0


@pytest.mark.parametrize("k,ks", [(256, 1), (384, 2), (3584, 14), (3584, 4), (896, 3)])
def test_row_layout_gather_is_the_a_fragment(k, ks):
    """Row layout: the words the kernel copies (wsrc + row_piece_word) for group grp, piece i
    are the file's chunk 4*grp + i, and lane (g, t)'s gather of words 2c, 2c+1 of rows g, g+8,
    shifted right by 4t, is its A fragment of chunk c (a_coords)."""
    rng = np.random.default_rng(k + ks)
    q = rng.integers(-8, 8, (16, k)).astype(np.int8)
    file_words = pack_value_shuffle(q)
    tiled = tile_rows(file_words, ks)
    groups = k // 128
    assert sorted(chunk_permutation(k, ks).tolist()) == list(range(k // 32))
    for grp in range(groups):
        words = np.concatenate([tiled[:, w:w + 4] for w in
                                (M.row_piece_word(grp, i, ks, groups) for i in range(4))], 1)
        assert np.array_equal(words, file_words[:, 16 * grp:16 * grp + 16])
        for c in range(8):                                   # k16 chunks of the group
            for lane in range(32):
                g, t = divmod(lane, 4)
                qa, qc = words[g, 2 * c] >> (4 * t), words[g, 2 * c + 1] >> (4 * t)
                qb, qd = words[g + 8, 2 * c] >> (4 * t), words[g + 8, 2 * c + 1] >> (4 * t)
                for reg, word in enumerate((qa, qb, qc, qd)):
                    for half in range(2):
                        r, col = a_coords(lane, reg, half)
                        assert lo_nibble_pair(word)[half] == q[r, grp * 128 + c * 16 + col]


def test_mma_layout_swizzled_reads_are_the_a_fragment():
    """mma layout: the copy plan puts lane l's 16-byte half h of a tile's group at
    l*32 + 16*(h ^ ((l >> 2) & 1)); the lane's read at la ^ 16h finds its words of chunks
    4h..4h+3, each word the lane's A fragment (dequant_word's slot order), and the 8 lanes of
    each quarter-warp read 8 different bank groups."""
    rng = np.random.default_rng(2)
    q = rng.integers(-8, 8, (16, 128)).astype(np.int8)
    words = mma_layout(pack_value_shuffle(q)).reshape(-1)      # one tile, one group: 256 words
    stage = np.zeros(256, np.uint32)
    for pc in range(64):                                       # copy_plan's placement
        ln = pc >> 1
        stage[(ln * 32 + 16 * ((pc & 1) ^ ((ln >> 2) & 1))) // 4:][:4] = words[4 * pc:4 * pc + 4]
    slots = {0: (0, 0), 4: (0, 1), 1: (1, 0), 5: (1, 1), 2: (2, 0), 6: (2, 1), 3: (3, 0), 7: (3, 1)}
    for h in range(2):
        addrs = [(lane * 32 + 16 * ((lane >> 2) & 1)) ^ (16 * h) for lane in range(32)]
        for quarter in range(4):
            assert len({(a // 16) % 8 for a in addrs[8 * quarter:8 * quarter + 8]}) == 8
        for lane in range(32):
            for j in range(4):
                w = int(stage[addrs[lane] // 4 + j])
                for slot, (reg, half) in slots.items():
                    r, col = a_coords(lane, reg, half)
                    nib = (w >> (4 * slot)) & 0xF
                    assert nib - 16 * (nib > 7) == q[r, (4 * h + j) * 16 + col]


def test_activation_swizzle_and_ldmatrix_rows():
    """x's chunk cc of token r sits at chunk cc ^ (r & 7); lane i's ldmatrix address (row lr,
    (32c) ^ xl16) is token lr's chunk 2c + (i // 8) % 2, and each 8-lane matrix reads 8 bank
    groups."""
    for c in range(8):
        addrs = []
        for lane in range(32):
            lr = (lane & 7) + 8 * (lane >> 4)
            xl16 = 16 * (((lane >> 3) & 1) ^ (lane & 7))
            off = (32 * c) ^ xl16
            assert off // 16 == (2 * c + (lane >> 3) % 2) ^ (lr & 7)
            addrs.append(lr * 256 + off)
        for j in range(4):
            assert len({(a // 16) % 8 for a in addrs[8 * j:8 * j + 8]}) == 8


def test_refusals():
    t = M.LARGE
    with pytest.raises(ValueError, match="not one of"):
        M.build_gemm("lm_head", 64, 256, "mma", t)
    with pytest.raises(ValueError, match="multiple of 16"):
        M.build_gemm("plain", 40, 256, "mma", t)
    with pytest.raises(ValueError, match="layout"):
        M.build_gemm("plain", 64, 256, ("rows", 0), t)
    with pytest.raises(ValueError, match="tb must be even"):
        M.build_gemm("plain", 64, 256, "mma", M.Tiles(2, 3, 1, 1, 1, 2))
    with pytest.raises(ValueError, match="even ta"):
        M.build_gemm("gate_up", 64, 256, "mma", M.Tiles(1, 2, 1, 1, 1, 2))
    with pytest.raises(ValueError, match="shared memory"):
        M.build_gemm("plain", 64, 256, "mma", M.Tiles(2, 8, 4, 2, 1, 6))
    with pytest.raises(ValueError, match="whole number"):
        M.build_gemm("plain", 48, 256, "mma", M.Tiles(1, 2, 3, 1, 1, 2))


CFG7 = PRESETS["7b"]
H, I, QKV = CFG7.hidden_size, CFG7.intermediate_size, CFG7.qkv_size
SHAPES_7B = [("qkv", QKV, H, ("rows", 14)), ("gate_up", I, H, ("rows", 4)),
             ("o_proj", H, H, "mma"), ("down", H, I, "mma")]


@pytest.mark.slow
@pytest.mark.parametrize("tiles", [t for _, t in M.DEFAULT_CONFIGS], ids=lambda t: t.tag())
@pytest.mark.parametrize("kind,n,k,layout", SHAPES_7B, ids=[s[0] for s in SHAPES_7B])
def test_gemm_ptx_sm90(kind, n, k, layout, tiles):
    fn, sig, name = M.build_gemm(kind, n, k, layout, tiles)
    ptx = ptx_util.compile_ptx_sm90(fn, sig, launch_bounds=(tiles.threads,))
    ptx_util.assert_uses(ptx, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                         "ldmatrix.sync.aligned.m8n8.x4.shared.b16", "cp.async.cg.shared.global",
                         "cp.async.wait_group", "ld.shared.v4.u32", "mul.rn.f16x2")
    ptx_util.assert_no_local_memory(ptx)
    # a k16 chunk: ta*tb mma, ta fragments of 4 lop3 each, tb/2 ldmatrix; the loop over the
    # two halves of a group may stay rolled, so count per chunk
    mma, ldm = ptx_util.count(ptx, "mma.sync.aligned.m16n8k16"), ptx_util.count(ptx, "ldmatrix")
    chunks = mma // (tiles.ta * tiles.tb)
    assert mma == chunks * tiles.ta * tiles.tb and chunks in (4, 8)
    assert ldm == chunks * tiles.tb // 2
    assert ptx_util.count(ptx, "lop3.b32") >= 4 * chunks * tiles.ta
    if kind == "gate_up":
        ptx_util.assert_uses(ptx, "st.global.u16", "ex2.approx")
    if not ptx_util.have_ptxas():
        pytest.skip("no ptxas or nvJitLink here: the PTX checks above stand")
    regs, spill = ptx_util.ptxas_report(ptx)      # a rejection raises: it must fail the test
    assert spill == 0 and regs <= 255 * 256 // tiles.threads, (regs, spill)


SIM_SCRIPT = textwrap.dedent('''
    import numpy as np
    from numba import cuda
    from nq.kernels.int4 import gemm as M
    from nq.kernels.int4.layout import mma_layout, tile_rows
    from nq.loader.quant import dequantize_packed

    T = M.Tiles
    rng = np.random.default_rng(0)

    def case(name, kind, n, k, layout, tiles, m, band_bytes=M.L2_BAND_BYTES):
        if name not in CASES:
            return
        nw = 2 * n if kind == "gate_up" else n
        qw = rng.integers(0, 2**32, size=(nw, k // 8), dtype=np.uint32)
        sc = rng.uniform(0.002, 0.02, size=(nw, k // 128)).astype(np.float16)
        x = rng.standard_normal((m + 3, k)).astype(np.float16)   # allocated for more than m
        x[0, 5] = 300.0                                          # a "massive activation"
        up = mma_layout(qw) if layout == "mma" else tile_rows(qw, layout[1])
        M.L2_BAND_BYTES = band_bytes
        g = M.Gemm(kind, n, k, layout, configs=((None, tiles),))
        out0 = rng.standard_normal((m + 2, n)).astype(np.float16 if kind == "gate_up" else np.float32)
        out = cuda.to_device(out0)
        bias = rng.standard_normal(n).astype(np.float16)
        args = [cuda.to_device(a) for a in (x, up, sc)] + ([cuda.to_device(bias)] if kind == "qkv" else [])
        g(*args, out, m)
        got = out.copy_to_host().astype(np.float64)
        ref = M.ref_gemm(kind, x[:m], dequantize_packed(qw, sc), bias, out0[:m])
        if kind in ("o_proj", "down"):                           # the products alone
            got[:m] -= out0[:m]
            ref = ref - out0[:m]
        ok = np.isfinite(got).all() and np.array_equal(got[m:], out0[m:].astype(np.float64))
        err = np.linalg.norm(got[:m] - ref) / np.linalg.norm(ref)
        print(name, err if ok else float("inf"), flush=True)

    # mma layout (o_proj, down's): 1 block; a clamped spare tile (48 rows over blocks of 32);
    # wk = 2 over 5 groups (the last slice half empty) with a 3-stage ring; 2 token blocks;
    # gate_up's stacked rows
    case("mma_plain_m1", "plain", 32, 256, "mma", T(2, 2, 1, 1, 1, 2), 1)
    case("mma_oproj_m7", "o_proj", 48, 256, "mma", T(2, 2, 1, 1, 1, 2), 7)
    case("mma_down_m16", "down", 32, 640, "mma", T(1, 2, 2, 1, 2, 3), 16)
    case("mma_qkv_m33", "qkv", 32, 256, "mma", T(2, 4, 1, 1, 1, 2), 33)
    case("mma_gateup_m7", "gate_up", 16, 256, "mma", T(2, 2, 1, 1, 1, 2), 7)
    # row layout (qkv, gate_up's): 3 groups in steps of 2 and 1 (ks 2); wk = 2 and 2 warps
    # along the rows; 2 warps along the tokens; 3 token blocks in bands of 2 (the last short)
    case("rows_plain_m33", "plain", 32, 384, ("rows", 2), T(2, 2, 1, 2, 1, 2), 33)
    case("rows_qkv_m16", "qkv", 64, 384, ("rows", 2), T(1, 2, 2, 1, 2, 2), 16)
    case("rows_gateup_m1", "gate_up", 32, 256, ("rows", 1), T(2, 2, 1, 1, 1, 2), 1)
    case("rows_down_m7", "down", 32, 256, ("rows", 2), T(2, 2, 1, 1, 1, 3), 7)
    case("rows_gateup_bands", "gate_up", 16, 256, ("rows", 2), T(2, 2, 1, 1, 1, 2), 33,
         band_bytes=2 * 16 * 256 * 2)
''')


# The simulator runs ~50 s a case on 2 cores: CI's tier takes the mma layout with its ring
# (down), qkv's (bias) on the row layout with wk = 2, and the row layout with gate_up's bands;
# the long tier (`pytest -m long`) the other seven.
SIM_CASES = {"mma_down_m16", "rows_qkv_m16", "rows_gateup_bands"}
SIM_CASES_LONG = {"mma_plain_m1", "mma_oproj_m7", "mma_qkv_m33", "mma_gateup_m7",
                  "rows_plain_m33", "rows_gateup_m1", "rows_down_m7"}


def _gemm_under_the_simulator(cases):
    """Against the fp64 reference, on tiny shapes.  The scales are folded into the fp16
    weights (w*s rounded once: relative error <= 2^-11 a weight), the products summed in fp32,
    so a dot product of random signs is off by ~2^-11/sqrt(3) ~ 3e-4 of its terms' norm at
    worst; gate_up's fp16 output adds 2^-11 an element."""
    errs, stdout = ptx_util.run_under_simulator(f"CASES = {sorted(cases)!r}\n" + SIM_SCRIPT,
                                                timeout=1200)
    assert set(errs) == cases, stdout
    for name, e in errs.items():
        assert e < (1e-3 if "gateup" in name else 5e-4), (name, e)


@pytest.mark.slow
def test_gemm_under_the_simulator():
    _gemm_under_the_simulator(SIM_CASES)


@pytest.mark.long
def test_gemm_under_the_simulator_every_case():
    _gemm_under_the_simulator(SIM_CASES_LONG)


def test_launch_args_are_checked_once_a_buffer_set():
    """gemm_launch.launch_args: the checks run the first time a buffer set is seen (a wrong
    dtype is refused with the name), a repeat returns the remembered arguments, and other
    buffers are checked anew.  (Host arrays stand in for device ones: the checks read dtype,
    shape, contiguity and the data address alike.)"""
    from nq.kernels.int4.gemm_launch import MEMO_LIMIT, launch_args
    k, rows, n = 256, 32, 32
    x = np.zeros((8, k), np.float16)
    qw = np.zeros((rows, k // 8), np.uint32)
    sc = np.zeros((rows, k // 128), np.float16)
    out = np.zeros((8, n), np.float32)
    memo = {}
    args = launch_args(memo, "gemm_t", k, rows, n, np.float32, x, qw, sc, None, out)
    assert len(args) == 4 and args[-1] is out and args[0].shape == (8 * k,)
    assert launch_args(memo, "gemm_t", k, rows, n, np.float32, x, qw, sc, None, out) is args
    bad = np.zeros((8, n), np.float16)
    with pytest.raises((TypeError, ValueError), match="gemm_t out"):
        launch_args(memo, "gemm_t", k, rows, n, np.float32, x, qw, sc, None, bad)
    assert len(memo) == 1
    for _ in range(MEMO_LIMIT + 3):  # bounded: temporary buffers are not kept alive forever
        launch_args(memo, "gemm_t", k, rows, n, np.float32, x, qw, sc, None,
                    np.zeros((8, n), np.float32))
    assert len(memo) <= MEMO_LIMIT


def test_gemm_launch_keeps_one_fast_launch_a_kernel_and_buffer_set():
    """gemm_launch.gemm_launch: m = 0 is checked and launches nothing; a repeat of the same
    kernel and buffers reuses its FastLaunch; another kernel, or other buffers, get their own,
    over their own arrays (never a remembered launch of buffers that are gone)."""
    import types

    from nq.kernels.int4.gemm_launch import gemm_launch
    k, rows, n = 256, 32, 32
    g = types.SimpleNamespace(kind="o_proj", k=k, w_rows=rows, n=n, _memo={})

    def buffers():
        return (np.zeros((8, k), np.float16), np.zeros((rows, k // 8), np.uint32),
                np.zeros((rows, k // 128), np.float16), None, np.zeros((8, n), np.float32))
    b1, b2 = buffers(), buffers()
    k1, k2 = object(), object()
    assert gemm_launch(g, "gemm_t", k1, 0, *b1) is None
    f = gemm_launch(g, "gemm_t", k1, 8, *b1)
    assert gemm_launch(g, "gemm_t", k1, 5, *b1) is f and f.kernel is k1
    assert gemm_launch(g, "gemm_t", k2, 8, *b1) is not f
    other = gemm_launch(g, "gemm_t", k1, 8, *b2)
    assert other is not f and other.args[-3] is b2[4]      # out is the second set's
    with pytest.raises(ValueError, match="at least m=9 rows"):
        gemm_launch(g, "gemm_t", k1, 9, *b1)


def test_prepare_compiles_the_misses_and_leaves_cached_tiles_to_their_first_use(monkeypatch):
    """Gemm.prepare (the engine's start): a tile not in the kernel cache is compiled now (in
    the start's parallel batch); a cached one is not even loaded -- it loads when an M first
    needs it, so a warm start does not pay for tiles a short prompt never runs."""
    from nq.kernels.int4 import gemm as G
    calls, cached = [], {G.SMALL}
    monkeypatch.setattr(G, "in_cache", lambda body, sig, name, **o:
                        any(name == G.build_gemm("down", 64, 256, "mma", t)[2] for t in cached))
    monkeypatch.setattr(G, "compiled", lambda kind, n, k, layout, tiles: calls.append(tiles))
    g = G.Gemm("down", 64, 256, "mma")
    assert g.prepare() == 2 and calls == [G.MEDIUM, G.LARGE]
    calls.clear()
    assert g.prepare(up_to=16) == 0 and calls == []          # only SMALL runs M <= 16: cached
    cached.clear()
    assert g.prepare(up_to=40) == 2 and calls == [G.SMALL, G.MEDIUM]
