"""The package's shape, as docs/ARCHITECTURE.md draws it: no import circles anywhere in nq/
(module-level or inside functions), and no import from the kernels up into the runtime, the
tools, the server or the CLI."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "nq"


def import_graph() -> dict[str, set[str]]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f

    def resolve(name):
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name

    graph = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nq"):
                targets = [resolve(f"{node.module}.{a.name}") or resolve(node.module) for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names if a.name.startswith("nq")]
            graph[m] |= {t for t in targets if t and t != m}
    return graph


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_real_imports():
    g = import_graph()
    assert "nq.kernels.build" in g["nq.kernels.int4.gemv"] and "nq.paged" in g["nq.runtime.engine"]


def test_no_import_circles():
    assert cycles(import_graph()) == []
    # and the check itself finds one when there is one
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def test_kernels_never_import_upward():
    up = ("nq.runtime", "nq.tools", "nq.serve", "nq.cli", "nq.chat", "nq.generate")
    bad = [(m, t) for m, ts in import_graph().items() if m.startswith("nq.kernels")
           for t in ts if t.startswith(up)]
    assert not bad, f"kernels importing the layers above them: {bad}"


def test_the_command_line_imports_nothing_heavy():
    """`nq`'s start (nq.cli and its parser) imports no third-party package: numpy, numba and
    the tokenizer load where a subcommand needs them (`nq generate` starts numba's import on a
    thread as soon as its flags are parsed, nq/gpu_start.py), the server, packer and
    benchmark packages only in their subcommands."""
    import subprocess
    import sys
    heavy = ("numpy", "numba", "llvmlite", "cuda", "tokenizers", "jinja2", "huggingface_hub",
             "safetensors", "torch", "transformers", "starlette", "uvicorn", "tqdm", "scipy")
    code = ("import sys, nq.cli; nq.cli.build_parser(); "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent)
    assert out.stdout.strip() == "[]", out.stdout


def test_generate_on_the_cpu_imports_only_what_it_uses(tiny_nanoqwen):
    """`nq generate` (NumPy backend, plain prompt): numpy and tokenizers, nothing of the
    packer (huggingface_hub, safetensors, tqdm), the server or the chat template (jinja2)."""
    import subprocess
    import sys
    code = ("import sys; from nq.cli import main; "
            f"rc = main(['generate', '--backend', 'numpy', '-m', {str(tiny_nanoqwen)!r}, "
            "'-p', 'x', '-n', '1']); "
            "print(rc, sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'tokenizers', "
            "'jinja2', 'huggingface_hub', 'safetensors', 'tqdm', 'torch', 'starlette', "
            "'uvicorn', 'numba'}), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent)
    assert out.stderr.strip().splitlines()[-1] == "0 ['numpy', 'tokenizers']", out.stderr
