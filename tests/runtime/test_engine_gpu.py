"""The GPU engine end to end (H200): greedy ids equal the NumPy reference engine's, graph
replay equals eager launches, prefill+decode equals the reference's logits.

Both sides read the same packed file, so they see identical INT4 weights; the engine keeps
activations in fp16 between kernels and accumulates in fp32, the reference is fp32 throughout.
Weights come from nq.ref.random_weights (projections ~ N(0, 1/K)), which gives logits a spread
of order one, so a greedy choice is decided by the model and not by rounding noise.
"""
import fcntl
import hashlib
import os
import shutil

import numpy as np
import pytest

from nq.config import ModelConfig, tiny_config
from nq.loader.format import NanoqwenFile
from nq.loader.hf import hf_name, pack
from nq.loader.synth import make_hf_snapshot
from nq.loader.weights import load_host_weights
from nq.ref import RefModel, random_weights
from nq.sample import SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)

CONFIGS = {
    "d64": tiny_config(head_dim=64, num_heads=4, num_kv_heads=2, num_layers=2),
    "d128-gqa7": tiny_config(head_dim=128, num_heads=7, num_kv_heads=1, num_layers=2,
                             intermediate_size=640),
    "7b-width-2layers": ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                    num_layers=2, num_heads=28, num_kv_heads=4, head_dim=128,
                                    name="7b-width-2layers"),
}


def packed_model(tmp_path_factory, cfg, seed=0):
    """The packed file of nq.ref.random_weights(cfg, seed): one file for each (cfg, seed) in
    the whole run, shared by the modules and the xdist workers (the first to ask packs it
    under a lock, the others wait and map it).  A 7B-width 2-layer model is ~2.4 GB packed and
    its HF snapshot ~3 GB more while it packs: a copy a worker and a module filled the 64 GiB
    disk at -n 6 (H200, 2026-12-03) and at -n 12 (H100, 2026-12-07, 17 tests stopped)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent          # the run's folder, above the workers' own
    cache = root / "packed-models"
    cache.mkdir(exist_ok=True)
    key = hashlib.sha256(f"{cfg!r} seed={seed}".encode()).hexdigest()[:16]
    out = cache / f"{cfg.name}-{key}.nanoqwen"
    with open(cache / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)     # released when the file closes
        if not out.exists():
            w = random_weights(cfg, seed)
            if cfg.tie_word_embeddings:
                w.pop("lm_head", None)
            snap = make_hf_snapshot(tmp_path_factory.mktemp("hf"), cfg,
                                    weights={hf_name(k): v for k, v in w.items()})
            del w
            # the fp16 head: these tests hold the projections and the attention to the fp32
            # reference (#16's precision target); the default INT4 head rescored by its fp16
            # rows is tests/kernels/test_lm_head_int4_gpu.py's and `nq verify`'s
            # (tests/tools/test_verify_gpu.py)
            pack(snap, out, progress=False, lm_head="fp16")  # written beside, renamed when whole
            shutil.rmtree(snap, ignore_errors=True)   # the snapshot is only the pack's input
    return NanoqwenFile(out)


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request, tmp_path_factory):
    nf = packed_model(tmp_path_factory, CONFIGS[request.param])
    from nq.runtime.engine import Engine
    eng = Engine.from_file(nf, max_len=256)
    ref = RefModel(nf.config, load_host_weights(nf))
    return request.param, nf, eng, ref


def reference_greedy(ref, prompt, n):
    ref.reset()
    logits = ref.forward(np.array(prompt))[-1]
    out, tops = [], []
    for _ in range(n):
        order = np.argsort(logits)[::-1]
        tops.append((int(order[0]), float(logits[order[0]] - logits[order[1]]),
                     float(logits.max() - logits.min())))
        out.append(int(order[0]))
        logits = ref.forward(np.array([out[-1]]))[-1]
    return out, tops


def test_greedy_64_steps_equal_reference(model):
    """Identical greedy ids for 64 steps.  One exception, `nq verify`'s rule: a divergence at a
    step where the reference's top-2 logits are within TIE_TOL (2e-3) of the logit spread is a
    coin toss for any engine that rounds activations to fp16, and the ids after it are no longer
    comparable.  The tiny configs must match all 64 steps (they did on the H200); the 7B-width
    model (152064 random logits a step, so near-ties come often) matched 64/64 with the fp32
    attention kernel and diverged at step 43 with the tensor-core one, where the reference's
    top-2 gap was 2.9e-4."""
    name, nf, eng, ref = model
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, min(nf.config.vocab_size, 500), 11)]
    want, tops = reference_greedy(ref, prompt, 64)
    eng.reset()
    check_greedy(name, list(eng.generate_ids(prompt, 64, GREEDY)), want, tops)


def check_greedy(name, got, want, tops):
    """got == want, or a first divergence at a near-tie of the reference (within TIE_TOL of the
    logit spread), accepted for the 7B-width models only (printed)."""
    from nq.tools.verify import TIE_TOL
    if got != want:
        k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        _, gap, spread = tops[k]
        msg = (f"{name}: first divergence at step {k}: gpu {got[k]} vs ref {want[k]}; reference "
               f"top-2 gap there {gap:.3e} = {gap / spread:.2e} of the logit spread {spread:.3g}")
        if name.startswith("7b") and gap <= TIE_TOL * spread:
            print(msg + " (a near-tie: accepted)")
        else:
            pytest.fail(msg)


def test_prefill_logits_match_reference(model):
    """Logits after a 20-token prefill and 3 decode steps, against the fp32 reference.

    Tolerance: 2e-2 of the logit spread.  fp16 activations (rel. 5e-4 per rounding) feed
    INT4 GEMVs with fp16 partial sums, over 2 layers; errors stay ~1e-3 of the spread.
    """
    name, nf, eng, ref = model
    prefill_then_decode_match(name, eng, ref, list(range(3, 23)))


def prefill_then_decode_match(name, eng, ref, prompt, tokens=(5, 9, 2)):
    """The engine's logits after prefilling `prompt`, then after each decode step of `tokens`,
    within 2e-2 of the reference's logit spread."""
    ref.reset()
    eng.reset()
    want = ref.forward(np.array(prompt))[-1]
    got = eng.prefill(prompt)
    for tok in tokens:
        spread = float(want.max() - want.min())
        err = float(np.abs(got - want).max())
        assert err < 2e-2 * spread, f"{name}: max |gpu-ref| {err:.3e}, spread {spread:.3e}"
        want = ref.forward(np.array([tok]))[-1]
        got = eng.decode(tok)


def test_graph_replay_equals_eager(model):
    """The prompt (batched, then the head's eager lm_head and argmax) and three decode steps,
    with the step graph and with the same steps launched eagerly: the same logits, bit for bit."""
    name, nf, eng, ref = model
    prompt = [7, 8, 9, 10, 11]
    # every kernel-to-kernel edge is programmatic (PDL): embed..argmax is one chain
    assert eng.pdl and eng.graph.programmatic_edges == eng.graph.num_nodes - 1

    def run():
        eng.reset()
        out = [eng.prefill(prompt)]
        for tok in (5, 9, 2):
            out.append(eng.decode(tok))
        return out

    a = run()
    graph, eng.graph = eng.graph, None  # eager launches of the same steps
    try:
        b = run()
    finally:
        eng.graph = graph
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_pdl_graph_equals_plain_graph_over_many_steps(model):
    """Programmatic edges let each kernel start before the previous one ends; a missing
    griddepcontrol.wait would read stale activations now and then.  96 greedy steps with and
    without PDL must give the same ids and the same final logits, bit for bit."""
    name, nf, eng, ref = model
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    runs = []
    try:
        for pdl in (True, False):
            eng.capture(pdl)
            eng.reset()
            ids = list(eng.generate_ids(prompt, 96, GREEDY))
            runs.append((ids, eng.logits.copy_to_host()))
    finally:
        eng.capture(True)
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_full_edges_into_named_kernels(model):
    """make_programmatic(full_into=...) (step_variants' pdl.full=): the edges into the kernel
    after the attention's splits (attn_o_proj, or attn_combine where the step keeps it) stay
    full dependencies, one a layer, the rest programmatic; greedy ids and logits as the
    all-programmatic graph's."""
    from nq.runtime.step import FUSE_O, fused_o
    name, nf, eng, ref = model
    prompt = [2, 7, 1, 8, 2, 8]
    after = "attn_o_proj" if fused_o(nf.config, FUSE_O, {}) else "attn_combine"
    try:
        runs = []
        for full in ((), (after,)):
            eng.capture(True, full_into=full)
            if full:
                assert eng.graph.programmatic_edges == (eng.graph.num_nodes - 1
                                                        - nf.config.num_layers)
            eng.reset()
            runs.append((list(eng.generate_ids(prompt, 24, GREEDY)), eng.logits.copy_to_host()))
    finally:
        eng.capture(True)
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_teacher_forced_decode_logits_against_the_fp32_reference(model, capsys):
    """nq verify's decode tier on these nq.ref-initialised models (logits spread over a few
    units, as a trained model's): every decode step's logits, fed the reference's tokens,
    within TOL_DECODE of the spread; the figure is printed (the bandwidth issue's precision
    target is DECODE_TARGET at the 7B width)."""
    from nq.tools import references, verify
    name, nf, eng, ref = model
    prompts = np.random.default_rng(5).integers(0, min(nf.config.vocab_size, 500), (4, 12)).tolist()
    row = verify.decode_tier(eng, references.NumpyReference(nf), prompts, 48)
    with capsys.disabled():
        print(f"\n{name}: decode tier {row.detail}")
    assert row.passed, row


def step_variants_agree(eng, attns, check=None):
    """Greedy ids of a prompt under the default step and each of `attns` (attention options,
    Engine.variant, or (tilings, attention options) pairs), then `check(eng)` on the last
    variant; afterwards the defaults again.
    Every variant must give the default's ids and its last logits within 1e-3 of their
    spread (the variants merge the same partials in another order: not bit for bit)."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    runs = []
    try:
        for v in ({}, *attns):
            tilings, attn = v if isinstance(v, tuple) else (None, v)
            eng.variant(tilings, attn)
            eng.reset()
            ids = list(eng.generate_ids(prompt, 24, GREEDY))
            runs.append((ids, eng.logits.copy_to_host().astype(np.float64)))
        if check is not None:
            check(eng)
    finally:
        eng.variant()
    ids0, l0 = runs[0]
    spread = l0.max() - l0.min()
    for ids, logits in runs[1:]:
        assert ids == ids0
        assert np.abs(logits - l0).max() <= 1e-3 * spread, np.abs(logits - l0).max() / spread


def test_fused_o_proj_in_the_step(model, capsys):
    """The step with attn_o_proj (attn.fuse_o=1: the merge and o_proj in one kernel, opt-in),
    with and without the split kernel's early trigger, at 1 and 4 tiles a warp, and with the
    heads' shares into xacc (attn.fuse_o=2, gate_up and down taking it): the default
    step's greedy ids and logits (step_variants_agree: o rounded the same, the heads' shares
    summed in another order), and nq verify's decode tier passes with xacc."""
    from nq.kernels.int4.tiling import MmaTiling, default_tiling
    from nq.tools import references, verify
    name, nf, eng, ref = model
    c = nf.config
    if not isinstance(default_tiling("o_proj", c.hidden_size, c.q_size), MmaTiling):
        pytest.skip(f"{name}: o_proj runs on the CUDA cores at this width (its layout is not "
                    f"the tensor cores' that attn_o_proj reads)")

    def decode_tier(eng):
        eng.variant(attn={"fuse_o": 2})
        prompts = np.random.default_rng(5).integers(0, min(c.vocab_size, 500), (2, 12)).tolist()
        row = verify.decode_tier(eng, references.NumpyReference(nf), prompts, 24)
        with capsys.disabled():
            print(f"\n{name} fuse_o=2: decode tier {row.detail}")
        assert row.passed, row

    step_variants_agree(eng, ({"fuse_o": 1}, {"fuse_o": 1, "trigger": 0}, {"fuse_o": 1, "o_tpw": 1},
                              {"fuse_o": 1, "o_tpw": 4}, {"fuse_o": 2}), decode_tier)


def test_qkv_rope_early_in_the_step(model):
    """The step whose qkv_rope loads step 1 of its weights before the wait too, or not (the
    7B's default is early=1; the other form is the variant): the default step's greedy ids and
    logits."""
    import dataclasses

    from nq.kernels.int4.launch import gemv_tiling
    name, nf, eng, ref = model
    c = nf.config
    t = gemv_tiling("qkv_rope", c)
    if -(-(c.hidden_size // 128) // t.ks) < 2:
        pytest.skip(f"{name}: qkv_rope has one step of loads")
    other = dataclasses.replace(t, early=0 if t.early else 1)
    step_variants_agree(eng, (({"qkv_rope": other}, {}),))


def test_fill_kernels_match_their_reference():
    from numba import cuda

    from nq.kernels.fill import fill_f16, fill_u32, hash_u32_reference
    a = cuda.device_array(10_001, np.uint32)
    fill_u32(a, 12345)
    want = hash_u32_reference(12345, np.arange(10_001))
    np.testing.assert_array_equal(a.copy_to_host(), want)
    h = cuda.device_array((7, 13), np.float16)
    fill_f16(h, 3, 1.0, 0.25)
    got = h.copy_to_host().astype(np.float32)
    u = (hash_u32_reference(3, np.arange(91)) >> 8).astype(np.float32) / 16777216.0
    # atol one fp16 ulp at 1.0: the device may fuse the multiply-add before rounding to fp16
    np.testing.assert_allclose(got.reshape(-1), 1.0 + 0.25 * (2 * u - 1), rtol=0, atol=1e-3)


@pytest.mark.parametrize("n,k", [(3584, 18944), (3584, 3584), (896, 4864)])
def test_retile_mma_on_the_gpu(n, k):
    """The tensor-core GEMV's fragment layout (an MmaTiling's upload) against layout.mma_layout."""
    from numba import cuda

    from nq.kernels.int4 import retile
    from nq.kernels.int4.layout import mma_layout
    src = np.random.default_rng(n + k).integers(0, 2**32, (n, k // 8), dtype=np.uint32)
    dst = cuda.device_array_like(src)
    retile.retile_mma(cuda.to_device(src), dst)
    np.testing.assert_array_equal(dst.copy_to_host(), mma_layout(src))


def test_upload_retiles_on_the_gpu_exactly_as_prepare(model):
    """runtime.weights.upload (the pinned ring of nq/runtime/staging.py, on the engine's
    background thread and on the caller's) writes every tensor exactly: the launchers' prepare
    is the host reference of the re-tiled projections, the file's bytes of the rest."""
    from nq.runtime.weights import upload, upload_mismatches
    name, nf, eng, ref = model
    assert upload_mismatches(nf, eng.w) == [], name        # Engine.from_file: a thread
    assert upload_mismatches(nf, upload(nf)) == [], name   # in the calling thread
    # chunks smaller than a tensor, two buffers: pieces of one tensor in flight at once
    from nq.runtime import staging
    chunk, buffers = staging.CHUNK, staging.BUFFERS
    staging.CHUNK, staging.BUFFERS = 4096, 2
    try:
        w = upload(nf)
    finally:
        staging.CHUNK, staging.BUFFERS = chunk, buffers
    assert upload_mismatches(nf, w) == [], name


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The d128-gqa7 model with room for long prompts, built three ways: batched prefill in
    chunks of 128 (so prompts cross chunk boundaries), and the one-replay-per-token path."""
    from nq.runtime.engine import Engine
    nf = packed_model(tmp_path_factory, CONFIGS["d128-gqa7"], seed=4)
    batched = Engine.from_file(nf, max_len=1024, prefill_chunk=128)
    replay = Engine.from_file(nf, max_len=1024, prefill="replay")
    return nf, batched, replay, RefModel(nf.config, load_host_weights(nf))


@pytest.mark.parametrize("n", [2, 17, 128, 129, 300])
def test_batched_prefill_equals_the_reference_and_the_replay(long_model, n):
    """Logits after an n-token prompt: batched (chunks of 128) against the fp32 reference and
    against one decode replay a token.  Tolerance 2e-2 of the logit spread, as above: the GEMM
    adds one fp16 rounding of each scaled weight (~2e-4 of a dot product) to what decode has."""
    nf, batched, replay, ref = long_model
    prompt = [int(t) for t in np.random.default_rng(n).integers(0, nf.config.vocab_size, n)]
    ref.reset()
    want = ref.forward(np.array(prompt), last_only=True)[-1]
    spread = float(want.max() - want.min())
    for eng in (batched, replay):
        eng.reset()
        got = eng.prefill(prompt)
        err = float(np.abs(got - want).max())
        assert err < 2e-2 * spread, f"n={n}: max |gpu-ref| {err:.3e}, spread {spread:.3e}"
        assert eng.length == n


def test_batched_prefill_continues_a_context(long_model):
    """A chat turn: 300 tokens, 5 decoded, then 200 more prefilled after them (start = 305),
    then greedy tokens, against the reference doing the same."""
    nf, batched, _, ref = long_model
    rng = np.random.default_rng(7)
    first = [int(t) for t in rng.integers(0, nf.config.vocab_size, 300)]
    second = [int(t) for t in rng.integers(0, nf.config.vocab_size, 200)]
    ref.reset()
    batched.reset()
    ref.forward(np.array(first))
    batched.prefill(first)
    for tok in (5, 9, 2, 7, 1):
        want = ref.forward(np.array([tok]))[-1]
        got = batched.decode(tok)
    want = ref.forward(np.array(second), last_only=True)[-1]
    got = batched.prefill(second)
    spread = float(want.max() - want.min())
    assert float(np.abs(got - want).max()) < 2e-2 * spread
    assert batched.length == 505


def test_greedy_after_a_batched_prefill_equals_the_replay(long_model):
    """64 greedy tokens after a 257-token prompt: the batched and the replay prefill give the
    same ids (the near-tie rule of nq verify the only excuse)."""
    from nq.tools.verify import TIE_TOL
    nf, batched, replay, ref = long_model
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, nf.config.vocab_size, 257)]
    want, tops = reference_greedy(ref, prompt, 64)
    for eng in (batched, replay):
        eng.reset()
        got = list(eng.generate_ids(prompt, 64, GREEDY))
        if got != want:
            k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            _, gap, spread = tops[k]
            assert gap <= TIE_TOL * spread, (f"divergence at step {k}: top-2 gap {gap:.3e} of "
                                             f"spread {spread:.3g}")


def test_32b_width_decodes_and_prefills_as_the_reference(tmp_path_factory):
    """The 32B's shapes (hidden 5120, intermediate 27648, GQA 5:1): its down stages 55 KB of
    activations, over the 48 KB of static shared memory, so gemv_mma takes them in dynamic
    shared memory.  Two layers at the full width: a 300-token batched prefill's last logits
    and 32 greedy steps against the fp32 reference (the same rules as the tests above)."""
    from nq.runtime.engine import Engine
    from nq.tools.verify import TIE_TOL
    cfg = ModelConfig(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                      num_layers=2, num_heads=40, num_kv_heads=8, head_dim=128,
                      name="32b-width-2layers")
    nf = packed_model(tmp_path_factory, cfg, seed=5)
    eng = Engine.from_file(nf, max_len=512)
    from nq.runtime.weights import gemvs
    from nq.kernels.int4.gemv_mma import dynamic_smem, launch_smem
    down = gemvs(cfg)["down"]
    assert dynamic_smem(down.k) == 2 * 27648        # the dynamic path is the one under test
    assert down.smem == launch_smem(down.k, down.tiling)   # with early's slots after it
    ref = RefModel(nf.config, load_host_weights(nf))
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 500, 300)]
    ref.reset()
    want = ref.forward(np.array(prompt))[-1]
    eng.reset()
    got = eng.prefill(prompt)
    spread = float(want.max() - want.min())
    assert float(np.abs(got - want).max()) < 2e-2 * spread
    want_ids, tops = reference_greedy(ref, prompt[:13], 32)
    eng.reset()
    got_ids = list(eng.generate_ids(prompt[:13], 32, GREEDY))
    if got_ids != want_ids:
        k = next(i for i, (a, b) in enumerate(zip(got_ids, want_ids)) if a != b)
        _, gap, spread = tops[k]
        assert gap <= TIE_TOL * spread, (f"first divergence at step {k}: gpu {got_ids[k]} vs ref "
                                         f"{want_ids[k]}; reference top-2 gap {gap / spread:.2e} "
                                         "of the spread")


def within_prefill_tolerance(got, want, what):
    """The batched-prefill tolerance of the tests above: 2e-2 of the logit spread."""
    spread = float(want.max() - want.min())
    err = float(np.abs(got - want).max())
    assert err < 2e-2 * spread, f"{what}: max |batched-replay| {err:.3e}, spread {spread:.3e}"


@pytest.mark.parametrize("n", [2, 127, 128, 129, 300])
def test_the_batched_head_equals_the_replayed_last_step(long_model, n, monkeypatch):
    """prefill(ids): the whole prompt batched (chunks of 128: the last token's row is
    (n - 1) % 128 of the last chunk), then lm_head and argmax on that row alone, against the
    replay engine's decode step of the last token.  Logits within the batched-prefill tolerance;
    the state the step leaves (position, step; the token its own logits' argmax, in out_ids
    at the last prompt token's step); and no decode step on the batched side."""
    from nq.paged import STATE_POS, STATE_STEP, STATE_TOKEN
    nf, batched, replay, ref = long_model
    prompt = [int(t) for t in np.random.default_rng(100 + n).integers(0, nf.config.vocab_size, n)]
    ends = []
    for eng in (replay, batched):
        eng.reset()
        if eng is batched:
            steps = []
            monkeypatch.setattr(eng, "step", lambda sampled=False: steps.append(sampled))
        logits = eng.prefill(prompt)
        st, out = eng.state.copy_to_host(), eng.out_ids.copy_to_host()
        assert st[STATE_TOKEN] == int(np.argmax(logits)) == out[n - 1]
        assert eng.length == n
        ends.append((logits, int(st[STATE_POS]), int(st[STATE_STEP])))
    assert steps == []
    within_prefill_tolerance(ends[1][0], ends[0][0], f"n={n}")
    assert ends[0][1:] == ends[1][1:] == (n, n)


@pytest.mark.parametrize("n", [2, 130])
def test_the_batched_head_continues_a_context_as_the_replay(long_model, n):
    """A chat turn: 150 tokens, 3 decoded, then n more (start 153; 130 crosses a chunk of 128,
    the last row 1 of the second chunk): the batched head's logits against the replay's."""
    nf, batched, replay, ref = long_model
    rng = np.random.default_rng(n)
    first = [int(t) for t in rng.integers(0, nf.config.vocab_size, 150)]
    second = [int(t) for t in rng.integers(0, nf.config.vocab_size, n)]
    got = []
    for eng in (replay, batched):
        eng.reset()
        eng.prefill(first)
        for tok in (5, 9, 2):
            eng.decode(tok)
        got.append(eng.prefill(second))
        assert eng.length == 153 + n
    within_prefill_tolerance(got[1], got[0], f"{n} tokens after 153")


@pytest.mark.parametrize("n", [2, 129])
def test_greedy_ids_equal_between_the_head_and_the_replay(long_model, n):
    """32 greedy tokens after an n-token prompt, the first from the batched head, against the
    replay engine's: identical, unless they part where the replay's own top-2 logits are within
    nq verify's TIE_TOL of the spread (fp16 rounding decides a coin toss)."""
    from nq.tools.verify import TIE_TOL
    nf, batched, replay, ref = long_model
    prompt = [int(t) for t in np.random.default_rng(200 + n).integers(0, nf.config.vocab_size, n)]
    ids = []
    for eng in (replay, batched):
        eng.reset()
        ids.append(list(eng.generate_ids(prompt, 32, GREEDY)))
    want, got = ids
    if got != want:
        k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        replay.reset()
        logits = replay.prefill(prompt)
        for tok in want[:k]:
            logits = replay.decode(tok)
        top = np.sort(logits)[::-1]
        spread = float(top[0] - top[-1])
        assert top[0] - top[1] <= TIE_TOL * spread, (
            f"n={n}: divergence at token {k}: batched {got[k]} vs replay {want[k]}, top-2 gap "
            f"{(top[0] - top[1]) / spread:.2e} of the spread")


def test_i8_projections_in_the_step(model, capsys):
    """The step with gate_up's and down's activations as signed-byte digits (i8; gate_up's by
    default, down's opt-in), then attn_o_proj's too: the default step's greedy ids and logits
    (step_variants_agree), and nq verify's decode tier passes with all three.  (qkv's fp16
    form is not compared here: its error against the digits, ~1e-3 of the spread, is the
    size of this check's tolerance; test_gemv_gpu holds it to its reference.)"""
    import dataclasses

    from nq.kernels.int4.launch import gemv_tiling
    from nq.kernels.int4.tiling import MmaTiling
    from nq.tools import references, verify
    name, nf, eng, ref = model
    c = nf.config
    tilings = {kind: dataclasses.replace(gemv_tiling(kind, c), i8=1) for kind in ("gate_up", "down")
               if isinstance(gemv_tiling(kind, c), MmaTiling)}
    if not tilings:
        pytest.skip(f"{name}: gate_up and down run on the CUDA cores at this width")

    def decode_tier(eng):
        prompts = np.random.default_rng(9).integers(0, min(c.vocab_size, 500), (2, 12)).tolist()
        row = verify.decode_tier(eng, references.NumpyReference(nf), prompts, 40)
        with capsys.disabled():
            print(f"\n{name} i8 {sorted(tilings)}: decode tier {row.detail}")
        assert row.passed, row

    attn = {"o_i8": 1} if "down" in tilings else {}   # attn_o_proj goes with the mma down
    step_variants_agree(eng, ((tilings, {}), (tilings, attn)), decode_tier)
