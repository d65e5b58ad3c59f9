"""The GPU engine with gate_up on the tensor cores (the default; tiling.MMA_GATE_UP; H200:
-m gpu): the upload writes gate_up's mma fragments, decode runs gemv_mma's gate_up, the
prefill GEMMs read the "mma" layout, and the engine still decodes and prefills as the fp32
reference, by test_engine_gpu.py's rules (whose models and helpers these are)."""
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
        mp.setattr(tiling, "MMA_GATE_UP", True)
        nf = packed_model(tmp_path_factory, CONFIGS[request.param], seed=6)
        eng = Engine.from_file(nf, max_len=512, prefill_chunk=128)
        yield request.param, nf, eng, RefModel(nf.config, load_host_weights(nf))


def test_gate_up_is_on_the_tensor_cores_everywhere(model):
    from nq.kernels.int4.launch import GateUpMmaGemv
    from nq.runtime.weights import gemvs, upload_mismatches
    name, nf, eng, ref = model
    assert isinstance(gemvs(nf.config)["gate_up"], GateUpMmaGemv), name
    assert eng.prefiller.gemm["gate_up"].layout == "mma", name
    assert upload_mismatches(nf, eng.w) == [], name   # gate_up: retile_mma == prepare


def test_greedy_steps_equal_reference(model):
    """48 greedy ids after an 11-token prompt; test_engine_gpu's near-tie rule for the
    7B-width model (152064 random logits a step)."""
    name, nf, eng, ref = model
    vocab = min(nf.config.vocab_size, 500)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, vocab, 11)]
    want, tops = reference_greedy(ref, prompt, 48)
    eng.reset()
    check_greedy(name, list(eng.generate_ids(prompt, 48, GREEDY)), want, tops)


@pytest.mark.parametrize("n", [20, 300])
def test_prefill_and_decode_logits_match_reference(model, n):
    """Logits after an n-token batched prefill (300: three chunks of 128) and 3 decode steps,
    within 2e-2 of the logit spread (test_engine_gpu's tolerance; gate_up's sums are now fp32,
    so only tighter)."""
    name, nf, eng, ref = model
    vocab = min(nf.config.vocab_size, 500)
    prompt = [int(t) for t in np.random.default_rng(n).integers(0, vocab, n)]
    prefill_then_decode_match(f"{name} n={n}", eng, ref, prompt)


def test_pdl_graph_equals_plain_graph(model):
    """A missing griddepcontrol.wait in the new kernel would read a stale residual now and
    then: 64 greedy steps with and without programmatic edges, the same ids and logits."""
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
