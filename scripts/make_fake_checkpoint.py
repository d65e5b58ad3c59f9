#!/usr/bin/env python3
"""Write a synthetic checkpoint with the real Qwen2.5-7B tensor names, shapes and sharding.

For measuring `nq pack` (time, peak RSS) without hub access: random bf16 weights at a
trained model's scale, 4 shards plus model.safetensors.index.json, config.json and (by
default) a small tokenizer.  Streams 1M values at a time, so it needs ~100 MB of RAM for a
~15 GB checkpoint.

    python3 scripts/make_fake_checkpoint.py /tmp/fake-7b [--preset 7b] [--shards 4]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nq.config import PRESETS  # noqa: E402
from nq.loader import synth  # noqa: E402

BLOCK = 1 << 20                  # values per generated block


def random_bf16_bits(rng: np.random.Generator, n: int, norm: bool) -> np.ndarray:
    """n random bf16 bit patterns: |x| in [2^-9, 2^-5) with random sign (weights, biases),
    or 1 + small noise (norm weights).  Drawn as bits because N(0, 0.02) through fp32 costs
    ~10x more time for 7.6 billion values and changes nothing a pack measures."""
    r = np.frombuffer(rng.bytes(2 * n), np.uint16)
    if norm:
        return np.uint16(0x3F80) + (r & np.uint16(0x7))
    return (r & np.uint16(0x807F)) | ((np.uint16(118) + ((r >> np.uint16(7)) & np.uint16(3))) << np.uint16(7))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder to write the snapshot into")
    ap.add_argument("--preset", default="7b", choices=sorted(PRESETS))
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-tokenizer", action="store_true",
                    help="write no tokenizer files (`nq pack` refuses such a snapshot)")
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    shapes = synth.hf_shapes(cfg)
    rng = np.random.default_rng(args.seed)

    def produce(name):
        n = int(np.prod(shapes[name]))
        for start in range(0, n, BLOCK):
            yield random_bf16_bits(rng, min(BLOCK, n - start), name.endswith("norm.weight"))

    t0 = time.time()
    out = Path(args.out)
    synth.write_hf_checkpoint(out, cfg, produce, shards=args.shards, dtype="bfloat16")
    if not args.no_tokenizer:
        tj = synth.build_tokenizer_json(4096)
        ids = synth.special_token_ids(tj)
        (out / "tokenizer.json").write_text(tj)
        (out / "tokenizer_config.json").write_text(json.dumps(synth.tokenizer_config(tj), indent=2))
        (out / "generation_config.json").write_text(json.dumps(
            synth.generation_config(ids["<|im_end|>"], ids["<|endoftext|>"]), indent=2))
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {out} ({cfg.name}, {size / 1e9:.2f} GB in {args.shards} shards) in "
          f"{time.time() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
