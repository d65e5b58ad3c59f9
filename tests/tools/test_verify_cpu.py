"""`nq verify` on the CPU: the divergence analysis, the graph tier's harness (the NumPy engine
against transformers and against nq.ref, which must agree exactly on greedy ids), the table,
and the refusal without a GPU.  The unit and layer tiers need the GPU (run on the H200)."""
import numpy as np
import pytest

from nq.tools import references, verify
from nq.cli import main
from nq.loader.format import NanoqwenFile
from nq.ref import NumpyBackend


def test_compare_explains_near_ties_and_flags_the_rest():
    ref = [references.Greedy([1, 2, 3], [5.0, 5.0, 5.0], [10.0] * 3),
           references.Greedy([1, 2, 3], [5.0, 0.001, 5.0], [10.0] * 3),   # a near-tie at step 1
           references.Greedy([4, 5, 6], [5.0, 5.0, 5.0], [10.0] * 3)]     # a clear choice at step 0
    res = verify.compare([[1, 2, 3], [1, 9, 9], [7, 5, 6]], ref)
    assert res["identical"] == 1 and res["unexplained"] == 1
    near, clear = res["mismatches"]
    assert (near["prompt"], near["step"], near["within_rounding"]) == (1, 1, True)
    assert (clear["prompt"], clear["step"], clear["within_rounding"]) == (2, 0, False)
    assert clear["engine"] == 7 and clear["reference"] == 4


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_graph_tier_harness_numpy_engine_vs_reference(tiny_nanoqwen, kind):
    nf = NanoqwenFile(tiny_nanoqwen)
    ref = references.TorchReference(nf, "cpu") if kind == "torch" else references.NumpyReference(nf)
    prompts = np.random.default_rng(0).integers(0, 490, (4, 6)).tolist()
    row, res = verify.graph_tier(NumpyBackend.from_file(nf, max_len=64), ref, prompts, 8)
    assert res["identical"] == 4, res["mismatches"]
    assert row.passed and row.tier == "graph" and "4/4 identical" in row.detail


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_prefill_tier_harness_numpy_engine_vs_reference(tiny_nanoqwen, kind):
    nf = NanoqwenFile(tiny_nanoqwen)
    ref = references.TorchReference(nf, "cpu") if kind == "torch" else references.NumpyReference(nf)
    rows = verify.prefill_tier(NumpyBackend.from_file(nf, max_len=64), ref, [1, 5, 13],
                              vocab=nf.config.vocab_size)
    assert [r.name for r in rows] == ["1-token prompt, last logits", "5-token prompt, last logits",
                                      "13-token prompt, last logits", "7 tokens after 6 cached"]
    assert all(r.passed and r.error < 1e-4 and r.detail == "top-1 agrees" for r in rows), rows


def test_prefill_tier_fails_a_wrong_position(tiny_nanoqwen):
    # an engine that answers with the logits of the second-to-last position must fail
    nf = NanoqwenFile(tiny_nanoqwen)

    class OneBehind:
        def __init__(self):
            self.inner, self.ids = NumpyBackend.from_file(nf, max_len=64), []

        def reset(self):
            self.inner.reset(), self.ids.clear()

        def prefill(self, ids):
            self.ids += list(ids)
            self.inner.reset()
            return self.inner.prefill(self.ids[:-1])

    rows = verify.prefill_tier(OneBehind(), references.NumpyReference(nf), [9],
                              vocab=nf.config.vocab_size)
    assert not any(r.passed for r in rows) and all(r.error > verify.TOL_PREFILL for r in rows)


def test_table_marks_failures():
    rows = [verify.Row("unit", "a", 1e-3, 5e-3), verify.Row("unit", "b", float("nan"), 1.0),
            verify.Row("graph", "c", 2.0, 0.0, "2 unexplained")]
    text = verify.table(rows)
    assert text.count("| pass |") == 1 and text.count("| FAIL |") == 2


def test_verify_without_a_gpu_says_so(tiny_nanoqwen, capsys):
    from numba import cuda
    if cuda.is_available():
        pytest.skip("a GPU is present: nq verify runs for real there")
    assert main(["verify", "-m", str(tiny_nanoqwen)]) == 2
    assert "nq verify needs an NVIDIA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("tiers", ["unit,grpah", " ", "foo"])
def test_verify_refuses_unknown_tiers(tiny_nanoqwen, capsys, tiers):
    assert main(["verify", "-m", str(tiny_nanoqwen), "--tiers", tiers]) == 2
    assert "choose from unit, layer, prefill, decode, graph" in capsys.readouterr().err


def test_torch_dequantize_matches_numpy():
    torch = pytest.importorskip("torch")
    from nq.loader.quant import dequantize_packed, quantize_pack
    w = np.random.default_rng(3).standard_normal((24, 256)).astype(np.float32)
    qw, sc = quantize_pack(w)
    got = references.dequantize_packed_torch(torch, qw, sc, "cpu").numpy()
    np.testing.assert_array_equal(got, dequantize_packed(qw, sc))


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_decode_tier_harness_numpy_engine_vs_reference(tiny_nanoqwen, kind):
    if kind == "torch":
        pytest.importorskip("transformers")
    nf = NanoqwenFile(tiny_nanoqwen)
    ref = references.TorchReference(nf, "cpu") if kind == "torch" else references.NumpyReference(nf)
    prompts = np.random.default_rng(1).integers(0, 490, (3, 5)).tolist()
    row = verify.decode_tier(NumpyBackend.from_file(nf, max_len=64), ref, prompts, 6)
    assert row.tier == "decode" and row.name == "3 prompts x 5 teacher-forced decode steps, logits"
    assert row.passed and row.error < 1e-4, row
    assert "over 15 steps" in row.detail


def test_decode_tier_feeds_the_reference_tokens_not_the_engine_s(tiny_nanoqwen):
    # an engine whose decode ignores the token it is given and feeds its own argmax instead
    # diverges from the reference's sequence, and the teacher-forced logits must show it
    nf = NanoqwenFile(tiny_nanoqwen)

    class OwnChoice:
        def __init__(self):
            self.inner, self.last = NumpyBackend.from_file(nf, max_len=64), None

        def reset(self):
            self.inner.reset()

        def prefill(self, ids):
            self.last = self.inner.prefill(ids)
            return self.last

        def decode(self, token):
            self.last = self.inner.decode((int(np.argmax(self.last)) + 1) % 490)
            return self.last

    rows = verify.decode_tier(OwnChoice(), references.NumpyReference(nf),
                              np.random.default_rng(2).integers(0, 490, (2, 5)).tolist(), 5)
    assert not rows.passed and rows.error > verify.TOL_DECODE, rows


@pytest.mark.parametrize("head,tie", [("int4", True), ("int4+fp16", False)],
                         ids=["tied-int4", "int4+fp16"])
def test_references_rescore_an_int4_head_as_the_step_does(tmp_path, head, tie):
    """transformers' reference and nq.ref's give a rescored INT4 head's logits alike: the
    candidates from the fp16 rows (the step's), the rest from the INT4 head -- so `nq verify`
    compares the engine with what it computes, not with the INT4 head alone (which changes
    ~a quarter of a random model's greedy tokens).  Their alternatives (ALT_BAND) differ from
    the logits only at ids on the candidates' edge."""
    from head_files import packed_with_head

    cfg, nf = packed_with_head(tmp_path, head, tie)
    npr, thr = references.NumpyReference(nf), references.TorchReference(nf, "cpu")
    assert npr.model.rescore is not None and thr.rescore is not None
    ids = [5, 17, 99, 3, 1200, 42, 7, 8, 900]
    a, b = npr.all_logits(ids), thr.all_logits(ids)
    spread = a.max(-1) - a.min(-1)
    assert (np.abs(a - b).max(-1) / spread).max() < 1e-4
    got, alt = thr.all_logits_pair(ids, verify.ALT_BAND)
    np.testing.assert_array_equal(got, b)
    # the INT4 head alone, and every id from the fp16 rows (bounds so wide all are candidates)
    saved = thr.rescore
    thr.rescore = None
    plain = thr.all_logits(ids)
    thr.rescore = (saved[0], saved[1] * 1e6)
    exact = thr.all_logits(ids)
    thr.rescore = saved
    tol = 1e-5 * spread[:, None]
    cand = np.abs(b - exact) <= tol
    assert cand.any() and (cand.sum(-1) < 0.5 * cfg.vocab_size).all()
    assert (np.abs(b - plain)[~cand] <= tol.repeat(cfg.vocab_size, 1)[~cand]).all()
    # alternatives: at a few ids on the edge, each the value the logits did not take there
    edge = alt != got
    assert 0 < edge.sum() < cand.sum()
    other = np.where(cand, plain, exact)
    assert (np.abs(alt - other)[edge] <= tol.repeat(cfg.vocab_size, 1)[edge]).all()
    npa, npalt = npr.all_logits_pair(ids, verify.ALT_BAND)
    assert (np.abs(npa - got).max(-1) / spread).max() < 1e-4
    assert npalt.shape == alt.shape
    # greedy runs (the graph tier's) pick the rescored head's tokens in both
    np.testing.assert_allclose(thr.last_logits(ids), b[-1], rtol=0, atol=1e-5 * spread[-1])
    assert thr.greedy([ids], 6)[0].ids == npr.greedy([ids], 6)[0].ids


def test_logit_error_takes_the_nearer_alternative():
    ref = np.array([0.0, 1.0, 10.0])
    got = np.array([0.0, 1.5, 10.0])
    assert verify.logit_error(got, ref) == pytest.approx(0.05)
    assert verify.logit_error(got, ref, np.array([0.0, 1.5, 10.0])) == 0.0
    assert verify.logit_error(got, ref, np.array([0.0, 3.0, 10.0])) == pytest.approx(0.05)
