# docs/PERF.md's "Waiting for the H200", as one device call (217 s on an H100 SXM,
# 2026-12-07): the 7B's table with its three heads, the 14B's and 32B's with the fp16 and the
# rescored head, the decode tier at the 7B width, and the 14B's and 32B's qkv_rope at 512
# threads against today's 384 (chosen on an H100; a per-GPU rule if the H200 prefers 512).
#   bash scripts/h200_waiting_list.sh OUTDIR        (run from the repository root)
# Every head is named: `--random`'s default is `nq pack`'s, int4+fp16 (nq/config.py).
# Each step's JSON goes to OUTDIR (its log too, read for stdout and removed at the end); the
# lines that matter go to stdout, so a call whose files do not all come back still reports.  A step that runs past its limit is cut, and the
# rest still run.
set -u
out=${1:?usage: bash scripts/h200_waiting_list.sh OUTDIR}
mkdir -p "$out"
source scripts/h200_env.sh || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
t0=$(date +%s)
step() {   # step NAME LIMIT_S COMMAND...: run it into OUTDIR/NAME.log, say how it ended
    local name=$1 limit=$2; shift 2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "[$(( $(date +%s) - t0 ))s] $name rc=$rc"
    [ $rc -eq 0 ] || tail -2 "$out/$name.log" | cut -c1-200
}
rows() { grep -E "^\| ($1) " "$2" | cut -c1-120; }

B7="python3 -m nq bench --random 7b -p 512 -n 128 -r 5 --ctx 512,8192,32768 --no-peers --no-gemm"
step b7_fp16 150 $B7 --lm-head fp16 --json "$out/b7_fp16.json"
rows "qkv_gemv|paged_attention|o_proj|gate_up_swiglu|down|lm_head|kernel_gap|ITL" "$out/b7_fp16.log"
for head in int4+fp16 int4; do
    tag=b7_${head/+/_}   # (file names without '+')
    step "$tag" 90 $B7 --lm-head "$head" --json "$out/$tag.json"
    rows "lm_head|ITL" "$out/$tag.log"
done
for size in 14b 32b; do
    B="python3 -m nq bench --random $size -p 512 -n 64 -r 3 --ctx 512,8192 --no-peers --no-gemm"
    step "b${size}_fp16" 120 $B --lm-head fp16 --json "$out/b${size}_fp16.json"
    rows "qkv_gemv|o_proj|gate_up_swiglu|down|lm_head|ITL" "$out/b${size}_fp16.log"
    step "b${size}_int4_fp16" 120 $B --lm-head int4+fp16 --json "$out/b${size}_int4_fp16.json"
    rows "lm_head|ITL" "$out/b${size}_int4_fp16.log"
done
step decode_tier 150 python3 -m pytest -m gpu -n 0 -s -q tests/runtime/test_engine_gpu.py \
    -k "teacher_forced and 7b-width"
grep -E "decode tier|passed|failed" "$out/decode_tier.log" | cut -c1-200
for size in 14b 32b; do
    step "sv_$size" 240 python3 scripts/step_variants.py --random "$size" --ctx 512,8192 \
        --steps 40 "qkv_rope.threads=512"
    grep -E "^(baseline|qkv_rope)" "$out/sv_$size.log" | cut -c1-160
done
# the plots and logs go: the JSONs hold the numbers, stdout the lines that matter, and the
# device returns only the first few files of a folder (2026-12-07: 8 of 25)
rm -f "$out"/*.png "$out"/*.log
