"""Peers of `nq bench`, timed in the same process with torch (when importable, with CUDA):

  tinygemm INT4 chain   torch's _weight_int4pack_mm (the gpt-fast/torchao INT4 path: bf16
                        activations, group 128, inner_k_tiles 8) for the projections of every
                        layer (qkv and gate|up concatenated as nq does) + an fp16 lm_head mv
  cuBLAS fp16 GEMV      torch.mv on fp16 weights of the same shapes + the lm_head
  cuBLAS fp16 GEMM      F.linear at M = prompt length over the same weights (+ one lm_head
                        row), what a batched prefill would cost

Each chain is one torch.cuda.CUDAGraph, replayed between events; weights are random and
distinct per layer (so L2 does not flatter them) and freed afterwards.  No attention in any
chain: compare them with nq's GEMV regions as well as with its whole ITL.  A peer that fails
reports "peer X unavailable: <reason>" and the bench goes on.
"""
from __future__ import annotations

import statistics

GROUP = 128
INNER_K_TILES = 8
GEMV_REGIONS = ("qkv_gemv", "o_proj", "gate_up_swiglu", "down", "lm_head")


def layer_shapes(cfg) -> list[tuple[int, int]]:
    """(N, K) of nq's four GEMVs of one layer: qkv, o_proj, gate|up, down."""
    h = cfg.hidden_size
    return [(cfg.qkv_size, h), (h, cfg.q_size), (2 * cfg.intermediate_size, h),
            (h, cfg.intermediate_size)]


def graph_ms(torch, fn, reps: int, trials: int = 5) -> float:
    """Median ms per replay of a CUDA graph holding fn() (warmed on a side stream first, so
    cuBLAS handles and workspaces exist before capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
        fn()
    torch.cuda.synchronize()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(trials):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / reps)
    del g
    return statistics.median(times)


# ---- tinygemm: the torch API moved across versions, so probe once -----------------------------
def _op(torch, name):
    f = getattr(torch.ops.aten, name, None) or getattr(torch, name, None)
    if f is None:
        raise RuntimeError(f"torch {torch.__version__} has no {name}")
    return f


def tinygemm_ops(torch):
    """(pack, mm): pack (N, K/2) uint8 nibble pairs into tinygemm's layout; mm(x, w, 128, sz).
    torch >= 2.5 packs the uint8 pairs, older torch took (N, K) int32 nibbles: both are tried
    on a small weight, and mm is checked on it, before any real weight is made."""
    conv, mm = _op(torch, "_convert_weight_to_int4pack"), _op(torch, "_weight_int4pack_mm")

    def new(q):
        return conv(q, INNER_K_TILES)

    def old(q):
        n = q.shape[0]
        return conv(torch.stack([q >> 4, q & 15], dim=-1).reshape(n, -1).to(torch.int32),
                    INNER_K_TILES)

    n, k = 64, 256
    probe = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    errors = []
    for pack in (new, old):
        try:
            w = pack(probe)
        except (RuntimeError, TypeError) as e:
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
            continue
        sz = torch.ones((k // GROUP, n, 2), dtype=torch.bfloat16, device="cuda")
        y = mm(torch.randn(1, k, dtype=torch.bfloat16, device="cuda"), w, GROUP, sz)
        if tuple(y.shape) != (1, n):
            raise RuntimeError(f"_weight_int4pack_mm returned shape {tuple(y.shape)}, expected (1, {n})")
        return pack, mm
    raise RuntimeError("_convert_weight_to_int4pack took neither (N, K/2) uint8 nor (N, K) "
                       f"int32: {' | '.join(errors)}")


def tinygemm_chain(torch, cfg, reps: int) -> dict:
    pack, mm = tinygemm_ops(torch)
    layers, nbytes = [], 0
    for _ in range(cfg.num_layers):
        per = []
        for n, k in layer_shapes(cfg):
            w = pack(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda"))
            # (K/128, N, 2) bf16: [..., 0] scale, [..., 1] zero point
            sz = torch.empty((k // GROUP, n, 2), dtype=torch.bfloat16, device="cuda").uniform_(1e-3, 1e-2)
            per.append((w, sz, k))
            nbytes += w.nbytes + sz.nbytes
        layers.append(per)
    lm = torch.empty((cfg.vocab_size, cfg.hidden_size), dtype=torch.float16,
                     device="cuda").uniform_(-0.02, 0.02)
    nbytes += lm.nbytes
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
          for k in {k for _, k in layer_shapes(cfg)}}
    xh = torch.randn(cfg.hidden_size, dtype=torch.float16, device="cuda")

    def chain():
        for per in layers:
            for w, sz, k in per:
                mm(xs[k], w, GROUP, sz)
        torch.mv(lm, xh)
    ms = graph_ms(torch, chain, reps)
    return {"ms": ms, "bytes": nbytes, "GBs": nbytes / ms / 1e6}


def fp16_chains(torch, cfg, m: int, reps: int) -> tuple[dict, dict]:
    """(GEMV chain at M=1, GEMM chain at M=m) over the same fp16 weights."""
    import torch.nn.functional as F
    layers = [[torch.empty((n, k), dtype=torch.float16, device="cuda").uniform_(-0.02, 0.02)
               for n, k in layer_shapes(cfg)] for _ in range(cfg.num_layers)]
    lm = torch.empty((cfg.vocab_size, cfg.hidden_size), dtype=torch.float16,
                     device="cuda").uniform_(-0.02, 0.02)
    nbytes = sum(w.nbytes for per in layers for w in per) + lm.nbytes
    ks = {k for _, k in layer_shapes(cfg)}
    x1 = {k: torch.randn(k, dtype=torch.float16, device="cuda") for k in ks}
    xm = {k: torch.randn(m, k, dtype=torch.float16, device="cuda") for k in ks}

    def gemv():
        for per in layers:
            for w in per:
                torch.mv(w, x1[w.shape[1]])
        torch.mv(lm, x1[cfg.hidden_size])

    def gemm():
        for per in layers:
            for w in per:
                F.linear(xm[w.shape[1]], w)
        torch.mv(lm, x1[cfg.hidden_size])  # logits of the last prompt token only
    gv = graph_ms(torch, gemv, reps)
    gm = graph_ms(torch, gemm, max(2, reps // 4))
    return ({"ms": gv, "bytes": nbytes, "GBs": nbytes / gv / 1e6},
            {"ms": gm, "M": m, "tok_s": m / gm * 1e3, "bytes": nbytes})


def run_peers(cfg, prompt_len: int, log, reps: int = 20) -> dict:
    """Every peer's figures, or {"error": why} for a peer that could not run."""
    names = ("tinygemm_int4_chain", "cublas_fp16_gemv_chain", "cublas_fp16_gemm_chain")
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
    except Exception as e:  # noqa: BLE001 -- ImportError, a CPU-only build, a broken install
        for n in names:
            log(f"nq bench: peer {n} unavailable: {e}")
        return {n: {"error": str(e)} for n in names}
    out = {}
    try:
        log("nq bench: peer tinygemm_int4_chain ...")
        out[names[0]] = tinygemm_chain(torch, cfg, reps)
    except Exception as e:  # noqa: BLE001
        log(f"nq bench: peer {names[0]} unavailable: {type(e).__name__}: {e}")
        out[names[0]] = {"error": f"{type(e).__name__}: {e}"}
    torch.cuda.empty_cache()
    try:
        log("nq bench: peers cublas_fp16_gemv_chain, cublas_fp16_gemm_chain ...")
        out[names[1]], out[names[2]] = fp16_chains(torch, cfg, prompt_len, reps)
    except Exception as e:  # noqa: BLE001
        log(f"nq bench: peers {names[1]}, {names[2]} unavailable: {type(e).__name__}: {e}")
        out[names[1]] = out[names[2]] = {"error": f"{type(e).__name__}: {e}"}
    torch.cuda.empty_cache()
    out["torch"] = torch.__version__
    return out


def format_peers(peers: dict, rows: list[dict], bd: dict) -> str:
    """Each peer beside nq's figures, as ratios of times (below 1: nq is faster)."""
    tg = next(r for r in rows if r["test"].startswith("tg"))
    pp = rows[0]
    nq_itl = 1e3 / tg["tok_s_mean"]
    nq_gemv = sum(v for r, v in bd["regions_ms"].items() if r in GEMV_REGIONS)
    lines = [f"peers (torch {peers.get('torch', '?')}, same run; no attention in any chain):"]
    for name, label in (("tinygemm_int4_chain", "tinygemm INT4 chain"),
                        ("cublas_fp16_gemv_chain", "cuBLAS fp16 GEMV chain")):
        p = peers.get(name, {})
        if "ms" in p:
            lines.append(f"- {label}: {p['ms']:.3f} ms, {p['GBs']:.0f} GB/s (nq decode is "
                         f"{nq_itl / p['ms']:.2f}x its time; nq's GEMV regions alone "
                         f"{nq_gemv / p['ms']:.2f}x)")
        else:
            lines.append(f"- {label}: unavailable: {p.get('error', '?')}")
    p = peers.get("cublas_fp16_gemm_chain", {})
    if "ms" in p and pp.get("ttft_ms"):
        lines.append(f"- cuBLAS fp16 GEMM chain at M={p['M']}: {p['ms']:.3f} ms, "
                     f"{p['tok_s']:.0f} tok/s (nq prefill TTFT is {pp['ttft_ms'] / p['ms']:.1f}x "
                     "its time)")
    else:
        lines.append(f"- cuBLAS fp16 GEMM chain: unavailable: {p.get('error', '?')}")
    return "\n".join(lines)
