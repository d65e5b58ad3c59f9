"""Write a valid .nanoqwen of a Qwen2.5 preset shape with random INT4 weights, fast.

    python3 scripts/make_random_nanoqwen.py 7b /tmp/random-7b.nanoqwen
    python3 scripts/make_random_nanoqwen.py 7b /tmp/7b-width-2l.nanoqwen --layers 2
    python3 scripts/make_random_nanoqwen.py 7b /tmp/random-7b-int8.nanoqwen --lm-head int8
    python3 scripts/make_random_nanoqwen.py 7b /tmp/random-7b-int4.nanoqwen --lm-head int4

For what needs a full-size file but not a real checkpoint: the weight-upload time of the
engine, `nq generate -m` on the GPU at the real shape, `nq info --verify`.  The nibbles and
fp16 values are tiled from one random block (no quantiser runs), so a 7B file takes seconds
rather than the minutes of `scripts/make_fake_checkpoint.py` + `nq pack`.  The test tokenizer
of nq.loader.synth is embedded, so the file is self-contained.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nq.config import DEFAULT_LM_HEAD, GROUP_SIZE, LM_HEADS, PRESETS  # noqa: E402
from nq.loader.format import expected_tensors, write_nanoqwen  # noqa: E402
from nq.loader.synth import (build_tokenizer_json, generation_config,  # noqa: E402
                             special_token_ids, tokenizer_config)


PRIME = 4_194_301  # the largest prime below 2**22


def random_tensors(cfg, seed: int = 0, text_ids: int = 0, lm_head: str = DEFAULT_LM_HEAD):
    """text_ids > 0: lm_head rows outside [256, text_ids) are zero, so the model's greedy
    choice is one of the tokenizer's merged tokens (random logits around 0, the rest exactly 0):
    each decodes to text on its own, where a byte token >= 0x80 alone is half a UTF-8 character
    and a stream shows nothing for it.  lm_head's shape, and so its cost, is unchanged."""
    rng = np.random.default_rng(seed)
    # Blocks of a prime length P > every row length: row r of a tensor starts at r*K mod P,
    # so no two rows of any matrix are equal (a power-of-two block repeats rows, and an
    # lm_head with equal rows makes exact logit ties that no greedy comparison can judge).
    block_u32 = rng.integers(0, 2**32, PRIME, dtype=np.uint32)  # 16 MB of random nibbles
    block_f = rng.standard_normal(PRIME).astype(np.float32)
    for name, (dtype, shape) in expected_tensors(cfg, lm_head).items():
        if name.startswith("meta/"):
            continue
        if name == "lm_head.qweight" and dtype == np.int8:   # bytes uniform in [-128, 127], std ~74
            t = np.resize(block_u32, (shape[0], shape[1] // 4)).view(np.int8)
            if text_ids:
                t[:256] = 0
                t[text_ids:] = 0
            yield name, t
        elif name == "lm_head.scales" and dtype == np.float32:  # the fp16 head's 1/sqrt(H) spread
            yield name, np.full(shape, 1.0 / (74.0 * np.sqrt(cfg.hidden_size)), np.float32)
        elif dtype == np.uint32:           # the projections, and an int4 lm_head (--lm-head int4)
            t = np.resize(block_u32, shape)
            if text_ids and name == "lm_head.qweight":
                t[:256] = 0
                t[text_ids:] = 0
            yield name, t
        elif name.endswith(".scales"):
            k = shape[1] * GROUP_SIZE
            yield name, np.full(shape, 1.0 / (4.6 * np.sqrt(k)), np.float16)
        elif name.endswith("layernorm") or name == "norm":
            yield name, (1.0 + 0.1 * np.resize(block_f, shape)).astype(np.float16)
        elif name.endswith(".bias"):
            yield name, (0.1 * np.resize(block_f, shape)).astype(np.float16)
        else:  # embed_tokens, lm_head
            scale = 0.1 if name == "embed_tokens" else 1.0 / np.sqrt(shape[1])
            t = (scale * np.resize(block_f, shape)).astype(np.float16)
            if text_ids and name == "lm_head":
                t[:256] = 0
                t[text_ids:] = 0
            yield name, t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("size", choices=sorted(PRESETS))
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, help="keep the preset's width, use this many layers")
    ap.add_argument("--text-ids", action="store_true",
                    help="greedy picks only tokens that decode to text on their own (lm_head "
                         "rows of the others are zero): for timing a text stream "
                         "(scripts/serve_probe.py)")
    ap.add_argument("--lm-head", choices=list(LM_HEADS), default=DEFAULT_LM_HEAD,
                    help="the lm_head as `nq pack --lm-head` writes it (default, as its: "
                         f"{DEFAULT_LM_HEAD}; the fp16 rows then random ones unrelated to the "
                         "INT4 rows, as `nq bench --random` makes them)")
    args = ap.parse_args(argv)
    cfg = PRESETS[args.size]
    if args.text_ids and cfg.tie_word_embeddings:
        ap.error(f"--text-ids: {args.size} ties lm_head to the embedding; pick an untied size (7b)")
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers, name=f"{cfg.name}-{args.layers}layers")
    tj = build_tokenizer_json(min(cfg.vocab_size, 4096))
    ids = special_token_ids(tj)
    meta = {"tokenizer.json": tj.encode(),
            "tokenizer_config.json": json.dumps(tokenizer_config(tj)).encode(),
            "generation_config.json": json.dumps(
                generation_config(ids["<|im_end|>"], ids["<|endoftext|>"])).encode(),
            "config.json": json.dumps(cfg.to_hf()).encode()}
    t0 = time.perf_counter()
    n_text = min(ids.values()) if args.text_ids else 0  # the regular ids; specials follow them
    out = write_nanoqwen(args.out, cfg, random_tensors(cfg, args.seed, n_text, args.lm_head), meta,
                         "random", lm_head=args.lm_head)
    print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
