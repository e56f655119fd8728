"""mlxvlm/cpu/policy.py is the one reader of the CPU backend's ``MLXVLM_*`` settings
(docs/architecture.md, "The CPU backend's door"): no other Python module reads one from
the environment, and no C or C++ source under mlxvlm/ calls ``getenv`` at all (the
kernels and the BLAS shim are handed their values). A few ``MLXVLM_*`` settings are not
the backend's (the server's key, the vision feature cache, torch at run time): each has
one named reader, listed below, so that a new reader anywhere else fails here.

The check reads the sources: a Python file reads an ``MLXVLM_*`` variable when it looks
one up in ``os.environ`` or through ``getenv``, named as a string, a constant of the
module or one of policy.py's constants."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from mlxvlm.cpu import policy

PACKAGE = Path(__file__).resolve().parent.parent / "mlxvlm"
POLICY = PACKAGE / "cpu" / "policy.py"
SETTING = re.compile(r"MLXVLM_[A-Z0-9_]+")
C_ENVIRONMENT = re.compile(r"\b(secure_getenv|getenv|environ)\b")

# The settings that are not the CPU backend's, each with the one module that reads it.
OTHER_SETTINGS = {
    "MLXVLM_API_KEY": "server/config.py",
    "MLXVLM_FEATURE_CACHE_GB": "models/feature_cache.py",
    "MLXVLM_ALLOW_TORCH": "torch_free.py",
}

# policy.py's names for the backend's variables (NO_KERNELS_ENV, ...), as other modules
# would refer to them.
POLICY_NAMES = {name for name, value in vars(policy).items()
                if isinstance(value, str) and SETTING.fullmatch(value)}


def _environment(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ`` (``from os import environ``)."""
    return (isinstance(node, ast.Attribute) and node.attr in ("environ", "environb")) or \
        (isinstance(node, ast.Name) and node.id in ("environ", "environb"))


def _read_names(node: ast.AST) -> list[ast.AST]:
    """The expressions an environment read names: ``os.environ.get(X)``,
    ``os.environ.pop(X)``, ``os.getenv(X)``, ``os.environ[X]``, ``X in os.environ``."""
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") \
                and _environment(func.value):
            return [node.args[0]]
        if (isinstance(func, ast.Attribute) and func.attr == "getenv") or \
                (isinstance(func, ast.Name) and func.id == "getenv"):
            return [node.args[0]]
    if isinstance(node, ast.Subscript) and _environment(node.value):
        return [node.slice]
    if isinstance(node, ast.Compare) and any(_environment(c) for c in node.comparators):
        return [node.left]
    return []


def python_settings_read(source: str) -> set[str]:
    """The MLXVLM_* variables a Python source reads from the environment: named as a
    string, a string constant of the module, or one of policy.py's constants."""
    tree = ast.parse(source)
    constants = {target.id: node.value.value for node in ast.walk(tree)
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                 and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}
    read: set[str] = set()
    for node in ast.walk(tree):
        for name in _read_names(node):
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                value = name.value
            elif isinstance(name, ast.Name):
                value = constants.get(name.id) or getattr(policy, name.id, None) \
                    if name.id in constants or name.id in POLICY_NAMES else None
            elif isinstance(name, ast.Attribute) and name.attr in POLICY_NAMES:
                value = getattr(policy, name.attr)
            else:
                continue
            if isinstance(value, str) and SETTING.fullmatch(value):
                read.add(value)
    return read


def c_reads_environment(source: str) -> bool:
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", source, flags=re.S)  # comments may name it
    return C_ENVIRONMENT.search(code) is not None


def test_only_policy_reads_the_backend_settings():
    readers: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        read = python_settings_read(path.read_text())
        if read and path != POLICY:
            readers[path.relative_to(PACKAGE).as_posix()] = read
    expected: dict[str, set[str]] = {}
    for setting, reader in OTHER_SETTINGS.items():
        expected.setdefault(reader, set()).add(setting)
    assert readers == expected, (
        "only mlxvlm/cpu/policy.py reads MLXVLM_* settings (besides OTHER_SETTINGS); "
        f"found {readers}")


def test_every_backend_setting_is_policys_and_documented():
    """docs/cpu-backend.md's table of settings names policy.py's variables, and only
    those and the feature cache's."""
    page = (PACKAGE.parent / "docs" / "cpu-backend.md").read_text()
    table = {m.group(1) for m in re.finditer(r"^\| `(MLXVLM_[A-Z0-9_]+)", page, re.M)}
    backend = {getattr(policy, name) for name in POLICY_NAMES}
    assert backend <= table, f"undocumented: {backend - table}"
    assert table - backend <= set(OTHER_SETTINGS), f"not policy.py's: {table - backend}"


def test_no_c_source_reads_the_environment():
    sources = [p for ext in ("*.c", "*.cpp", "*.h") for p in PACKAGE.rglob(ext)]
    assert any(p.name == "vector_math.h" for p in sources)  # the kernels are where we look
    readers = [p.relative_to(PACKAGE).as_posix() for p in sources
               if c_reads_environment(p.read_text())]
    assert readers == [], f"C/C++ sources reading the environment (use policy.py): {readers}"


@pytest.mark.parametrize("source, read", [
    ('import os\nos.environ.get("MLXVLM_X", "")', {"MLXVLM_X"}),
    ('from os import getenv\nNAME = "MLXVLM_Y"\ngetenv(NAME)', {"MLXVLM_Y"}),
    ('import os\nfrom mlxvlm.cpu import policy\nos.environ[policy.NO_KERNELS_ENV]',
     {policy.NO_KERNELS_ENV}),
    ('"""Set MLXVLM_X to opt out."""\nimport os\nos.environ.get("CC")', set()),
    ('ENV = "MLXVLM_X"  # named, not read', set()),
    ('import os\nfrom mlxvlm.cpu import policy\nstatus = f"disabled by {policy.NO_KERNELS_ENV}"',
     set()),
    ('from os import environ\nif "MLXVLM_Z" in environ: pass', {"MLXVLM_Z"}),
])
def test_python_check_sees_reads(source, read):
    assert python_settings_read(source) == read


@pytest.mark.parametrize("source, reads", [
    ('const char* v = std::getenv("MLXVLM_HALF_GEMM");', True),
    ('if (const char* v = secure_getenv("X")) {}', True),
    ('// once read with getenv, now set from Python\nint x = 0;', False),
])
def test_c_check_sees_reads(source, reads):
    assert c_reads_environment(source) == reads
