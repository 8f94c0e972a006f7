"""The package import graph, built from the source: no cycles, no upward imports.

Nodes are tokenmill's sub-packages and top-level modules (`envs`, `dtypes`,
`sampling_params`, ...); config's modules are nodes of their own
(`config.args`, `config.configs`, `config.resolve`), since `config.resolve`
is the one config module that imports downward (model_loader, platforms,
executor) and everything below imports only the plain `config.configs`. An edge is any import that runs, at module level or inside a
function (lazy imports still tie packages together); imports under
`if TYPE_CHECKING:` are types only and are left out.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tokenmill"
# Layers below the process code: they may not import these.
LOWER = ("core", "kernels", "layers")
UPPER = ("engine", "frontend", "entrypoints")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _node(module: str) -> str:
    """tokenmill.config.resolve -> config.resolve; tokenmill.core.scheduler -> core; tokenmill -> (root)."""
    parts = module.split(".")[1:]
    if not parts:
        return "(root)"
    if parts[0] == "config":
        return ".".join(parts[:2])
    return parts[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str) -> list[str]:
    """Absolute names of the tokenmill modules `tree` imports at run time."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import: resolve against this module's package
                pkg = module.split(".")[: -node.level] if not module.endswith("__init__") else module.split(".")
                base = ".".join(pkg + ([base] if base else []))
            # `from tokenmill import envs` imports the module tokenmill.envs
            found.extend(f"{base}.{a.name}" if base == "tokenmill" else base for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [name for name in found if name == "tokenmill" or name.startswith("tokenmill.")]


def build_graph() -> dict[str, dict[str, list[str]]]:
    """node -> {imported node -> ["importing.module -> imported.module", ...]}."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for target in _imports(ast.parse(path.read_text(), str(path)), module):
            a, b = _node(module), _node(target)
            if a != b:
                graph[a][b].append(f"{module} -> {target}")
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of nodes (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := dfs(start)):
            return cycle
    return None


def test_graph_is_built_from_the_source():
    graph = build_graph()
    # Edges the layout must have: the resolver imports downward, the front end talks to the engine.
    assert "model_loader" in graph["config.resolve"] and "config.configs" in graph["model_loader"]
    assert "engine" in graph["frontend"]
    assert "kernels" in graph["layers"]


def test_no_cycle_among_packages():
    graph = build_graph()
    cycle = find_cycle(graph)
    if cycle:
        edges = [f"{a} -> {b}: {graph[a][b][0]}" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle among packages:\n  " + "\n  ".join(edges))


def test_no_upward_import_from_lower_layers():
    graph = build_graph()
    bad = [edge for low in LOWER for up in UPPER for edge in graph.get(low, {}).get(up, [])]
    assert not bad, "upward imports:\n  " + "\n  ".join(bad)


def test_find_cycle_reports_a_planted_cycle():
    graph = {"a": {"b": ["x"]}, "b": {"c": ["y"]}, "c": {"a": ["z"]}, "d": {"a": ["w"]}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": ["x"]}, "b": {}}) is None
