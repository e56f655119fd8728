"""The package's import graph, as docs/architecture.md draws it: no circle anywhere, and
no import that runs back up a layer."""

from __future__ import annotations

import ast
from pathlib import Path

import mlxvlm

PACKAGE = Path(mlxvlm.__file__).parent

# Lower layers first; a module may import its own layer and those below it. Each layer
# names folders (or a module that is a job on its own), as docs/architecture.md draws them.
LAYERS = (
    # building blocks that import nothing of mlxvlm but errors (and the CPU door)
    ("errors", "torch_free", "cpu", "distributed", "model_pool"),
    # the families, and what reads or shapes a model's inputs and outputs
    ("models", "media", "text", "sampling", "prompt_length", "retrieval"),
    # checkpoints read and written; a conversation turned into a model's inputs
    ("checkpoint", "prompt", "preparation"),
    # one sequence
    ("generate",),
    # many sequences: continuous batching, the prefix cache, the sharded engine
    ("batching",),
    # the commands
    ("__main__", "cli", "server", "ui", "finetune", "convert", "fuse", "benchmark", "embed"),
)
# Entry points inside the shared loop's packages.
ENTRY_MODULES = {"mlxvlm.generate.__main__"}


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("mlxvlm",) + path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the mlxvlm modules it imports (a submodule, not its package, when the
    import names one)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith("mlxvlm"):
                    found.add(target)
        edges[name] = found
    return edges


def layer(name: str) -> int | None:
    if name in ENTRY_MODULES:
        return len(LAYERS) - 1
    top = name.split(".")[1] if "." in name else None
    for index, members in enumerate(LAYERS):
        if top in members:
            return index
    return None


def test_every_module_has_a_layer():
    unplaced = [name for name in module_names() if name != "mlxvlm" and layer(name) is None]
    assert not unplaced, f"add these to LAYERS (and docs/architecture.md): {unplaced}"


def test_every_layer_names_what_exists():
    tops = {name.split(".")[1] for name in module_names() if "." in name}
    stale = [member for members in LAYERS for member in members if member not in tops]
    assert not stale, f"LAYERS names what is not in the package: {stale}"


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if a != "mlxvlm" and b != "mlxvlm" and layer(b) > layer(a))


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                circle = visit(target)
                if circle:
                    return circle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(edges):
        if start not in state:
            circle = visit(start)
            if circle:
                return circle
    return None


def test_no_import_runs_back_up():
    upward = upward_imports(imports(module_names()))
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_no_import_circle():
    circle = find_circle(imports(module_names()))
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_checks_see_a_circle_and_an_upward_import():
    circle = {"mlxvlm.cli": {"mlxvlm.generate.loop"}, "mlxvlm.generate.loop": {"mlxvlm.cli"}}
    assert find_circle(circle) == ["mlxvlm.cli", "mlxvlm.generate.loop", "mlxvlm.cli"]
    assert upward_imports(circle) == ["mlxvlm.generate.loop -> mlxvlm.cli"]
    assert find_circle({"mlxvlm.cli": {"mlxvlm.generate.loop"}}) is None
