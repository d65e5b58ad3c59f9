"""Names that cannot resolve, found before a GPU does: pyflakes over the package, the scripts
and the tests.  (`nq verify`'s unit tier once read a name imported in another function; only
the H200 could have run that line.)  Unused imports and the like are left to review."""
import ast
import pathlib

import pyflakes.checker as pyflakes_checker   # the `test` extra's (pyproject.toml)
import pyflakes.messages as pyflakes_messages

ROOT = pathlib.Path(__file__).resolve().parent.parent
UNRESOLVED = (pyflakes_messages.UndefinedName, pyflakes_messages.UndefinedLocal,
              pyflakes_messages.UndefinedExport)


def test_every_name_resolves():
    bad = []
    for part in ("nq", "scripts", "tests"):
        for f in sorted((ROOT / part).rglob("*.py")):
            tree = ast.parse(f.read_text(), str(f))
            w = pyflakes_checker.Checker(tree, filename=str(f.relative_to(ROOT)))
            bad += [str(m) for m in w.messages if isinstance(m, UNRESOLVED)]
    assert not bad, "\n".join(bad)
