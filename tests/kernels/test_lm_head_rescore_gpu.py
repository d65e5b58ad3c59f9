"""GPU tests of the INT4 head's rescoring (nq/kernels/lm_head_rescore.py; H200: -m gpu).

fp16 rows W (V, H), their INT4 g128 form as the packer writes it, and for each of several x:
the INT4 head's logits, the fp16 head's logits (its own kernel), then the rescoring of the
INT4 logits.  What must hold: the candidates of the NumPy reference carry the fp16 head's
logits bit for bit (the same staging and row dot), every other id keeps the INT4 head's, and
the argmax is the fp16 head's -- on rows built in near-tied pairs, where the INT4 head alone
picks another token for some x.  Widths of the 0.5B, 7B and 32B; 32,768 rows (the host's
packing of a whole vocabulary takes longer than the kernels).
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402  (the marker deselects this module on CPU-only runs)

from nq.config import PRESETS  # noqa: E402
from nq.kernels.lm_head import LmHead  # noqa: E402
from nq.kernels.lm_head_int4 import Int4Rows, LmHeadInt4  # noqa: E402
from nq.kernels.lm_head_rescore import ref_rescore, row_bounds  # noqa: E402
from nq.loader.quant import quantize_pack  # noqa: E402

VOCAB = 32768


@pytest.mark.parametrize("size", ["7b", "0.5b", "32b"])
def test_rescored_logits_are_the_fp16_heads_at_the_candidates(size):
    cfg = PRESETS[size]
    k = cfg.hidden_size

    class C:
        vocab_size, hidden_size, rms_norm_eps = VOCAB, k, cfg.rms_norm_eps

    rng = np.random.default_rng(7)
    base = rng.standard_normal((VOCAB // 2, k)).astype(np.float32) / np.sqrt(k)
    w = np.repeat(base, 2, axis=0)
    w += rng.standard_normal(w.shape).astype(np.float32) * (0.02 / np.sqrt(k))
    w = w.astype(np.float16)
    qw, sc = quantize_pack(w.astype(np.float32))
    nw = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
    int4 = LmHeadInt4(C)
    rows = Int4Rows(*(cuda.to_device(a) for a in int4.prepare(qw, sc)))
    rescored = LmHeadInt4(C, rescore=True)
    bound = row_bounds(sc)
    rows_x = rows._replace(exact=cuda.to_device(w), bound=cuda.to_device(bound))
    fp16 = LmHead(C)
    dw, dnw = cuda.to_device(w), cuda.to_device(nw)
    lost = shares = 0
    for trial in range(8):
        x = (rng.standard_normal(k) * 2).astype(np.float32)
        dx = cuda.to_device(x)
        outs = []
        for head, weight in ((int4, rows), (fp16, dw), (rescored, rows_x)):
            out = cuda.to_device(np.full(VOCAB, np.nan, np.float32))
            head(dx, dnw, weight, out, 0)
            outs.append(out.copy_to_host())
        got4, got16, got = outs
        _, cand = ref_rescore(got4, bound, x, nw, cfg.rms_norm_eps, w)
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got[cand], got16[cand])     # bit for bit
        np.testing.assert_array_equal(got[~cand], got4[~cand])
        assert np.argmax(got) == np.argmax(got16)
        lost += int(np.argmax(got4) != np.argmax(got16))
        shares += cand.mean() / 8
    assert lost >= 1, "no x where the INT4 head alone lost the token: the case tests nothing"
    assert shares < 0.08, shares   # random rows: logits near the top are dense
