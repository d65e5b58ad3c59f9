"""Shared fixtures: tiny configs and synthetic HF snapshots / packed files built in tmp dirs.

Tests of other modules can ask for `tiny_snapshot` (an HF folder) or `tiny_nanoqwen` (its
packed .nanoqwen) instead of writing their own; both are built once per session.
"""
import sys
from pathlib import Path

import pytest

# the repository (nq) and this folder (ptx_util), wherever a test file sits below it
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from nq.config import tiny_config  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """The slow tests (the `slow` marker: most run kernels under the CUDA simulator, a minute
    or more each) first, the rest after them in their order.  pyproject.toml's `--dist load
    --maxschedchunk 1` hands each free xdist worker the next test, so the workers share the
    long ones from the start and end on quick ones, instead of one worker running a long test
    alone at the end (CI on 2 cores used 157 % of its CPUs that way, 18.5 min)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def tiny_cfg():
    """The default tiny model: 2 layers, hidden 256, 4 heads / 2 kv heads of 64, vocab 512."""
    return tiny_config()


@pytest.fixture(scope="session")
def tiny_snapshot(tmp_path_factory, tiny_cfg):
    """A bf16 HF snapshot folder of tiny_cfg with seed-0 random weights and the test tokenizer."""
    from nq.loader.synth import make_hf_snapshot
    return make_hf_snapshot(tmp_path_factory.mktemp("hf") / "tiny", tiny_cfg, seed=0)


@pytest.fixture(scope="session")
def tiny_nanoqwen(tmp_path_factory, tiny_snapshot):
    """tiny_snapshot packed into a .nanoqwen file (path)."""
    from nq.loader.hf import pack
    return pack(tiny_snapshot, tmp_path_factory.mktemp("nq") / "tiny.nanoqwen", progress=False)
