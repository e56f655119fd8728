"""Keep torch out of mlxvlm's processes, even where torch is installed.

transformers decides once per process, on its first import, whether torch is available
(``is_torch_available()`` and its siblings are ``lru_cache``d probes of
``importlib.util.find_spec``), and then its modules import torch wherever it is: mlx-lm's
``__init__`` imports its tokenizer utilities, which import transformers' tokenizers,
configuration and RoPE utilities (``import torch``); processors, image and video
processors do the same. That costs seconds and hundreds of MB at start-up for nothing:
mlxvlm computes with MLX and asks processors for numpy arrays.

So mlxvlm (``process_setup``, as transformers is first imported) makes transformers'
probes answer "not installed": torch and its
companion packages are marked absent in ``sys.modules`` (``find_spec`` then returns None
and ``import`` fails) only while transformers is imported and its probes run, and are then
restored, so that the program itself can still ``import torch``. Acting at transformers'
own decision point covers every route through it (tokenizers, processors, image and video
processors, present and future) without listing its submodules; a meta-path blocker that
failed torch imports instead would break the modules that import torch once they believe
it installed.

If torch or transformers is already imported when mlxvlm is, the decision is the
program's and is left alone; so it is with ``MLXVLM_ALLOW_TORCH=1`` (a program that uses
transformers' torch models after importing mlxvlm, mlxvlm's parity tests).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys

TORCH_PACKAGES = ("torch", "torchvision", "torchaudio", "torchcodec")
_NO_ADVICE = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def applies() -> bool:
    """Whether transformers is still to be imported with torch looking absent: not when
    the program asked for torch (``MLXVLM_ALLOW_TORCH``) or imported it or transformers
    already."""
    if os.environ.get("MLXVLM_ALLOW_TORCH", "") not in ("", "0"):
        return False
    return "transformers" not in sys.modules and not any(
        sys.modules.get(p) for p in TORCH_PACKAGES)


@contextlib.contextmanager
def torch_hidden():
    """Around transformers' own first import (``process_setup`` runs it inside):
    torch looks absent while the import runs and then while every cached torch probe of
    transformers answers, so that a probe first run later cannot find torch."""
    hidden = [p for p in TORCH_PACKAGES if p not in sys.modules]
    for package in hidden:
        sys.modules[package] = None  # type: ignore[assignment]
    # transformers' advice "PyTorch was not found. Models won't be available" is for its
    # users, not mlxvlm's (mlx-lm's __init__ silences it the same way, just too late).
    advisory = os.environ.get(_NO_ADVICE)
    os.environ[_NO_ADVICE] = "1"
    try:
        yield
        from transformers.utils import import_utils

        for name, probe in vars(import_utils).items():
            if name.startswith("is_torch") and name.endswith("available") and callable(probe):
                if _takes_no_arguments(probe):
                    try:
                        probe()
                    except Exception:
                        pass
    finally:
        if advisory is None:
            del os.environ[_NO_ADVICE]
        else:
            os.environ[_NO_ADVICE] = advisory
        for package in hidden:
            if package in sys.modules and sys.modules[package] is None:
                del sys.modules[package]


def _takes_no_arguments(function) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)
