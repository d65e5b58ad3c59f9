"""Not enough GPU memory at load (issue #18), on the H200: a context that cannot fit is refused
before anything is allocated, with the bytes needed and free; the check's count of what an
engine allocates holds against the driver's free-memory figure."""
import pytest

from nq.config import PRESETS, tiny_config
from nq.runtime import memory as M

pytestmark = pytest.mark.gpu

CFG = tiny_config(head_dim=128, num_heads=7, num_kv_heads=1, num_layers=2, intermediate_size=640)


def free_total():
    """(free, total) bytes, after what earlier tests left to the garbage collector and to
    numba's deferred frees is really freed (else it could be freed inside a measurement)."""
    import gc

    from numba import cuda
    gc.collect()
    ctx = cuda.current_context()
    ctx.synchronize()
    ctx.deallocations.clear()
    free, total = ctx.get_memory_info()
    return int(free), int(total)


@pytest.fixture
def allocations(monkeypatch):
    """The sizes of this process's device allocations from now on: every one goes through
    Context.memalloc (device_array, to_device, pinned copies' device side).  The device's free
    memory is no witness: other processes on the GPU move it (pytest -n runs several)."""
    from numba.cuda.cudadrv import driver
    allocated = []
    real = driver.Context.memalloc

    def memalloc(self, nbytes):
        allocated.append(int(nbytes))
        return real(self, nbytes)
    monkeypatch.setattr(driver.Context, "memalloc", memalloc)
    return allocated


def test_an_engine_too_large_is_refused_before_it_allocates(allocations):
    # count the allocations during the refused construction
    from nq.runtime.engine import Engine
    from nq.runtime.weights import random_device_weights
    w = random_device_weights(CFG, 0)
    allocated = allocations
    allocated.clear()          # the weights' own
    with pytest.raises(M.DeviceMemoryError) as e:
        Engine(CFG, w, max_len=2_000_000_000)
    msg = str(e.value)
    assert "bytes" in msg and "free" in msg and "use -c" in msg, msg
    assert allocated == [], f"{len(allocated)} allocations ({sum(allocated)} bytes) before the refusal"
    print(msg)
    Engine(CFG, w, max_len=64)   # the witness sees an engine's allocations when there are some
    assert len(allocated) > 3


def test_kv_that_fits_but_not_beside_the_weights_is_refused():
    """The 7B's figures against this GPU's free memory: a context whose KV fits the free memory
    alone is refused when the 5.5 GB of weights still have to be uploaded."""
    free, total = free_total()
    c7 = PRESETS["7b"]
    ctx = (M.largest_context(c7, free, 2048, True) + M.largest_context(c7, free, 2048, False)) // 2
    M.check_fits(c7, ctx, 2048, False, free, total)
    with pytest.raises(M.DeviceMemoryError, match="weights 5.55") as e:
        M.check_device_memory(c7, ctx, 2048, weights=True)
    print(e.value)


def test_the_count_covers_what_an_engine_allocates(allocations):
    """Build an engine at a context of 64K tokens: what it allocates is at least its KV cache
    and at most the count (KV, buffers, prefill workspace, margin).  Counted at
    Context.memalloc (the fixture): read from the device's free memory, this test once saw an
    engine take -478 MB while other workers freed theirs."""
    from nq.runtime.engine import Engine
    from nq.runtime.prefill import workspace_bytes
    from nq.runtime.weights import random_device_weights
    w = random_device_weights(CFG, 0)
    allocated = allocations
    allocated.clear()          # the weights' own
    eng = Engine(CFG, w, max_len=65536, prefill_chunk=128)
    eng.stream.synchronize()
    used = sum(allocated)
    parts = M.engine_bytes(CFG, 65536, 128, weights=False)
    assert parts["KV cache"] <= used <= sum(parts.values()), (used, parts)
    assert eng.prefiller.workspace_bytes == workspace_bytes(CFG, 128)
    print(f"engine allocated {used} bytes in {len(allocated)} allocations; counted "
          f"{sum(parts.values())} ({parts})")
    del eng


def test_nq_generate_refuses_a_context_that_cannot_fit(tiny_nanoqwen, capsys):
    from nq.cli import main
    rc = main(["generate", "-m", str(tiny_nanoqwen), "-c", "3000000000", "-p", "hi", "-n", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "not enough GPU memory" in err and "free" in err and "use -c" in err, err
    assert "Traceback" not in err
