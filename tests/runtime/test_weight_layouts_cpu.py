"""runtime.weights.weight_layouts: what the upload re-tiles into, taken without compiling a
kernel, is what the engine's GEMVs (runtime.weights.gemvs) read -- for every preset, the tiny
test shapes, and the environment switches that move a projection between the CUDA-core and
tensor-core layouts."""
import pytest

from nq.config import PRESETS, tiny_config
from nq.kernels.int4 import launch, tiling
from nq.runtime.weights import gemvs, weight_layouts

CONFIGS = {**PRESETS, "tiny": tiny_config(),
           "tiny-d128": tiny_config(head_dim=128, num_heads=7, num_kv_heads=1,
                                    intermediate_size=640)}


@pytest.fixture
def no_compiles(monkeypatch):
    """The launchers without their kernels: only their shapes and tilings are compared."""
    compiled = []
    monkeypatch.setattr(launch, "compile_gemv", lambda *a, **k: compiled.append(a[0]))
    monkeypatch.setattr(launch, "compile_gemv_mma", lambda *a, **k: compiled.append(a[0]))
    monkeypatch.setattr(launch, "allow_smem", lambda *a, **k: None)
    return compiled


@pytest.mark.parametrize("mma_gate_up", [True, False], ids=["gate_up-mma", "gate_up-cuda-cores"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_upload_writes_the_layout_the_engine_reads(name, mma_gate_up, monkeypatch,
                                                       no_compiles):
    monkeypatch.setattr(tiling, "MMA_GATE_UP", mma_gate_up)
    cfg = CONFIGS[name]
    layouts = weight_layouts(cfg)
    assert no_compiles == []                          # nothing compiled for the upload
    engine = gemvs(cfg)
    assert sorted(no_compiles) == sorted(layouts)     # the engine's four, all of them
    for kind, wl in layouts.items():
        g = engine[kind]
        assert (wl.n_rows, wl.k, wl.tiling) == (g.n_rows, g.k, g.tiling), (kind, wl, g.name)
        assert wl.tiling.layout() == g.tiling.layout()
