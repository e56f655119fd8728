"""What mlxvlm does to its process before MLX and transformers first load, deferred until
then so that ``import mlxvlm`` is cheap and changes nothing.

Two things must happen before a library loads, not at some later call:
- before ``mlx.core``: the CPU backend's BLAS (``cpu.startup.before_mlx``). Python loads
  extension modules with ``RTLD_NOW``, so libmlx binds ``cblas_sgemm`` as it loads; an
  OpenBLAS loaded afterwards is never called.
- around ``transformers``' own import: torch hidden while it runs and its torch probes
  answer (``torch_free``).

``install`` puts a finder first on ``sys.meta_path``. The first time either name is
imported (by mlxvlm's own modules on the first ``mlxvlm.load``, or by the program) it
runs the step for MLX, or hands back transformers' own spec with its loader wrapped, so
that the module is still executed once, by the import system; it leaves once both have
run. A library the program imported before mlxvlm is past helping: its step runs at
once and records why it did nothing (``cpu.blas.openblas_status``).
"""

from __future__ import annotations

import importlib.machinery
import sys


def _before_mlx(name: str, path, finder) -> tuple[None, bool]:
    from mlxvlm import mlx_threads
    from mlxvlm.cpu import startup

    startup.before_mlx()
    mlx_threads.clear_main_thread_streams_at_exit()
    return None, True


class _TorchHiddenLoader:
    """transformers' own loader, its module executed inside ``torch_free.torch_hidden``."""

    def __init__(self, loader, finder: "_BeforeFirstImport") -> None:
        self.loader = loader
        self.finder = finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        from mlxvlm import torch_free

        with torch_free.torch_hidden():
            self.loader.exec_module(module)
        self.finder.done("transformers")

    def __getattr__(self, name):  # get_resource_reader, is_package, get_code...
        return getattr(self.loader, name)


def _around_transformers(name: str, path, finder: "_BeforeFirstImport"):
    """transformers' spec with its loader wrapped; done only once transformers is loaded,
    since ``importlib.util.find_spec`` asks too, without importing."""
    from mlxvlm import torch_free

    if not torch_free.applies():
        return None, True
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is not None and spec.loader is not None:
        spec.loader = _TorchHiddenLoader(spec.loader, finder)
    return spec, False


# import name -> the step for it: returns the spec to import it by (None: let the other
# finders find it) and whether the step is done
STEPS = {"mlx.core": _before_mlx, "transformers": _around_transformers}


class _BeforeFirstImport:
    """A meta-path finder (``find_spec`` is all the import system asks of one)."""

    def __init__(self) -> None:
        self.pending = dict(STEPS)

    def find_spec(self, name, path=None, target=None):
        step = self.pending.get(name)
        if step is None:
            return None
        spec, done = step(name, path, self)
        if done:
            self.done(name)
        return spec

    def done(self, name: str) -> None:
        self.pending.pop(name, None)
        if not self.pending:
            _remove(self)


def _remove(finder: _BeforeFirstImport) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def install() -> None:
    """Run each step now if its library is loaded already, else before it loads."""
    if any(isinstance(f, _BeforeFirstImport) for f in sys.meta_path):
        return
    finder = _BeforeFirstImport()
    if "mlx.core" in sys.modules:
        finder.pending.pop("mlx.core")(None, None, finder)  # says that it came too late
    if "transformers" in sys.modules:
        del finder.pending["transformers"]
    if finder.pending:
        sys.meta_path.insert(0, finder)
