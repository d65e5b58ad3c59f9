"""The engine's memory check (nq/runtime/memory.py) on the CPU: the bytes it counts, the message
(bytes needed and free, the largest -c that fits) and where the line between fit and refusal
falls.  tests/runtime/test_memory_gpu.py checks the same against a real H200's free memory."""
import pytest

from nq.config import PRESETS
from nq.loader.format import NanoqwenFile
from nq.paged import pool_bytes
from nq.runtime import memory as M

C7 = PRESETS["7b"]


def test_weight_bytes_are_the_files_tensor_bytes(tiny_nanoqwen):
    nf = NanoqwenFile(tiny_nanoqwen)
    stored = sum(nf.entry(n).nbytes for n in nf.names() if not n.startswith("meta/"))
    assert M.weight_bytes(nf.config, nf.lm_head) == stored
    assert nf.lm_head == "int4+fp16"            # pack's default: the INT4 head and fp16 rows
    fp16 = M.weight_bytes(nf.config, "fp16")
    c = nf.config
    assert stored - fp16 == c.vocab_size * c.hidden_size // 2 + c.vocab_size * c.hidden_size // 64


def test_the_7b_figures():
    parts = M.engine_bytes(C7, 4096, 2048, weights=True)
    assert parts["KV cache"] == pool_bytes(C7, 257) == 257 * 28 * 4 * 2 * 16 * 128 * 2
    assert 5.7e9 < parts["weights"] < 5.9e9      # the default int4+fp16 head: both heads
    assert 5.4e9 < M.engine_bytes(C7, 4096, 2048, True, lm_head="fp16")["weights"] < 5.7e9
    assert parts["weights"] - M.weight_bytes(C7, "fp16") == 152064 * 3584 * (1 / 2 + 2 / 128)
    assert 1.9e8 < parts["prefill workspace"] < 2.1e8
    assert "weights" not in M.engine_bytes(C7, 4096, 2048, weights=False)


def test_a_context_whose_kv_alone_exceeds_the_gpu_is_refused_with_the_figures():
    free, total = 140_000_000_000, 143_800_000_000
    with pytest.raises(M.DeviceMemoryError) as e:
        M.check_fits(C7, 3_000_000, 2048, True, free, total)
    msg = str(e.value)
    need = sum(M.engine_bytes(C7, 3_000_000, 2048, True).values())
    assert f"{need} bytes" in msg and f"{free} bytes" in msg and "KV cache 172.03" in msg
    fits = M.largest_context(C7, free, 2048, True)
    assert f"use -c {fits} or less" in msg and 2_000_000 < fits < 2_500_000


@pytest.mark.parametrize("weights", [True, False])
def test_largest_context_is_the_line(weights):
    free = 20_000_000_000
    n = M.largest_context(C7, free, 2048, weights)
    assert n % 1024 == 0 and n > 0
    M.check_fits(C7, n, 2048, weights, free, free)
    with pytest.raises(M.DeviceMemoryError):
        M.check_fits(C7, n + 1024, 2048, weights, free, free)


def test_kv_that_fits_alone_but_not_beside_the_weights():
    free = 30_000_000_000
    with_w, without = (M.largest_context(C7, free, 2048, w) for w in (True, False))
    ctx = (with_w + without) // 2
    M.check_fits(C7, ctx, 2048, False, free, free)  # weights already on the GPU: fits
    with pytest.raises(M.DeviceMemoryError, match="weights 5.83"):   # int4+fp16 head
        M.check_fits(C7, ctx, 2048, True, free, free)


def test_nothing_fits():
    with pytest.raises(M.DeviceMemoryError, match="free the GPU"):
        M.check_fits(C7, 4096, 2048, True, 1_000_000_000, 80_000_000_000)
    assert M.largest_context(C7, 1_000_000_000, 2048, True) == 0
