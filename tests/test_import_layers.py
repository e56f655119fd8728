"""The package's import graph, as docs/architecture.md draws it: no circle anywhere, and
no import that runs back up a layer."""

from __future__ import annotations

import ast
from pathlib import Path

import mlxvlm

PACKAGE = Path(mlxvlm.__file__).parent

# Lower floors first. A module imports modules of its own folder and of lower floors
# only: two folders on one floor never import each other, so each floor is as fine as
# the graph allows. Each floor names folders (or a module that is a job on its own), as
# docs/architecture.md draws them.
LAYERS = (
    # building blocks that import nothing of mlxvlm
    ("errors", "torch_free", "cpu", "progress", "mlx_threads"),
    # the process set-up; building blocks over errors: the group, media, the model pool,
    # sampling, the prompt-length check
    ("process_setup", "distributed", "media", "model_pool", "sampling", "prompt_length"),
    # the families; text handling; preparing off the caller's thread
    ("models", "text", "preparation"),
    # what a model does besides generating; a conversation turned into a model's inputs;
    # the stages that speak an answer
    ("retrieval", "prompt", "speech"),
    # checkpoints read and written
    ("checkpoint",),
    # one sequence; what every command shares
    ("generate", "cli"),
    # many sequences: continuous batching, the prefix cache, the sharded engine; convert
    ("batching", "convert"),
    # commands over convert, the loop and the uses
    ("finetune", "fuse", "benchmark", "embed"),
    # the serving commands and the command list
    ("server", "ui", "__main__"),
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


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:``: an import for annotations only
    never runs, so it is no edge of the graph (models/base.py names the types of what
    loading sets on a model, some from floors above)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in (
                    "TYPE_CHECKING", "typing.TYPE_CHECKING"):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the mlxvlm modules it imports (a submodule, not its package, when the
    import names one)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
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


def folder(name: str) -> str:
    return name.split(".")[1]


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """Imports that run back up a floor, or sideways into another folder of the same
    floor."""
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if a != "mlxvlm" and b != "mlxvlm"
                  and (layer(b) > layer(a) or (layer(b) == layer(a) and folder(a) != folder(b)
                                               and a not in ENTRY_MODULES)))


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
    circle = {"mlxvlm.server.app": {"mlxvlm.generate.loop"},
              "mlxvlm.generate.loop": {"mlxvlm.server.app"}}
    assert find_circle(circle) == ["mlxvlm.generate.loop", "mlxvlm.server.app",
                                   "mlxvlm.generate.loop"]
    assert upward_imports(circle) == ["mlxvlm.generate.loop -> mlxvlm.server.app"]
    assert find_circle({"mlxvlm.server.app": {"mlxvlm.generate.loop"}}) is None
    sideways = {"mlxvlm.models.qwen2_vl": {"mlxvlm.text.tokenization"}}
    assert upward_imports(sideways) == ["mlxvlm.models.qwen2_vl -> mlxvlm.text.tokenization"]
