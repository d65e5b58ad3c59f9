"""The one helper every `nq.ptx` wrapper is built with: PTX template + operand kinds -> intrinsic.

numba-cuda has no inline-asm API (numba-cuda issue #532), but an `@intrinsic` whose lowering
calls llvmlite's `InlineAsm` emits the PTX verbatim, inlined at the call site with no call
overhead (the same route numba-cuda's own `cache_hints.py` takes for `ld.global.cs`).

A wrapper is written once, as its pure-Python twin decorated with `@ptx(...)`:

    @ptx("prmt.b32 %0, %1, %2, %3;", out="u32", args=("u32", "u32", "u32"))
    def prmt_b32(a, b, sel):
        '''docstring: the PTX it emits and why it exists'''
        ...the instruction's semantics in Python...

On the GPU target the name is the intrinsic; under the CUDA simulator
(`NUMBA_ENABLE_CUDASIM=1`) it is the twin itself, so kernels run unchanged there.  Either way
`wrapper.twin` is the Python model, which the CPU tests use as the specification.

Template operands are written `%k` (as in CUDA C inline asm): the outputs first, then the
Python arguments in order.  Operand kinds, one table for every wrapper:

    u16 / u32 / s32 / u64 / f32 / f64   a register of that type (the argument is cast to it)
    imm                                  a compile-time integer constant, spliced into the
                                         text (a literal or a global/closure int in the kernel)
    base                                 an array: the 64-bit generic address of its element 0
    arr, idx                             an array and an element index (an int, or a tuple for
                                         an N-d array): together one 64-bit generic address,
                                         referenced by the `arr` slot; the `idx` slot is unused

effect says what LLVM may assume, so it can optimise around the asm without breaking it:

    "pure"    (default) arithmetic on registers: `readnone`, so LLVM may merge, hoist or
              delete it like an add.
    "load"    reads memory nobody writes during the kernel (`.nc` loads): `readonly`, so
              duplicates merge but it never moves across a store or a barrier.
    "memory"  stores, barriers, fences, async copies: volatile (never deleted, merged or
              hoisted) with a "memory" clobber, so LLVM keeps no memory value in a register
              across it and orders ordinary loads and stores around it.

Every call is also `convergent` (clang does the same for CUDA inline asm): warp-collective
instructions such as mma.sync must not be moved under a divergent branch.
"""
from __future__ import annotations

import inspect
import re

from llvmlite import ir
from numba.core import config
from numba.core.errors import TypingError

from numba import types

SIMULATOR = bool(config.ENABLE_CUDASIM)

# kind -> (numba type, PTX inline-asm constraint letter)
KINDS = {
    "u16": (types.uint16, "h"),
    "u32": (types.uint32, "r"),
    "s32": (types.int32, "r"),
    "u64": (types.uint64, "l"),
    "f32": (types.float32, "f"),
    "f64": (types.float64, "d"),
}

_EFFECTS = {
    "pure": ("readnone", "nounwind", "convergent"),
    "load": ("readonly", "nounwind", "convergent"),
    "memory": ("nounwind", "convergent"),
}

_OPERAND = re.compile(r"%(\d+)")


def ptx(template, *, out=None, args=(), effect="pure"):
    """Decorator: turn a Python twin into the intrinsic emitting `template` (see module doc).

    out: None (no result), a kind (one result) or a tuple of kinds (a numba tuple).
    """
    assert effect in _EFFECTS, f"effect {effect!r}"
    outs = () if out is None else (out,) if isinstance(out, str) else tuple(out)
    for k in outs:
        assert k in KINDS, f"output kind {k!r}"
    for i, k in enumerate(args):
        assert k in KINDS or k in ("imm", "base", "arr", "idx"), f"argument kind {k!r}"
        assert (k == "idx") == (i > 0 and args[i - 1] == "arr"), "write 'arr' then 'idx'"

    def wrap(twin):
        twin.twin = twin
        twin.ptx_template = template
        if SIMULATOR:
            return twin
        intr = _make_intrinsic(twin, template, outs, tuple(args), effect,
                               single=isinstance(out, str))
        intr.twin = twin
        intr.ptx_template = template
        return intr

    return wrap


def _make_intrinsic(twin, template, outs, kinds, effect, single):
    from numba.cuda.extending import intrinsic

    name = twin.__name__
    params = list(inspect.signature(twin).parameters.values())
    assert len(params) == len(kinds), f"{name}: {len(params)} parameters, {len(kinds)} kinds"

    if not outs:
        ret = types.void
    elif single:
        ret = KINDS[outs[0]][0]
    else:
        ret = types.Tuple([KINDS[k][0] for k in outs])

    def typer(typingctx, *argtys):
        sig_args = []
        for i, (k, t) in enumerate(zip(kinds, argtys)):
            if k == "imm":
                if not isinstance(t, types.IntegerLiteral):
                    # numba first types calls with literals erased, then retries with them, and
                    # reports this only when both fail, i.e. when the value is a runtime int.
                    raise TypingError(
                        f"{name}: argument {i} ({params[i].name}) must be a compile-time integer "
                        f"constant, got {t}: pass a literal or a global/closure int imported by "
                        f"name (`from nq.ptx import LUT_AND_XOR`); numba types a module "
                        f"attribute such as `ptx.LUT_AND_XOR` as a runtime int64")
                sig_args.append(t)
            elif k in ("arr", "base"):
                if not isinstance(t, types.Array):
                    raise TypingError(f"{name}: argument {i} must be an array, got {t}")
                sig_args.append(t)
            elif k == "idx":
                nd = argtys[i - 1].ndim
                ok = (isinstance(t, types.Integer) and nd == 1) or (
                    isinstance(t, types.BaseTuple) and len(t) == nd
                    and all(isinstance(e, types.Integer) for e in t))
                if not ok:
                    raise TypingError(f"{name}: argument {i} must index a {nd}-d array, got {t}")
                sig_args.append(types.unliteral(t))
            else:
                want = KINDS[k][0]
                okclass = types.Float if isinstance(want, types.Float) else types.Integer
                if not isinstance(t, (okclass, types.Boolean)) or (
                        isinstance(t, types.Boolean) and okclass is types.Float):
                    raise TypingError(f"{name}: argument {i} must be {okclass.__name__}, got {t}")
                sig_args.append(want)
        return ret(*sig_args), _codegen

    def _codegen(context, builder, sig, llargs):
        # text_of: template operand %n -> LLVM operand $r (or the spliced immediate)
        constraints = ["=" + KINDS[k][1] for k in outs]
        text_of = {j: f"${j}" for j in range(len(outs))}
        operands, reg = [], len(outs)
        for i, k in enumerate(kinds):
            n = len(outs) + i
            if k == "imm":
                text_of[n] = str(int(sig.args[i].literal_value))
            elif k == "idx":
                continue
            else:
                if k == "arr":
                    value = element_address(context, builder, sig.args[i], llargs[i],
                                            sig.args[i + 1], llargs[i + 1])
                    constraints.append("l")
                elif k == "base":
                    data = context.make_array(sig.args[i])(context, builder, value=llargs[i]).data
                    value = builder.ptrtoint(data, ir.IntType(64))
                    constraints.append("l")
                else:
                    value = llargs[i]
                    constraints.append(KINDS[k][1])
                operands.append(value)
                text_of[n] = f"${reg}"
                reg += 1
        if effect == "memory":
            constraints.append("~{memory}")
        text = _OPERAND.sub(lambda m: text_of[int(m.group(1))], template)
        llouts = [context.get_value_type(KINDS[k][0]) for k in outs]
        if not llouts:
            llret = ir.VoidType()
        elif len(llouts) == 1:
            llret = llouts[0]
        else:
            llret = ir.LiteralStructType(llouts)
        fnty = ir.FunctionType(llret, [v.type for v in operands])
        asm = ir.InlineAsm(fnty, text, ",".join(constraints), side_effect=effect == "memory")
        result = builder.call(asm, operands, attrs=_EFFECTS[effect])
        if not outs:
            return context.get_dummy_value()
        if len(outs) == 1 and single:
            return result
        if len(outs) == 1:
            values = [result]
        else:
            values = [builder.extract_value(result, j) for j in range(len(outs))]
        return context.make_tuple(builder, sig.return_type, values)

    sig = inspect.Signature([inspect.Parameter("typingctx", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
                            + [p.replace(default=inspect.Parameter.empty) for p in params])
    typer.__signature__ = sig
    typer.__name__ = name
    typer.__qualname__ = name
    typer.__module__ = twin.__module__
    typer.__doc__ = twin.__doc__
    return intrinsic(typer)  # non-literal typing fails for "imm", so numba retries literally


def element_address(context, builder, aryty, ary, idxty, idx):
    """i64 generic address of ary[idx] (no wraparound, no bounds check: the caller owns it)."""
    from numba.cuda import cgutils

    if isinstance(idxty, types.BaseTuple):
        raw = cgutils.unpack_tuple(builder, idx, count=len(idxty))
        idxtys = list(idxty)
    else:
        raw, idxtys = [idx], [idxty]
    inds = [context.cast(builder, v, t, types.intp) for v, t in zip(raw, idxtys)]
    arr = context.make_array(aryty)(context, builder, value=ary)
    ptr = cgutils.get_item_pointer(context, builder, aryty, arr, inds, wraparound=False)
    return builder.ptrtoint(ptr, ir.IntType(64))
