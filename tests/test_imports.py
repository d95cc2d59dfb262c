"""The engine's modules import one another without a circle (docs/architecture.md): read from the
source (module-level imports, those under ``if TYPE_CHECKING:`` included), not by importing; and
the engine never imports the lab (``dllm_lab``)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dllm_engine"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports at module level (and under ``if TYPE_CHECKING:``);
    a package counts for the modules inside it only when it is not their own."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    nodes = list(tree.body) + [n for top in tree.body if isinstance(top, ast.If) for n in top.body]
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    found &= modules
    # importing a.b.c runs a.b's __init__ first (unless the importer lives inside a.b)
    for target in list(found):
        parts = target.split(".")
        found.update(p for p in (".".join(parts[:i]) for i in range(2, len(parts)))
                     if p in modules and not name.startswith(p + "."))
    found.discard(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_engine_has_no_import_circle():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: imports(path, set(files)) for name, path in files.items()}
    assert graph["dllm_engine.decoding.decoders"] >= {"dllm_engine.decoding.commit_rules"}  # the walk sees imports
    assert "dllm_engine.engine.sequence" in graph["dllm_engine.engine.engine"]
    assert cycles(graph) == []


def test_the_step_plan_is_a_leaf():
    """The step-plan type imports nothing of the engine but the host/device transfer helpers,
    which import nothing of it at all."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    assert imports(files["dllm_engine.decoding.plan"], modules) <= {"dllm_engine.engine.transfer",
                                                                    "dllm_engine.engine", "dllm_engine.decoding"}
    assert imports(files["dllm_engine.engine.transfer"], modules) <= {"dllm_engine.engine"}


def test_a_circle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_engine_never_imports_the_lab():
    """No engine module names ``dllm_lab`` in any import, at any depth of its code (function-level
    imports included): read from the source; and importing every engine module loads no lab
    module (a fresh process)."""
    import subprocess
    import sys
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            offenders += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}" for n in names
                          if n == "dllm_lab" or n.startswith("dllm_lab.")]
    assert offenders == []
    code = ("import importlib, pkgutil, sys, dllm_engine\n"
            # the optional extras' modules (slow to import; the source check above reads them) and __main__
            "skip = ('dllm_engine.integrations', 'dllm_engine.playground', 'dllm_engine.server.replicated',\n"
            "        'dllm_engine.cli.__main__')\n"
            "for m in pkgutil.walk_packages(dllm_engine.__path__, 'dllm_engine.'):\n"
            "    if not m.name.startswith(skip):\n"
            "        importlib.import_module(m.name)\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'dllm_lab'))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def package_graph() -> dict[str, list[str]]:
    """Subpackage (or top-level module) -> those it imports, from the module graph."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    group = lambda m: m.split(".")[1] if "." in m else "(package)"  # noqa: E731
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        for target in imports(path, set(files)):
            if group(name) != group(target):
                edges.setdefault(group(name), set()).add(group(target))
    return {a: sorted(b) for a, b in sorted(edges.items())}


def test_architecture_md_draws_the_import_graph_the_source_has():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = text.split("The engine's import graph by subpackage", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    drawn = {a: b.split(", ") for a, b in (line.split(" -> ") for line in block.strip().splitlines())}
    assert drawn == package_graph()
