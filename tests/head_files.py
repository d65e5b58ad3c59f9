"""Tiny models packed with a quantised lm_head, for the tests of the rescored INT4 head on
either side of the GPU (a helper module on the tests' path, as ptx_util and sim_warp are: a
`from conftest import` would find whichever conftest.py was imported first)."""
from nq.config import tiny_config


def packed_with_head(tmp_path, head: str, tie: bool, vocab: int = 1800):
    """(cfg, NanoqwenFile): a 2-layer tiny model of nq.ref's random init (seed 3), packed with
    `nq pack --lm-head head` (tied: the embedding doubles as the fp16 head)."""
    from nq.loader.format import NanoqwenFile
    from nq.loader.hf import hf_name, pack
    from nq.loader.synth import make_hf_snapshot
    from nq.ref import random_weights

    cfg = tiny_config(num_layers=2, vocab_size=vocab, tie=tie)
    w = random_weights(cfg, 3)
    if tie:
        w.pop("lm_head", None)
    snap = make_hf_snapshot(tmp_path / "hf", cfg, weights={hf_name(k): v for k, v in w.items()})
    return cfg, NanoqwenFile(pack(snap, tmp_path / "m.nanoqwen", progress=False, lm_head=head))
