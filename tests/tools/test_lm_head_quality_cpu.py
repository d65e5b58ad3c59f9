"""scripts/lm_head_quality.py on a packed model and real text (its `--model` mode): the rows
it prints for each quantised head, and what it refuses."""
import pytest

from nq.config import tiny_config
from nq.loader.hf import pack
from nq.loader.synth import make_hf_snapshot
from script_util import load_script


def _script():
    return load_script("lm_head_quality")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q")
    cfg = tiny_config(num_layers=1)
    snap = make_hf_snapshot(tmp / "hf", cfg, seed=4)
    text = tmp / "code.py"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 40)
    return (str(pack(snap, tmp / "m.nanoqwen", progress=False)),     # int4+fp16, the default
            str(pack(snap, tmp / "m8.nanoqwen", progress=False, lm_head="int8")), str(text))


def test_a_packed_model_on_text(packed, capsys):
    path, _, text = packed
    assert _script().main(["--model", path, "--text", text, "--prompts", "3",
                           "--prompt-len", "12"]) == 0
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert [r.split(" | ")[1] for r in rows] == ["int8", "int4", "int4+fp16"], out
    rescored = rows[2].split(" | ")
    assert rescored[3].startswith("100.00 %"), out          # the fp16 head's greedy tokens
    median, most = rescored[10].rstrip(" |").split(", ")
    assert 1 <= float(median) <= int(most) < 512, out       # some rows, far from all
    assert rows[0].split(" | ")[10].startswith("-")
    for r in rows:
        for cell in r.split(" | ")[11:13]:                     # sampling TV distances
            mean, most = (float(v) for v in cell.rstrip(" |").split(", "))
            assert 0.0 <= mean <= most <= 1.0, out
        cells = r.split(" | ")
        assert cells[2] == "36"                                # 3 windows x 12 positions
        agree = float(cells[3].split(" %")[0])
        assert 0.0 <= agree <= 100.0
        assert float(cells[4].split(" ")[0]) > 0               # a quantised head moves logits
        assert cells[7] == "-"                                 # no fp32 source in a file


def test_what_it_refuses(packed):
    path, path8, text = packed
    q = _script()
    with pytest.raises(SystemExit, match="needs --text"):
        q.main(["--model", path])
    with pytest.raises(SystemExit, match="already int8, without the fp16 rows"):
        q.main(["--model", path8, "--text", text])
    with pytest.raises(SystemExit, match="fewer than --prompt-len"):
        q.main(["--model", path, "--text", text, "--prompt-len", "100000"])


def test_the_searched_int4_experiment_never_does_worse_a_group():
    """int4s tries c = 1 too (the packer's absmax / 7), so no group's squared error exceeds
    the plain INT4 head's, and on Gaussian rows the total is well under it."""
    import numpy as np

    from nq.loader.quant import dequantize_packed, quantize_pack
    src = np.random.default_rng(0).standard_normal((300, 256)).astype(np.float32)
    plain = dequantize_packed(*quantize_pack(src))
    searched = _script().int4_searched(src)
    e_plain = ((plain - src) ** 2).reshape(300, 2, 128).sum(axis=2)
    e_search = ((searched - src) ** 2).reshape(300, 2, 128).sum(axis=2)
    assert (e_search <= e_plain * (1 + 1e-6)).all()
    assert e_search.sum() < 0.85 * e_plain.sum()


def test_sampling_tv_is_the_distance_between_the_draws():
    """Equal logits draw alike (0, 0); an id outside the Qwen defaults' top-20 moved up counts
    only at T 1, untruncated; the top id's logit moved changes both."""
    import numpy as np
    q = _script()
    lg = np.random.default_rng(1).standard_normal(1000).astype(np.float32) * 3
    assert q.sampling_tv(lg, lg.copy()) == (0.0, 0.0)
    tail = lg.copy()
    low = int(np.argmin(lg))
    tail[low] += 2.0                       # still far below the top 20
    qwen, t1 = q.sampling_tv(tail, lg)
    assert qwen == 0.0 and 0.0 < t1 < 0.01
    top = lg.copy()
    top[int(np.argmax(lg))] += 1.0
    qwen, t1 = q.sampling_tv(top, lg)
    assert 0.05 < qwen < 1.0 and 0.05 < t1 < 1.0
