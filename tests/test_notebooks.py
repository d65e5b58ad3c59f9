"""The notebooks run: every code cell not tagged "gpu" is executed in order, from the
repository root, as a reader would run them; and each .ipynb matches its generator."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_cells_run_on_the_cpu(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cells = json.loads(path.read_text())["cells"]
    ns = {"__name__": "__notebook__"}
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code" or "gpu" in cell["metadata"].get("tags", []):
            continue
        src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        exec(compile(src, f"{path.name}[{i}]", "exec"), ns)


def test_notebooks_match_their_generator(tmp_path):
    """The generator, run into a temporary folder, writes exactly the committed notebooks (the
    repository's copies are never rewritten here, so a hand edit keeps failing until the
    generator carries it)."""
    subprocess.run([sys.executable, str(ROOT / "notebooks" / "make_notebooks.py"), str(tmp_path)],
                   check=True, cwd=ROOT)
    built = {p.name: p.read_text() for p in sorted(tmp_path.glob("*.ipynb"))}
    committed = {p.name: p.read_text() for p in NOTEBOOKS}
    assert sorted(built) == sorted(committed), "notebooks/ and make_notebooks.py list different notebooks"
    for name in built:
        assert built[name] == committed[name], (
            f"{name} differs from what notebooks/make_notebooks.py writes: edit the generator, "
            f"then run `python3 notebooks/make_notebooks.py`")
