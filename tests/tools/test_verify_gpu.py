"""`nq verify` end to end on the GPU: a tiny packed model and a 2-layer model at the 7B width
(random INT4 from scripts/make_random_nanoqwen.py) pass all five tiers."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nq.cli import main

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_verify_tiny(tiny_nanoqwen, tmp_path, capsys):
    out = tmp_path / "v.json"
    rc = main(["verify", "-m", str(tiny_nanoqwen), "--prompts", "8", "--tokens", "16",
               "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0, capsys.readouterr().out
    assert {r["tier"] for r in res["rows"]} == {"unit", "layer", "prefill", "decode", "graph"}


def test_verify_7b_width_two_layers(tmp_path, capsys):
    model = tmp_path / "w.nanoqwen"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_random_nanoqwen.py"), "7b",
                    str(model), "--layers", "2"], check=True)
    assert main(["verify", "-m", str(model), "--prompts", "16", "--tokens", "32"]) == 0, \
        capsys.readouterr().out
