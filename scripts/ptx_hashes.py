"""Hash the PTX of every kernel a model's decode step and weight upload compile, offline.

    python3 scripts/ptx_hashes.py --json out.json            # presets 0.5b, 7b, 14b
    python3 scripts/ptx_hashes.py --presets 32b --json out.json
    python3 scripts/ptx_hashes.py --compare before.json out.json

Refactors of the kernel tree promise "the default PTX does not change"; this is the proof.
No GPU is needed: every `cuda.jit(signature, ...)` call made while the step's launchers are
built is intercepted and compiled to sm_90 PTX with the device lookup stubbed (tests'
ptx_util).  The hash is of the instructions alone: comments, the `.entry` name and mangled
symbol names are stripped, so a kernel may be renamed; one changed instruction, operand or
register number changes it.  `--compare` checks that every kernel of the first file has a
kernel with the same hash in the second.

The hashes depend on the toolchain as much as on the code: compare two files made with the same
numba-cuda and NVVM.  Against docs/figures/ptx_hashes_13c221c.json, made in an earlier
environment, 30 of 43 kernels differ with the packages pip installed on 2026-12-01 (numba
0.68.1, numba-cuda 0.30.4, nvidia-nvvm 13.5.37), argmax and rmsnorm among them, which no
commit since touched; docs/figures/ptx_hashes_490d131.json is the default step at 490d131
made with those (gate_up on the tensor cores; the 0.5B and 14B fp16 lm_heads with their
padded h).

numba names each shared array `_cudapy_smem_N`, N counting the shared arrays compiled so far
in the process, so a kernel's PTX changed whenever a kernel built before it gained or lost a
shared array (2026-12-02: down's new `early` array renumbered rmsnorm's, argmax's and the
attention's, instruction for instruction the same).  Since then `normalise` renames them too;
hashes in files made before (the two above) differ from today's for every kernel with a shared
array, so compare files made by the same version of this script.
docs/figures/ptx_hashes_1e19d22.json is the default step of the 7B and 32B at 1e19d22 with it,
docs/figures/ptx_hashes_1564659.json at 1564659 (against 1e19d22: the combine, the GEMVs'
round trips and gate_up's 576 threads changed 12 of 30 kernels, by intent).  A device function
added to a kernel renumbers its parameters' names, which this normalise does not undo: the
CUDA-core qkv_rope at 1564659 compares as changed against 357deef with the same instructions,
one cvt moved (checked by hand with the names and registers stripped).
docs/figures/ptx_hashes_5c99159.json at 5c99159: against 1564659 only attn_split changed (four
consumers and ppc 2, by intent); the other 28 kernels of the 7B and 32B are the same.  (A file
made at 10b4212 was withdrawn: build_step_kernels then left out ATTN_OPTIONS' ppc, so it hashed
a four-consumer kernel the engine does not run.)
Since 2026-12-03 (after 8aa6f13) `normalise` also drops numba's environment declarations (its
doc), so hashes of files made before differ from today's for every kernel; compare files made
by the same version.  docs/figures/ptx_hashes_deffcbf.json is the default step of the 0.5B, 7B,
14B and 32B at deffcbf made with this version (the attention in one wave, be0e83b; its 7B
kernels as be0e83b's, the moves of 9651c9b changing none of 45).

One kernel's PTX is not reproducible: the 14B / 32B CUDA-core qkv (n7168, k5120, 512 threads)
and its qkv_rope come out in one of two forms from run to run of the same command, with any
`--presets` and any PYTHONHASHSEED (2026-12-04: three runs of `--presets 14b` gave d44c48180425,
f34a8b8ee861, d44c48180425).  The two differ in one loop's exit test, which NVVM counts on
either of two equivalent induction variables (`add 32 ... setp.ne 160` or `add 8 ... setp.ne
40`): the same instruction count, the same behaviour.  So a CHANGED on those two alone, with
their instruction counts equal, is NVVM's choice; compare them by hand (diff the normalised
PTX) before believing it.  A reference file may list such a kernel's other known form under
"alt" (`compare`): docs/figures/ptx_hashes_dp4a.json does for the 14B's qkv at 384 threads
(both forms seen, 2026-12-07), so a compare against it says 43/43 when nothing else moved.  docs/figures/ptx_hashes_411c843.json is the default step of the
0.5B, 7B, 14B and 32B at 411c843 (against ptx_hashes_rule.json: the 14B's and 32B's down at
8 warps a tile, by intent, and the qkv pair's other form); docs/figures/ptx_hashes_b234f6d.json at
b234f6d (against 411c843: the 14B's and 32B's down with early=1 and gate_up with l2ahead=1, by
intent; the other 41 unchanged, so the copy-engine feed's retirement left no trace).
docs/figures/ptx_hashes_394c6b2.json at 394c6b2: the step with attn_o_proj into xacc (the 7B, 14B and
32B: attn_combine gone, attn_o_proj new, the split kernel with its early trigger, gate_up and
down with xacc, by intent; 34 of b234f6d's 45 unchanged, the 0.5B's all: its o_proj stays on
the CUDA cores, so its step keeps attn_combine).
docs/figures/ptx_hashes_2412016.json is the default step of the 0.5B, 7B, 14B and 32B at 2412016,
with i8 the default for gate_up and attn_o_proj: against 68040ca, 36 of 43 kernels are the same;
the four gate_ups (886 -> 778, 1108 -> 887, 1234 -> 879 instructions) and the 7B's and 14B's
attn_o_proj (686 -> 758, 905 -> 885) by intent, and the 14B qkv_rope's other form (1998 both).
This script had built attn_o_proj without the step's o_i8 until 2412016.
docs/figures/ptx_hashes_dp4a.json is the default step at 07511c8 (docs/PERF.md 0.30-0.31: qkv and
qkv_rope on the CUDA cores with their activations as digits summed by dp4a, the 14B's and 32B's
at 384 threads): against 2412016 the six CUDA-core qkv kernels changed by intent, the other 37
are the same (so the retirement of i8=2 and the move of digit_bits into dequant.py left the
tensor-core kernels as they were).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def normalise(ptx: str) -> str:
    """The PTX's instructions: no comments, no blank lines, no numba environment declarations
    (`.common .global ... _ZN08NumbaEnv...`, one per device function, never read: splitting a
    device function in two adds one and changes no instruction), symbol names replaced by
    NAME<i> numbered in order of first appearance (kernel and parameter names carry the module
    path)."""
    body = re.sub(r"//[^\n]*", "", ptx)
    body = re.sub(r"(?m)^\s*\.common\s+\.global\b[^\n]*NumbaEnv[^\n]*$", "", body)
    names = re.findall(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([A-Za-z_$][\w$]*)", body)
    names += re.findall(r"\b(_Z[\w$]+)", body)
    names += re.findall(r"\b(_cudapy_smem_\d+)\b", body)   # numbered per process (doc)
    order = {}
    for n in names:
        order.setdefault(n, f"NAME{len(order)}")
    if order:
        body = re.sub("|".join(re.escape(n) for n in sorted(order, key=len, reverse=True)),
                      lambda m: order[m.group(0)], body)
    return "\n".join(line.strip() for line in body.splitlines() if line.strip())


def record_compiles():
    """Patch numba.cuda.jit: kernels (a signature, not device=True) compile to offline PTX and
    are recorded as (name, ptx); device functions and signature-less calls pass through."""
    import numba.cuda
    from ptx_util import compile_ptx_sm90

    real = numba.cuda.jit
    seen: dict[str, str] = {}

    class Fake:
        overloads: dict = {}  # allow_smem (dynamic shared memory) finds nothing to opt in

        def __init__(self, name):
            self.name = name

        def __getitem__(self, _):
            return lambda *a, **k: None

    def jit(sig=None, **kw):
        if kw.get("device") or sig is None or callable(sig):
            return real(sig, **kw) if sig is not None else real(**kw)

        def deco(pyfunc):
            opts = {k: v for k, v in kw.items() if k in ("launch_bounds", "fastmath", "lineinfo")}
            name = getattr(pyfunc, "__name__", "kernel")
            ptx = compile_ptx_sm90(pyfunc, sig, **opts)
            key = name
            n = 1
            while key in seen and seen[key] != ptx:
                n += 1
                key = f"{name}#{n}"
            seen[key] = ptx
            return Fake(name)
        return deco

    numba.cuda.jit = jit

    # nq/kernels/build.py's compile path (patched before any kernel module imports it)
    from nq.kernels import build

    def compile_kernel(body, sig, name, **options):
        body.__name__ = body.__qualname__ = name
        return jit(sig, **options)(body)
    build.compile_kernel = compile_kernel
    return seen


def build_step_kernels(cfg) -> None:
    """Build (and so compile) every launcher of cfg's default decode step, the weight upload's
    kernels and the stand-alone small kernels.  Keep this list in step with
    nq/runtime/step.py's `build_steps` when a kernel joins or leaves the step."""
    from nq.kernels import embed, feed, fill, lm_head, rmsnorm, rope_kv, sampling
    from nq.kernels.attention import combine, launch, plan
    from nq.kernels.int4 import make_qkv_rope_gemv, retile
    from nq.kernels.int4.tiling import O_I8   # the step's attn.o_i8 default
    from nq.kernels.attention.o_proj import o_proj_kernel
    from nq.runtime.step import ATTN_OPTIONS, FUSE_O, fused_o, o_tiles_per_warp, split_width
    from nq.runtime.weights import gemvs

    tilings = {}
    fuse = fused_o(cfg, FUSE_O, tilings)
    gemvs(cfg, tilings, kinds=("qkv", "gate_up", "down") if fuse else None)
    make_qkv_rope_gemv(cfg)
    lm_head.make_lm_head(cfg)
    o = dict(ATTN_OPTIONS)
    ms = split_width(cfg)
    launch.split_kernel(cfg.gqa_ratio, cfg.head_dim, cfg.num_kv_heads,
                        o.get("consumers", plan.CONSUMERS), o.get("nstage", plan.NSTAGE),
                        o["rows_per_copy"], ms, o["min_pps"], bool(o["early"]),
                        ppc=o.get("ppc", 0), tma=o.get("tma", False),
                        tma_from=o.get("tma_from", 0), trigger=bool(fuse))
    if fuse:
        o_proj_kernel(cfg.hidden_size, cfg.q_size, cfg.head_dim, cfg.num_heads, ms,
                      o["min_pps"], o_tiles_per_warp(cfg), fuse == 2, O_I8)
    else:
        combine.combine_kernel(cfg.head_dim, ms, o["min_pps"])
    sampling.argmax_kernel(cfg.vocab_size)
    embed.embed_kernel(cfg.hidden_size)
    feed.feed_kernel()
    rope_kv.rope_kv_kernel(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    for residual in (True, False):
        rmsnorm.rmsnorm_kernel(cfg.hidden_size, float(cfg.rms_norm_eps), residual)
    retile.compile_retile_rows()
    retile.compile_retile_mma()
    fill.fill_kernels()


def compare(before: dict, after: dict) -> tuple[list[str], list[str]]:
    """A line for each kernel of `before` naming the kernel of `after` with its hash (or
    CHANGED), then the count; and the kernels that changed.  A kernel of `before` may list
    hashes of its other known forms under "alt" (NVVM's two forms of one kernel, the module
    doc): any of them in `after` is a match, said as such."""
    by_hash = {}
    for k, v in after.items():
        by_hash.setdefault(v["sha256"], []).append(k)
    lines, missing = [], []
    for k, v in sorted(before.items()):
        alts = [h for h in v.get("alt", ()) if h in by_hash]
        if v["sha256"] in by_hash:
            match = by_hash[v["sha256"]][0]
        elif alts:
            match = by_hash[alts[0]][0] + "  (its other known form)"
        else:
            match = "-- CHANGED --"
            missing.append(k)
        lines.append(f"{k:70s} {v['sha256'][:12]} {v['instructions']:6d}  {match}")
    lines.append(f"{len(before) - len(missing)}/{len(before)} kernels instruction-identical")
    return lines, missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="0.5b,7b,14b")
    ap.add_argument("--json", help="write {preset/kernel: {sha256, instructions}} here")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        lines, missing = compare(before, after)
        print("\n".join(lines))
        return 1 if missing else 0
    from nq.config import PRESETS
    seen = record_compiles()
    out = {}
    for p in args.presets.split(","):
        seen.clear()
        build_step_kernels(PRESETS[p])
        for name, ptx in sorted(seen.items()):
            norm = normalise(ptx)
            out[f"{p}/{name}"] = {"sha256": hashlib.sha256(norm.encode()).hexdigest(),
                                  "instructions": norm.count(";")}
            print(f"{p:5s} {name:64s} {out[f'{p}/{name}']['sha256'][:12]} "
                  f"{out[f'{p}/{name}']['instructions']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
