#!/usr/bin/env python3
"""Download (or find in the HF cache) a Qwen2/Qwen2.5 snapshot and pack it into a .nanoqwen.

A thin wrapper over `nq.loader.hf.pack`, for machines where the `nq` command is not
installed.  Honours HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE.

    python3 scripts/download_and_pack.py Qwen/Qwen2.5-Coder-7B-Instruct model.nanoqwen
    python3 scripts/download_and_pack.py /path/to/snapshot model.nanoqwen --verify
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nq.loader.format import NanoqwenFile  # noqa: E402
from nq.loader.hf import pack  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="HF repo id (Org/Name) or a local snapshot folder")
    ap.add_argument("out", help="output .nanoqwen path")
    ap.add_argument("--revision", help="branch, tag or commit of the repo (default: main)")
    ap.add_argument("--verify", action="store_true", help="re-read the output and check every checksum")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args()
    t0 = time.time()
    out = pack(args.src, args.out, revision=args.revision, progress=not args.quiet)
    print(f"packed {out} ({out.stat().st_size / 2**30:.2f} GiB) in {time.time() - t0:.1f} s",
          file=sys.stderr)
    if args.verify:
        t0 = time.time()
        n = NanoqwenFile(out).verify()
        print(f"verified {n / 2**30:.2f} GiB of payload checksums in {time.time() - t0:.1f} s",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
