"""CPU tier for l2_pace (nq/kernels/pace.py): the ranges it asks L2 for (its reference), the
same ranges issued by the kernel under the CUDA simulator (one CTA or two), and its sm_90 PTX (the clock it
spins on, the prefetch, no local memory)."""
import textwrap

import pytest

from nq.kernels import pace

from ptx_util import (assert_no_local_memory, assert_uses, compile_ptx_sm90, count, have_ptxas,
                      ptxas_report, run_under_simulator)


def test_ranges_cover_each_tile_head_once_gate_beside_up():
    n_tiles, k, groups = 37, 512, 3          # 37 pairs: the last batch is short
    tile_bytes = k // 128 * 1024
    got = pace.pace_ranges(n_tiles, k, groups)
    assert len(got) == 2 * n_tiles
    assert sorted(off for off, _ in got) == [t * tile_bytes for t in range(2 * n_tiles)]
    assert all(n == groups * 1024 for _, n in got)
    assert all(off + n <= 2 * n_tiles * tile_bytes for off, n in got)
    # a gate tile and its up tile are asked for by neighbouring lanes of the same batch
    for i in range(0, len(got), 2):
        assert got[i + 1][0] - got[i][0] == n_tiles * tile_bytes


def test_refuses_heads_past_a_tile():
    with pytest.raises(ValueError, match="groups=5 must be 1..4"):
        pace.pace_kernel.__wrapped__(8, 512, 5, 100)
    with pytest.raises(ValueError, match="cycles"):
        pace.pace_kernel.__wrapped__(8, 512, 2, -1)


SIM = textwrap.dedent('''
    import numpy as np
    from numba import cuda
    from nq.kernels import pace

    issued = []
    def record(src, idx, nbytes):
        assert int(nbytes) % 16 == 0 and (int(idx) * 4) % 16 == 0
        assert int(idx) * 4 + int(nbytes) <= src.size * 4
        issued.append((int(idx) * 4, int(nbytes)))
    pace.cp_async_bulk_prefetch_l2 = record      # the kernel body reads the module global

    for n_tiles, k, groups, cycles, ctas in ((37, 512, 3, 0, 1), (16, 256, 2, 50, 1),
                                             (37, 512, 3, 0, 2)):
        issued.clear()
        kern = pace.pace_kernel.__wrapped__(n_tiles, k, groups, cycles, ctas)
        qw = cuda.to_device(np.zeros(2 * n_tiles * (k // 128) * 256, np.uint32))
        kern[ctas, 32](qw)
        want = pace.pace_ranges(n_tiles, k, groups)
        # the simulator runs the lanes as threads: compare as sets, count each once
        ok = sorted(issued) == sorted(want) and len(issued) == len(want)
        print(f"t{n_tiles}_c{cycles}_n{ctas}", 0.0 if ok else 1.0, flush=True)
''')


@pytest.mark.slow
def test_kernel_issues_the_reference_ranges_under_the_simulator():
    values, out = run_under_simulator(SIM, timeout=600)
    assert values == {"t37_c0_n1": 0.0, "t16_c50_n1": 0.0, "t37_c0_n2": 0.0}, out


def test_ptx_spins_on_the_clock_and_prefetches():
    n_tiles, k, groups, cycles = 1184, 3584, 10, 300
    body = _body(n_tiles, k, groups, cycles)
    ptx = compile_ptx_sm90(body, "void(uint32[::1])")
    assert_uses(ptx, "%clock64")
    assert_uses(ptx, "cp.async.bulk.prefetch.L2.global")
    assert count(ptx, "griddepcontrol") == 0      # a side kernel: no programmatic edges
    assert_no_local_memory(ptx)
    if have_ptxas():
        assert ptxas_report(ptx)[1] == 0


def _body(n_tiles, k, groups, cycles):
    """The kernel body pace_kernel compiles, without compiling it."""
    from unittest import mock
    captured = {}

    def fake_compile(body, sig, name, **kw):
        captured["body"] = body
        return body
    with mock.patch.object(pace, "compile_kernel", fake_compile):
        pace.pace_kernel.__wrapped__(n_tiles, k, groups, cycles)
    return captured["body"]
