"""A prefill GEMM launch's host side: its arguments checked once a buffer set and its
FastLaunch kept with them, shared by the mma.sync GEMM (gemm.py) and the wgmma one
(gemm_wgmma.py).  A prefill launches the same buffers every chunk, so the checks and numba's
reshapes run once, not once a launch."""
from __future__ import annotations

import numpy as np

from nq.config import GROUP_SIZE

MEMO_LIMIT = 256  # buffer sets remembered (a 7B prefill uses 28 a kind: one a layer)


def check_rows(name: str, m: int, x, out) -> None:
    """x and out must be 2-D with at least the m rows a launch computes."""
    if m < 0 or x.ndim != 2 or out.ndim != 2 or x.shape[0] < m or out.shape[0] < m:
        raise ValueError(f"{name}: x and out must be 2-D with at least m={m} rows, got "
                         f"{tuple(x.shape)} and {tuple(out.shape)}")


def launch_args(memo: dict, name: str, k: int, w_rows: int, n_out: int, out_dtype,
                x, qw, sc, bias, out):
    """The kernel arguments (flat views of x, qw, sc; bias; out) of a GEMM launch, after the
    checks of their dtypes, shapes and alignment.  A prefill launches the same buffers every
    chunk, and both the checks and numba's reshape cost tens of microseconds of host time a
    launch (a 512-token prompt makes 112 GEMM launches, each only 40-400 us on the GPU), so a
    buffer set is checked and flattened once and remembered in `memo`, keyed by the arrays'
    identities (the entry holds the arrays, so an id is never reused while it is there)."""
    from nq.kernels.common import need

    key = (id(x), id(qw), id(sc), id(bias), id(out))
    hit = memo.get(key)
    if hit is not None:
        return hit[1]
    need(x, f"{name} x", np.float16, (x.shape[0], k))
    need(qw, f"{name} qweight", np.uint32, (w_rows, k // 8))
    need(sc, f"{name} scales", np.float16, (w_rows, k // GROUP_SIZE), 2)
    need(out, f"{name} out", out_dtype, (out.shape[0], n_out), 4)
    if bias is not None:
        need(bias, f"{name} bias", np.float16, (n_out,), 2)
    flat = tuple(a.reshape(int(np.prod(a.shape))) for a in (x, qw, sc))
    args = flat + ((bias,) if bias is not None else ()) + (out,)
    if len(memo) >= MEMO_LIMIT:
        memo.clear()
    memo[key] = ((x, qw, sc, bias, out), args, {})   # {}: its FastLaunch by kernel
    return args


def gemm_launch(g, name: str, kern, m: int, x, qw, sc, bias, out):
    """The FastLaunch of kern over this buffer set (m and band follow per call), or None when
    m = 0.  The rows are checked every call, the buffers once (launch_args), and the
    FastLaunch is built once a kernel and kept in the buffer set's memo entry, so it goes when
    the buffers go.  g: the GEMM (its kind, k, w_rows, n and _memo); kern one of its compiled
    kernels, which live as long as the process (functools caches), so id(kern) is a key."""
    check_rows(name, m, x, out)
    out_t = np.float16 if g.kind == "gate_up" else np.float32
    args = launch_args(g._memo, name, g.k, g.w_rows, g.n, out_t, x, qw, sc, bias, out)
    if m == 0:
        return None
    launches = g._memo[(id(x), id(qw), id(sc), id(bias), id(out))][2]
    fl = launches.get(id(kern))
    if fl is None:
        from nq.kernels.fastlaunch import FastLaunch
        fl = launches[id(kern)] = FastLaunch(kern, *args, 0, 0)
    return fl
