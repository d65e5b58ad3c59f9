"""The GPU engine with qkv on the tensor cores (NQ_MMA_QKV=1, tiling.MMA_QKV; H200: -m gpu): the
upload writes qkv's rope-ordered mma fragments, decode runs gemv_mma's qkv_rope, the prefill
GEMMs read ("mma_rope", head_dim) and put their output back in order, and the engine still
decodes and prefills as the fp32 reference, by test_engine_gpu.py's rules (whose models and
helpers these are).  test_teacher_forced_logits prints issue #16's figure (max |dlogit| over
the spread, the 7B-width model, teacher-forced) with every projection's sums in fp32."""
import numpy as np
import pytest

from test_engine_gpu import (CONFIGS, GREEDY, check_greedy, packed_model,
                             prefill_then_decode_match, reference_greedy)

from nq.loader.weights import load_host_weights
from nq.ref import RefModel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request, tmp_path_factory):
    """An engine built, and used, with the switch on (it is read where launchers are built:
    the upload, the step, the prefill)."""
    from nq.kernels.int4 import tiling
    from nq.runtime.engine import Engine
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiling, "MMA_QKV", True)
        nf = packed_model(tmp_path_factory, CONFIGS[request.param], seed=7)
        eng = Engine.from_file(nf, max_len=512, prefill_chunk=128)
        yield request.param, nf, eng, RefModel(nf.config, load_host_weights(nf))


def test_qkv_is_on_the_tensor_cores_everywhere(model):
    from nq.kernels.int4.launch import QkvMmaGemv
    from nq.runtime.weights import gemvs, upload_mismatches
    name, nf, eng, ref = model
    assert isinstance(gemvs(nf.config)["qkv"], QkvMmaGemv), name
    assert eng.prefiller.gemm["qkv"].layout == ("mma_rope", nf.config.head_dim), name
    assert upload_mismatches(nf, eng.w) == [], name   # qkv: retile_mma(rope) == prepare


def test_greedy_steps_equal_reference(model):
    name, nf, eng, ref = model
    vocab = min(nf.config.vocab_size, 500)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, vocab, 11)]
    want, tops = reference_greedy(ref, prompt, 48)
    eng.reset()
    check_greedy(name, list(eng.generate_ids(prompt, 48, GREEDY)), want, tops)


@pytest.mark.parametrize("n", [20, 300])
def test_prefill_and_decode_logits_match_reference(model, n):
    """Logits after an n-token batched prefill (300: three chunks of 128) and 3 decode steps,
    within 2e-2 of the logit spread (test_engine_gpu's tolerance)."""
    name, nf, eng, ref = model
    vocab = min(nf.config.vocab_size, 500)
    prompt = [int(t) for t in np.random.default_rng(n).integers(0, vocab, n)]
    prefill_then_decode_match(f"{name} n={n}", eng, ref, prompt)


def test_teacher_forced_logits(model):
    """Issue #16: teacher-forced decode steps (each fed the reference's token), max |gpu - ref|
    over the logit spread, printed; asserted at test_engine_gpu's 2e-2 (the target, 5e-4, is
    for the whole step: attention's fp16 P.V and the fp16 activations stay)."""
    name, nf, eng, ref = model
    vocab = min(nf.config.vocab_size, 500)
    toks = [int(t) for t in np.random.default_rng(5).integers(0, vocab, 24)]
    ref.reset()
    eng.reset()
    worst = 0.0
    want = ref.forward(np.array(toks[:2]))[-1]
    got = eng.prefill(toks[:2])
    for tok in toks[2:]:
        worst = max(worst, float(np.abs(got - want).max()) / float(want.max() - want.min()))
        want = ref.forward(np.array([tok]))[-1]
        got = eng.decode(tok)
    print(f"\n{name}: NQ_MMA_QKV=1 teacher-forced max |dlogit| / spread = {worst:.2e}")
    assert worst < 2e-2, (name, worst)


def test_pdl_graph_equals_plain_graph(model):
    """A missing griddepcontrol.wait in the new kernel would read a stale residual or position
    now and then: 64 greedy steps with and without programmatic edges, the same ids and logits."""
    name, nf, eng, ref = model
    runs = []
    try:
        for pdl in (True, False):
            eng.capture(pdl)
            eng.reset()
            ids = list(eng.generate_ids([3, 1, 4, 1, 5, 9, 2, 6], 64, GREEDY))
            runs.append((ids, eng.logits.copy_to_host()))
    finally:
        eng.capture(True)
    assert runs[0][0] == runs[1][0], name
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
