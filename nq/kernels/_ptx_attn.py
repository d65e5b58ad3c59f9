"""STOPGAP PTX wrappers for the paged-attention pipeline (bulk copies and mbarriers).

These are the instructions of nq/ptx's second delivery, written here with the same
`nq.ptx._asm.ptx` decorator so the attention kernel could be built before it landed.  The
nq/ptx owner may absorb them unchanged (same names, same argument order); then this module
becomes a re-export and attn_decode.py imports from nq.ptx.

Shared-memory operands (`bar`, `dst`) are 32-bit addresses in the shared window, as PTX's
`.shared` state space takes them; `smem_addr_u32(arr, idx)` makes one from a
`cuda.shared.array` element.  Every mbarrier here lives in one CTA (no clusters), so the
`.shared::cta` forms are used; the bulk copy's destination is written `.shared::cluster`
because that is the only destination form PTX 8.0 has (a CTA's own shared window is part of
its cluster's window, cluster size 1).

This module carries its own ten-line `_ptx` helper rather than nq/ptx/_asm.py's decorator,
which was still changing while this was written; every wrapper here is side-effecting with a
memory clobber (barriers, fences and async copies must not be reordered or merged).

Twins: the async proxy (a copy that completes later and signals a barrier) has no faithful
sequential model, so the twins are stand-ins that keep the module importable under the
simulator; the GPU tests are the specification.
"""
from __future__ import annotations

import re

from llvmlite import ir
from numba.core import config

SIMULATOR = bool(config.ENABLE_CUDASIM)


def _address(context, builder, aryty, ary, idxty, idx):
    """i64 generic address of ary[idx] (idx an int or a tuple; no bounds check)."""
    from numba.cuda import cgutils
    from numba.cuda import types

    if isinstance(idxty, types.BaseTuple):
        raw, tys = cgutils.unpack_tuple(builder, idx, count=len(idxty)), list(idxty)
    else:
        raw, tys = [idx], [idxty]
    inds = [context.cast(builder, v, t, types.intp) for v, t in zip(raw, tys)]
    arr = context.make_array(aryty)(context, builder, value=ary)
    ptr = cgutils.get_item_pointer(context, builder, aryty, arr, inds, wraparound=False)
    return builder.ptrtoint(ptr, ir.IntType(64))


def _ptx(template, *, out=None, args=()):
    """Twin -> intrinsic emitting `template`; %k operands: the output first, then the
    arguments; kinds "u32" (a register) or "arr", "idx" (one 64-bit address of arr[idx])."""
    def wrap(twin):
        if SIMULATOR:
            return twin
        from numba.cuda import types
        from numba.cuda.extending import intrinsic

        nout = 1 if out else 0

        def typer(typingctx, *argtys):
            sig_args = [types.unliteral(argtys[i]) if k in ("arr", "idx") else types.uint32
                        for i, k in enumerate(args)]
            return (types.uint32 if out else types.void)(*sig_args), codegen

        def codegen(context, builder, sig, llargs):
            operands, cons, text_of = [], ["=r"] if out else [], {0: "$0"} if out else {}
            for i, k in enumerate(args):
                if k == "idx":
                    continue
                if k == "arr":
                    operands.append(_address(context, builder, sig.args[i], llargs[i],
                                             sig.args[i + 1], llargs[i + 1]))
                    cons.append("l")
                else:
                    operands.append(context.cast(builder, llargs[i], sig.args[i], types.uint32))
                    cons.append("r")
                text_of[nout + i] = f"${nout + len(operands) - 1}"
            cons.append("~{memory}")
            text = re.sub(r"%(\d+)", lambda mm: text_of[int(mm.group(1))], template)
            fnty = ir.FunctionType(ir.IntType(32) if out else ir.VoidType(),
                                   [v.type for v in operands])
            res = builder.asm(fnty, text, ",".join(cons), operands, side_effect=True)
            return res if out else context.get_dummy_value()

        import inspect
        params = list(inspect.signature(twin).parameters)
        typer.__signature__ = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
             for n in ["typingctx", *params]])
        typer.__name__ = twin.__name__
        typer.__doc__ = twin.__doc__
        intr = intrinsic(typer)
        intr.twin = twin
        intr.ptx_template = template
        return intr
    return wrap


@_ptx("{ .reg .u64 nq_s; cvta.to.shared.u64 nq_s, %1; cvt.u32.u64 %0, nq_s; }",
     out="u32", args=("arr", "idx"))
def smem_addr_u32(arr, idx):
    """`cvta.to.shared.u64` + `cvt.u32.u64`: the 32-bit shared-window address of arr[idx].

    arr must be a `cuda.shared.array`; numba hands kernels a generic pointer to it, and the
    mbarrier and bulk-copy instructions want the shared-window offset.
    """
    return 0


@_ptx("mbarrier.init.shared::cta.b64 [%0], %1;", args=("u32", "u32"))
def mbarrier_init(bar, count):
    """`mbarrier.init.shared::cta.b64 [bar], count;` -- phase 0, `count` arrivals per phase."""


@_ptx("fence.mbarrier_init.release.cluster;")
def fence_mbarrier_init():
    """`fence.mbarrier_init.release.cluster;` -- makes mbarrier.init visible to the async
    proxy (the bulk-copy engine signals the barrier) before the first copy is issued."""


@_ptx("fence.proxy.async.shared::cta;")
def fence_proxy_async_shared():
    """`fence.proxy.async.shared::cta;` -- orders this thread's generic-proxy shared accesses
    with later async-proxy ones (needed when shared memory written by threads is then read
    by a bulk copy; attention only reads copies, so it does not call this)."""


@_ptx("mbarrier.arrive.shared::cta.b64 _, [%0];", args=("u32",))
def mbarrier_arrive(bar):
    """`mbarrier.arrive.shared::cta.b64 _, [bar];` -- one arrival (release semantics)."""


@_ptx("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;", args=("u32", "u32"))
def mbarrier_arrive_expect_tx(bar, nbytes):
    """`mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], nbytes;` -- one arrival that also
    tells the barrier to expect `nbytes` of bulk-copy completions before the phase flips."""


@_ptx("{ .reg .pred nq_p; mbarrier.try_wait.parity.shared::cta.b64 nq_p, [%1], %2; "
     "selp.u32 %0, 1, 0, nq_p; }", out="u32", args=("u32", "u32"))
def mbarrier_try_wait_parity(bar, parity):
    """`mbarrier.try_wait.parity.shared::cta.b64 p, [bar], parity;` -> 1 once the phase with
    that parity has completed, else 0 after a hardware-bounded wait (acquire semantics).

    Returned as an integer (not a branch inside the asm) so the template needs no labels,
    which would clash when the wrapper is inlined twice; callers loop:
    `while mbarrier_try_wait_parity(bar, ph) == 0: pass`.
    """
    return 1


@_ptx("{ .reg .u64 nq_g; cvta.to.global.u64 nq_g, %1; "
     "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [nq_g], %3, [%4]; }",
     args=("u32", "arr", "idx", "u32", "u32"))
def cp_async_bulk_g2s(dst, src, idx, nbytes, bar):
    """`cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [&src[idx]],
    nbytes, [bar];` -- the copy engine moves nbytes (a multiple of 16; both addresses 16-byte
    aligned) from global to shared and signals `bar` with complete_tx(nbytes).

    One instruction from one thread moves a whole 4-8 KiB page slice: the issuing warp does no
    address arithmetic per byte, which is why attention uses it rather than per-thread loads.
    """
