"""``import mlxvlm`` loads nothing and changes nothing; the process set-up MLX and
transformers need runs before their first import (``mlxvlm/process_setup.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(script: str, tmp_path, **env_extra) -> dict:
    """What ``script`` printed last (JSON), and under ``"stderr"`` what it wrote there."""
    env = {k: v for k, v in os.environ.items() if k != "MLXVLM_ALLOW_TORCH"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=REPO, **env_extra)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


def test_import_loads_nothing_and_builds_nothing(tmp_path):
    seen = run_python(
        "import json, os, sys\n"
        "environ = dict(os.environ)\n"
        "import mlxvlm\n"
        "heavy = [m for m in ('mlx.core', 'transformers', 'mlx_lm', 'numpy', 'PIL', 'torch')\n"
        "         if m in sys.modules]\n"
        "print(json.dumps({'heavy': heavy, 'environ_same': dict(os.environ) == environ,\n"
        "                  'version': mlxvlm.__version__}))\n",
        tmp_path,
    )
    assert seen == {"heavy": [], "environ_same": True, "version": "0.1.0", "stderr": ""}
    # the BLAS shim is compiled into the cache on MLX's first import, not on mlxvlm's
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="the OpenBLAS preload is for Linux")
def test_the_program_importing_mlx_after_mlxvlm_gets_the_set_up(tmp_path):
    seen = run_python(
        "import json, mlxvlm\n"
        "import mlx.core as mx\n"
        "from mlxvlm.cpu import blas\n"
        "from transformers.utils import import_utils\n"
        "print(json.dumps({'blas': blas.openblas_status, 'shim': blas.gemv_forward_status,\n"
        "                  'torch_seen': import_utils.is_torch_available()}))\n",
        tmp_path,
    )
    assert seen["blas"].startswith("loaded"), seen
    assert "sgemv" in seen["shim"], seen
    assert seen["torch_seen"] is False
    assert "imported after mlx.core" not in seen["stderr"]


def test_mlx_imported_first_is_left_alone_and_said(tmp_path):
    seen = run_python(
        "import json, mlx.core, mlxvlm\n"
        "from mlxvlm.cpu import blas\n"
        "print(json.dumps({'blas': blas.openblas_status}))\n",
        tmp_path,
    )
    expected = ("not used on macOS (Accelerate/Metal)" if sys.platform == "darwin"
                else "skipped: mlx.core was imported before mlxvlm")
    assert seen["blas"] == expected
    if sys.platform == "linux":  # said once, as a warning the script's author sees
        assert seen["stderr"].count("RuntimeWarning: mlxvlm was imported after mlx.core") == 1


def test_public_names_resolve_on_first_use(tmp_path):
    seen = run_python(
        "import json, mlxvlm\n"
        "import mlxvlm.generate.stream  # the subpackage named like the function\n"
        "import mlxvlm.batching\n"
        "names = {n: callable(getattr(mlxvlm, n)) for n in mlxvlm.__all__ if n != '__version__'}\n"
        "try:\n"
        "    mlxvlm.no_such_name\n"
        "    missing = None\n"
        "except AttributeError as exc:\n"
        "    missing = str(exc)\n"
        "print(json.dumps({'names': names, 'generate': type(mlxvlm.generate).__name__,\n"
        "                  'in_dir': sorted(set(mlxvlm.__all__) - set(dir(mlxvlm))),\n"
        "                  'missing': missing}))\n",
        tmp_path,
    )
    assert all(seen["names"].values()) and len(seen["names"]) >= 10, seen
    assert seen["generate"] == "function"
    assert seen["in_dir"] == []
    assert seen["missing"] == "module 'mlxvlm' has no attribute 'no_such_name'"


def test_transformers_runs_once_with_torch_hidden_and_the_finder_leaves(tmp_path):
    pytest.importorskip("torch")  # the point: torch is installed and importable
    env = {k: v for k, v in os.environ.items() if k != "MLXVLM_ALLOW_TORCH"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=REPO)
    script = (
        "import importlib.util, json, sys\n"
        "import mlxvlm\n"
        "importlib.util.find_spec('transformers')  # asks without importing\n"
        "import mlx.core, transformers\n"
        "from transformers.utils import import_utils\n"
        "from mlxvlm import process_setup\n"
        "print(json.dumps({'torch': 'torch' in sys.modules,\n"
        "                  'available': import_utils.is_torch_available(),\n"
        "                  'finder_left': not any(isinstance(f, process_setup._BeforeFirstImport)\n"
        "                                         for f in sys.meta_path)}))\n"
    )
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", script],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "torch": False, "available": False, "finder_left": True}
    # executed once (an import run twice shows twice in -X importtime), without the
    # advice transformers prints when it finds no torch
    executions = [line for line in out.stderr.splitlines()
                  if line.split("|")[-1].strip() == "transformers"]
    assert len(executions) == 1, executions
    assert "PyTorch was not found" not in out.stderr
