"""Hopper warpgroup MMA (sm_90a only): wgmma.mma_async m64nNk16 fp16 -> fp32, its fence,
commit and wait (the shared-memory matrix descriptor: wgmma_desc.py).

mma.sync peaks at ~450 TFLOP/s through numba on the H200 (DEVICE.md); cuBLAS reaches 634+ with
`wgmma.mma_async`.  A wgmma is issued by a *warpgroup* (4 consecutive warps, threads 128j ..
128j+127, all converged) and computes D (64 x N, fp32) = A (64 x 16) . B (16 x N) (+ D), with
B always in shared memory, named by a 64-bit descriptor, and A either in registers ("rs") or
in shared memory ("ss").  It runs asynchronously:

    wgmma_fence()             before the first wgmma, and after registers that a wgmma reads
                              (A fragments, accumulators) were written by other instructions
    wgmma_m64n{N}k16_..(...)  any number, accumulating into the same registers
    wgmma_commit_group()      closes the wgmmas issued since the last commit into a group
    wgmma_wait_group(n, acc)  blocks until at most n groups are pending; only then may the
                              accumulators and the A registers of the retired groups be touched

These exist only on the arch-specific target sm_90a (numba-cuda adds the "a" on a cc 9.0
device; offline compile with cc=(9, 0, "a")).

Fragments (g = lane // 4, t = lane % 4, w = warp of the warpgroup):
    A in registers: warp w holds rows 16w .. 16w+15 exactly as an mma.m16n8k16 A fragment
        (nq/ptx/mma.py: a0 = A[16w+g, 2t:2t+2], a1 = A[16w+g+8, 2t:2t+2], a2, a3 the same at
        columns 2t+8) -- so the INT4 "mma" layout's dequantised words feed it unchanged.
    D: acc[4i + 0, 1] = D[16w+g, 8i+2t (+1)], acc[4i + 2, 3] = D[16w+g+8, 8i+2t (+1)],
        i = 0 .. N/8-1: N/2 fp32 a thread.
The accumulators live in a `cuda.local.array(N/2 or more, float32)` passed by the caller; the
wrappers load them, tie them to the instruction's "+f" operands and store them back, so after
inlining and SROA they are registers (never index that array with a runtime value, or it goes
to local memory and ptxas serialises the wgmmas).

Shared-memory layouts and the descriptor that names them: nq/ptx/wgmma_desc.py (host code
and the twins' models; re-exported here).

The twins (simulator) are synchronous: a wgmma's product is computed when it is issued (from
every thread of the warpgroup's operands, via nq/ptx/_sim.warp_exchange with size 128) and
written to acc at once, and fence/commit/wait do nothing.  So the simulator checks the data
movement (descriptors, swizzles, fragments), not the asynchrony: a kernel that reads an
accumulator before its wait passes there and fails on the GPU.  That part is checked by the
GPU tests and by ptxas (which serialises, and says so in its -v log, a pipeline it cannot
prove correct).
"""
from __future__ import annotations

import inspect
import re
import threading

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.errors import TypingError

from nq.ptx import _sim
from nq.ptx._asm import SIMULATOR, ptx
# the descriptor's names, re-exported: kernels and tests take them with the instructions
from nq.ptx.wgmma_desc import (SWIZZLE_128B, SWIZZLE_32B, SWIZZLE_64B, SWIZZLE_BITS,
                               SWIZZLE_NONE, SWIZZLE_ROW_BYTES, desc_fields, desc_hi, desc_lo,
                               read_operand, read_operand_mn, smem_offset, smem_offset_mn)

N_SHAPES = (8, 16, 32, 64, 96, 128, 192, 256)


# ---- fence, commit, wait ---------------------------------------------------------------------------

@ptx("wgmma.fence.sync.aligned;", effect="memory")
def wgmma_fence():
    """`wgmma.fence.sync.aligned;` -- order this warpgroup's earlier register writes (A
    fragments, accumulators) and shared-memory accesses before the wgmmas that follow.
    Warpgroup-collective (all 128 threads, converged).  Twin: nothing to order."""


@ptx("wgmma.commit_group.sync.aligned;", effect="memory")
def wgmma_commit_group():
    """`wgmma.commit_group.sync.aligned;` -- close the wgmmas issued since the last commit into
    one wgmma-group.  Twin: nothing (the twins run each wgmma at once)."""


# ---- the accumulator-carrying intrinsics ------------------------------------------------------------

def _acc_intrinsic(name, nacc, template, kinds, doc, twin, off=0):
    """An intrinsic (on the GPU) or the twin (simulator): `name(acc, *args)` where acc is a
    float32 array whose elements off..off+nacc-1 are tied "+f" operands $0..$(nacc-1) of template;
    args follow as $nacc.. with kinds "u32", "u64", "s32" or "imm" (spliced)."""
    twin.__name__ = twin.__qualname__ = name
    twin.__doc__ = doc
    twin.twin = twin
    twin.ptx_template = template
    if SIMULATOR:
        return twin
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    regs = {"u32": (types.uint32, "r"), "s32": (types.int32, "r"), "u64": (types.uint64, "l")}

    def typer(typingctx, acc, *argtys):
        if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.ndim == 1):
            raise TypingError(f"{name}: the accumulator must be a 1-d float32 array "
                              f"(cuda.local.array), got {acc}")
        if len(argtys) != len(kinds):
            raise TypingError(f"{name}: {len(kinds)} arguments after acc, got {len(argtys)}")
        sig = [acc]
        for i, (k, t) in enumerate(zip(kinds, argtys)):
            if k == "imm":
                if not isinstance(t, types.IntegerLiteral):
                    raise TypingError(f"{name}: argument {i + 1} must be a compile-time "
                                      f"integer constant, got {t}")
                sig.append(t)
            else:
                if not isinstance(t, (types.Integer, types.Boolean)):
                    raise TypingError(f"{name}: argument {i + 1} must be an integer, got {t}")
                sig.append(regs[k][0])
        return types.void(*sig), codegen

    def codegen(context, builder, sig, llargs):
        f32 = ir.FloatType()
        arr = context.make_array(sig.args[0])(context, builder, value=llargs[0])
        ptrs = [cgutils.gep_inbounds(builder, arr.data, off + j) for j in range(nacc)]
        operands = [builder.load(p) for p in ptrs]
        constraints = ["=f"] * nacc + [str(j) for j in range(nacc)]
        text = {}
        reg = 2 * nacc if nacc else 0
        for i, k in enumerate(kinds):
            if k == "imm":
                text[nacc + i] = str(int(sig.args[i + 1].literal_value))
            else:
                operands.append(llargs[i + 1])
                constraints.append(regs[k][1])
                text[nacc + i] = f"${reg}"
                reg += 1
        for j in range(nacc):
            text[j] = f"${j}"
        body = _OPERAND.sub(lambda m: text[int(m.group(1))], template)
        constraints.append("~{memory}")
        outty = ir.LiteralStructType([f32] * nacc) if nacc > 1 else (f32 if nacc else
                                                                      ir.VoidType())
        fnty = ir.FunctionType(outty, [v.type for v in operands])
        asm = ir.InlineAsm(fnty, body, ",".join(constraints), side_effect=True)
        res = builder.call(asm, operands, attrs=("nounwind", "convergent"))
        if nacc == 1:
            builder.store(res, ptrs[0])
        else:
            for j in range(nacc):
                builder.store(builder.extract_value(res, j), ptrs[j])
        return context.get_dummy_value()

    typer.__doc__ = doc
    return _finish(intrinsic, typer, name, ["acc"] + [f"arg{i}" for i in range(len(kinds))],
                   twin, template)


def _finish(intrinsic, typer, name, args, twin, template):
    """The intrinsic of `typer` with the signature (typingctx, *args) numba reads, named
    `name` (the kernel cache names closure values by qualname), carrying its twin and PTX."""
    typer.__signature__ = inspect.Signature(
        [inspect.Parameter(x, inspect.Parameter.POSITIONAL_OR_KEYWORD)
         for x in ["typingctx"] + list(args)])
    typer.__name__ = typer.__qualname__ = name
    typer.__module__ = __name__
    intr = intrinsic(typer)
    try:
        intr.__qualname__ = name
    except AttributeError:
        pass
    intr.twin = twin
    intr.ptx_template = template
    return intr


_OPERAND = re.compile(r"%(\d+)")


def _acc_list(n):
    return ", ".join(f"%{j}" for j in range(n))


def _wait_twin(acc, n):
    return None


def wgmma_wait_group_acc(nacc: int):
    """The `wgmma.wait_group.sync.aligned n;` intrinsic that also ties acc[0:nacc]: code that
    reads the accumulators after it cannot be moved above it (the plain wait ties nothing)."""
    return _make_cached(("wait", nacc), lambda: _acc_intrinsic(
        f"wgmma_wait_group_acc{nacc}", nacc, "wgmma.wait_group.sync.aligned %" + str(nacc) + ";",
        ("imm",),
        f"`wgmma.wait_group.sync.aligned n;` with acc[0:{nacc}] tied as in/out operands: "
        f"wait until at most n wgmma-groups of this warpgroup are pending.  Call as "
        f"wait(acc, n), n a compile-time constant.  Twin: nothing (wgmmas ran at once).",
        lambda acc, n: None))


def wgmma_wait_group_acc_a(nacc: int, na: int):
    """`wgmma.wait_group.sync.aligned n;` tying acc[0:nacc] (float32) AND a[0:na] (uint32: the
    register A fragments of the wgmmas the wait retires) as in/out operands.  Call as
    wait(acc, a, n), n a compile-time constant.

    Why: after an "rs" wgmma is issued its A registers are dead to the compiler until they are
    next written, but the tensor core reads them until the group retires.  ptxas resolves that
    by retiring the group (a `WARPGROUP.DEPBAR` to 0) before the first instruction that reuses
    one of those registers -- at the top of whatever was meant to overlap the wgmma (prefill
    attention's softmax under P V: its wait 1 and wait 0 came out adjacent in the SASS).  Tying
    the fragments here keeps them allocated, untouched, until this wait.  Twin: nothing."""
    return _make_cached(("wait_a", nacc, na), lambda: _acc_a_intrinsic(nacc, na))


def _acc_a_intrinsic(nacc, na):
    name = f"wgmma_wait_group_acc{nacc}_a{na}"

    def twin(acc, a, n):
        return None
    twin.__name__ = twin.__qualname__ = name
    twin.__doc__ = wgmma_wait_group_acc_a.__doc__
    twin.twin = twin
    twin.ptx_template = "wgmma.wait_group.sync.aligned %n;"
    if SIMULATOR:
        return twin
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def typer(typingctx, acc, a, n):
        if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.ndim == 1):
            raise TypingError(f"{name}: acc must be a 1-d float32 array, got {acc}")
        if not (isinstance(a, types.Array) and a.dtype == types.uint32 and a.ndim == 1):
            raise TypingError(f"{name}: a must be a 1-d uint32 array, got {a}")
        if not isinstance(n, types.IntegerLiteral):
            raise TypingError(f"{name}: n must be a compile-time integer constant, got {n}")
        return types.void(acc, a, n), codegen

    def codegen(context, builder, sig, llargs):
        f32, u32 = ir.FloatType(), ir.IntType(32)
        acc = context.make_array(sig.args[0])(context, builder, value=llargs[0])
        frag = context.make_array(sig.args[1])(context, builder, value=llargs[1])
        ptrs = ([cgutils.gep_inbounds(builder, acc.data, j) for j in range(nacc)]
                + [cgutils.gep_inbounds(builder, frag.data, j) for j in range(na)])
        operands = [builder.load(p) for p in ptrs]
        nout = nacc + na
        constraints = ["=f"] * nacc + ["=r"] * na + [str(j) for j in range(nout)]
        constraints.append("~{memory}")
        body = f"wgmma.wait_group.sync.aligned {int(sig.args[2].literal_value)};"
        outty = ir.LiteralStructType([f32] * nacc + [u32] * na)
        asm = ir.InlineAsm(ir.FunctionType(outty, [v.type for v in operands]), body,
                           ",".join(constraints), side_effect=True)
        res = builder.call(asm, operands, attrs=("nounwind", "convergent"))
        for j, p in enumerate(ptrs):
            builder.store(builder.extract_value(res, j), p)
        return context.get_dummy_value()

    return _finish(intrinsic, typer, name, ["acc", "a", "n"], twin, twin.ptx_template)


def wgmma_fence_acc(nacc: int):
    """`wgmma.fence.sync.aligned;` tying acc[0:nacc] (the accumulator's initial values are
    then written before the fence, as the PTX ISA asks)."""
    return _make_cached(("fence", nacc), lambda: _acc_intrinsic(
        f"wgmma_fence_acc{nacc}", nacc, "wgmma.fence.sync.aligned;", (),
        f"`wgmma.fence.sync.aligned;` with acc[0:{nacc}] tied as in/out operands, so that "
        f"their earlier writes stay before it.  Call as fence(acc).  Twin: nothing.",
        lambda acc: None))


def wgmma_zero_acc(nacc: int):
    """acc[0:nacc] = 0 as one asm block of `mov.b32 r, 0;` (a loop of nacc stores that LLVM
    does not unroll would put the accumulators in local memory).  Call as zero(acc).  Twin:
    the same in Python."""
    def twin(acc):
        for j in range(nacc):
            acc[j] = 0.0
    body = "\n".join(f"mov.b32 %{j}, 0;" for j in range(nacc))
    return _make_cached(("zero", nacc), lambda: _acc_intrinsic(
        f"wgmma_zero_acc{nacc}", nacc, body, (),
        f"acc[0:{nacc}] = 0.0 in registers (one asm block).  Call as zero(acc).", twin))


def acc_store_shared(offsets: tuple):
    """`st.shared.f32 [addr + offsets[j]], acc[j];` for every j, one asm block: the
    accumulators to shared memory at constant offsets (a loop over them that LLVM does not
    unroll would put them in local memory).  Call as store(acc, addr), addr a shared address
    (u32).  Twin: the same stores into simulated shared memory."""
    offsets = tuple(int(o) for o in offsets)
    nacc = len(offsets)

    def twin(acc, addr):
        for j, off in enumerate(offsets):
            _sim.shared_bytes(int(addr) + off, 4).view(np.float32)[0] = acc[j]
    body = "\n".join(f"st.shared.f32 [%{nacc}+{off}], %{j};" for j, off in enumerate(offsets))
    return _make_cached(("store", offsets), lambda: _acc_intrinsic(
        f"acc_store_shared{nacc}_{abs(hash(offsets)) % 10**8}", nacc, body, ("u32",),
        f"st.shared.f32 of acc[0:{nacc}] at constant offsets from a shared address.", twin))


@ptx("wgmma.wait_group.sync.aligned %0;", args=("imm",), effect="memory")
def wgmma_wait_group(n):
    """`wgmma.wait_group.sync.aligned n;` -- wait until at most n of this warpgroup's
    wgmma-groups are pending (n a compile-time constant).  Ties no register: prefer
    wgmma_wait_group_acc(nacc) before reading accumulators.  Twin: nothing."""


_cache: dict = {}


def _make_cached(key, make):
    if key not in _cache:
        _cache[key] = make()
    return _cache[key]


# ---- the MMA ------------------------------------------------------------------------------------

def _f16(u32, half):
    return float(np.array((int(u32) >> (16 * half)) & 0xFFFF, np.uint16).view(np.float16))


def a_fragment_coords(thread: int, reg: int, half: int) -> tuple[int, int]:
    """(row, k) in the 64 x 16 A of half `half` of register a{reg} of warpgroup thread
    `thread` (0..127)."""
    w, lane = divmod(thread, 32)
    g, t = divmod(lane, 4)
    return 16 * w + g + 8 * (reg & 1), 2 * t + half + 8 * (reg >> 1)


def d_coords(thread: int, j: int) -> tuple[int, int]:
    """(row, column) in the 64 x N D of accumulator j of warpgroup thread `thread`."""
    w, lane = divmod(thread, 32)
    g, t = divmod(lane, 4)
    i, r = divmod(j, 4)
    return 16 * w + g + 8 * (r >> 1), 8 * i + 2 * t + (r & 1)


def wgmma_group_model(n: int, a, b, d, scale_d) -> np.ndarray:
    """Whole-warpgroup model (tests, twins): a (64, 16), b (N, 16) as K-major rows, d (128,
    N/2) float32 accumulators by thread -> the new (128, N/2): A . B^T (+ D if scale_d)."""
    D = np.zeros((64, n))
    for th in range(128):
        for j in range(n // 2):
            D[d_coords(th, j)] = float(d[th][j])
    P = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T + (D if scale_d else 0.0)
    return np.array([[P[d_coords(th, j)] for j in range(n // 2)] for th in range(128)],
                    np.float32)


def _mma_twin(n, from_regs, off, trans_b=False):
    def twin(acc, *args):
        if from_regs:
            a0, a1, a2, a3, desc_b, scale_d = args
            mine = ((a0, a1, a2, a3), None, int(desc_b), int(scale_d))
        else:
            desc_a, desc_b, scale_d = args
            mine = (None, int(desc_a), int(desc_b), int(scale_d))
        d = [float(acc[off + j]) for j in range(n // 2)]
        everyone = _sim.warp_exchange((mine, d), size=128)
        assert len(everyone) == 128, "wgmma needs a whole warpgroup (128 threads)"
        th = threading_thread_id() % 128
        ops = [e[0] for e in everyone]
        assert len({o[2] for o in ops}) == 1 and len({o[3] for o in ops}) == 1, \
            "wgmma: the warpgroup's threads disagree on the B descriptor or scale-d"
        if from_regs:
            a = np.zeros((64, 16))
            for t2, o in enumerate(ops):
                for reg in range(4):
                    for half in range(2):
                        a[a_fragment_coords(t2, reg, half)] = _f16(o[0][reg], half)
        else:
            assert len({o[1] for o in ops}) == 1, "wgmma: threads disagree on the A descriptor"
            a = read_operand(mine[1], 64)
        b = (read_operand_mn if trans_b else read_operand)(mine[2], n)
        out = wgmma_group_model(n, a, b, [e[1] for e in everyone], mine[3])[th]
        for j in range(n // 2):
            acc[off + j] = out[j]
    return twin


def threading_thread_id() -> int:
    return threading.current_thread().thread_id


def _make_mma(n, from_regs, off, trans_b=False):
    nacc = n // 2
    acc = "{" + _acc_list(nacc) + "}"
    if from_regs:
        a = f"{{%{nacc}, %{nacc + 1}, %{nacc + 2}, %{nacc + 3}}}"
        b, sd = f"%{nacc + 4}", f"%{nacc + 5}"
        kinds = ("u32",) * 4 + ("u64", "s32")
        tail = "1, 1, 1" if trans_b else "1, 1, 0"   # scale-a, scale-b, trans-b
        form, call = "rs", "(acc, a0, a1, a2, a3, desc_b, scale_d)"
    else:
        a = f"%{nacc}"
        b, sd = f"%{nacc + 1}", f"%{nacc + 2}"
        kinds = ("u64", "u64", "s32")
        tail = "1, 1, 0, 1" if trans_b else "1, 1, 0, 0"   # .., trans-a, trans-b
        form, call = "ss", "(acc, desc_a, desc_b, scale_d)"
    template = ("{\n.reg .pred p;\nsetp.ne.b32 p, " + sd + ", 0;\n"
                f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {acc}, {a}, {b}, p, "
                f"{tail};\n}}")
    name = (f"wgmma_m64n{n}k16_f32_f16_{form}" + ("_tb" if trans_b else "")
            + (f"_acc{off}" if off else ""))
    doc = (f"`wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16` {call}: "
           f"acc[{off}:{off + nacc}] = A . B (+ acc when scale_d != 0), A 64 x 16 fp16 "
           + ("from registers (a0..a3: this thread's mma.m16n8k16-style fragment of its warp's "
              "16 rows)" if from_regs else "from shared memory (descriptor desc_a, K-major)")
           + f", B {n} x 16 {'MN-major (trans-b = 1)' if trans_b else 'K-major'} in shared "
           f"memory (descriptor desc_b).  Asynchronous: "
           f"wgmma_fence before, commit and wait before reading acc (module doc).  "
           f"Warpgroup-collective.  Twin: computes at once (not the asynchrony).")
    return _acc_intrinsic(name, nacc, template, kinds, doc,
                          _mma_twin(n, from_regs, off, trans_b), off)


def wgmma_rs(n: int, acc_offset: int = 0):
    """The register-A wgmma wrapper of width N (a multiple of 8, 8..256), accumulating into
    acc[acc_offset : acc_offset + N/2] (several tiles' accumulators in one local array)."""
    _check_n(n)
    return _make_cached(("rs", n, acc_offset), lambda: _make_mma(n, True, acc_offset))


def wgmma_ss(n: int, acc_offset: int = 0):
    """The shared-A wgmma wrapper of width N (a multiple of 8, 8..256), accumulating into
    acc[acc_offset : acc_offset + N/2]."""
    _check_n(n)
    return _make_cached(("ss", n, acc_offset), lambda: _make_mma(n, False, acc_offset))


def wgmma_rs_tb(n: int, acc_offset: int = 0):
    """The register-A wgmma of width N with B MN-major (`imm-trans-b` = 1; fp16/bf16 only):
    B[k, n] with n contiguous, in the layout `smem_offset_mn` models.  Prefill attention's
    O += P V takes V this way, as the cache stores it ([key][dim]), so no transpose is staged.
    Emits `wgmma.mma_async.sync.aligned.m64n{N}k16.f32.f16.f16 {d..}, {a0..a3}, desc_b, p,
    1, 1, 1;`."""
    _check_n(n)
    return _make_cached(("rs_tb", n, acc_offset), lambda: _make_mma(n, True, acc_offset, True))


def _check_n(n):
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma: N={n} must be a multiple of 8 in 8..256")


# The shapes a kernel imports by name (numba freezes module globals as constants).
wgmma_m64n64k16_f32_f16_rs = wgmma_rs(64)
wgmma_m64n128k16_f32_f16_rs = wgmma_rs(128)
wgmma_m64n256k16_f32_f16_rs = wgmma_rs(256)
wgmma_m64n64k16_f32_f16_ss = wgmma_ss(64)
wgmma_m64n128k16_f32_f16_ss = wgmma_ss(128)
