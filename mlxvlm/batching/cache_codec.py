"""A prompt-cache entry as safetensors tensors and a JSON layout, and back.

What an entry holds is a small tree: layer caches (mlx-lm's ``KVCache``,
``RotatingKVCache``, ``ArraysCache`` for recurrent and convolution states, mlxvlm's
``CrossAttentionCache``), the family's prompt state (a dataclass such as ``MRopeState``
with its DeepStack vision features), state snapshots (dicts by length), the key (a
numpy array). ``encode`` walks it: every array becomes a named tensor and the rest a
JSON layout naming the tensors; ``decode`` rebuilds it.

Layer caches go through mlx-lm's own cache protocol (``state`` and ``from_state``, what
``mlx_lm.models.cache.save_prompt_cache`` uses). That helper itself does not fit: an
entry is one file holding more than the layer caches, and ``load_prompt_cache`` resolves
class names among its module's globals, which knows no cache class of mlxvlm's.

A layout read back from a file names classes; ``decode`` builds only classes of modules
already imported, that are dataclasses of mlxvlm's or layer caches of mlx-lm's or
mlxvlm's, so that a file cannot make it build anything else.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

# Modules whose classes a layout may name.
_CACHE_MODULES = ("mlx_lm.models.cache",)
_OWN_PREFIX = "mlxvlm."


class NotStorable(Exception):
    """A value the codec has no form for (the entry is then kept in memory only)."""


class BadLayout(Exception):
    """A layout that does not describe a value this codec wrote."""


def encode(value: Any) -> tuple[Any, dict[str, mx.array]]:
    """``(layout, tensors)``: ``layout`` is JSON-serializable."""
    tensors: dict[str, mx.array] = {}
    return _encode(value, tensors), tensors


def decode(layout: Any, tensors: dict[str, mx.array]) -> Any:
    """The value ``encode`` gave ``layout`` for. Raises ``BadLayout``."""
    try:
        return _decode(layout, tensors)
    except BadLayout:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise BadLayout(f"{type(e).__name__}: {e}") from e


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _is_layer_cache(value: Any) -> bool:
    cls = type(value)
    return (hasattr(cls, "from_state") and isinstance(getattr(cls, "state", None), property)
            and (cls.__module__ in _CACHE_MODULES or cls.__module__.startswith(_OWN_PREFIX)))


def _add(tensors: dict[str, mx.array], array: mx.array) -> str:
    name = f"t{len(tensors)}"
    tensors[name] = array
    return name


def _encode(value: Any, tensors: dict[str, mx.array]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return ["lit", value]
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return ["lit", value.item()]
    if isinstance(value, mx.array):
        return ["mx", _add(tensors, value)]
    if isinstance(value, np.ndarray):
        # As raw bytes: any numpy dtype (float64 included, which MLX would narrow).
        data = np.ascontiguousarray(value)
        return ["np", _add(tensors, mx.array(data.reshape(-1).view(np.uint8))),
                data.dtype.str, list(data.shape)]
    if isinstance(value, (list, tuple)):
        return ["list" if isinstance(value, list) else "tuple",
                [_encode(item, tensors) for item in value]]
    if isinstance(value, dict):
        return ["dict", [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]]
    if _is_layer_cache(value):
        state = value.state
        if type(value) is KVCache and value.keys is not None:
            # Its buffers run past its tokens (grown in steps): keep only the tokens.
            n = value.offset
            state = (value.keys[..., :n, :], value.values[..., :n, :], n)
        return ["cache", _class_name(type(value)), _encode(state, tensors)]
    if dataclasses.is_dataclass(value) and type(value).__module__.startswith(_OWN_PREFIX):
        fields = {f.name: _encode(getattr(value, f.name), tensors)
                  for f in dataclasses.fields(value) if f.init}
        return ["dataclass", _class_name(type(value)), fields]
    raise NotStorable(f"no stored form for a {type(value).__name__}")


def _known_class(name: str) -> type:
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)  # never imports: only what already runs
    if module is None or not (module_name in _CACHE_MODULES
                              or module_name.startswith(_OWN_PREFIX)):
        raise BadLayout(f"unknown class {name!r}")
    cls: Any = module
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if not isinstance(cls, type):
        raise BadLayout(f"unknown class {name!r}")
    return cls


def _decode(node: Any, tensors: dict[str, mx.array]) -> Any:
    if not isinstance(node, list) or not node:
        raise BadLayout("malformed node")
    kind = node[0]
    if kind == "lit":
        if node[1] is not None and not isinstance(node[1], (bool, int, float, str)):
            raise BadLayout("malformed literal")
        return node[1]
    if kind == "mx":
        return tensors[node[1]]
    if kind == "np":
        raw = np.array(tensors[node[1]], copy=True)
        if raw.dtype != np.uint8:
            raise BadLayout("a numpy array not stored as bytes")
        return raw.view(np.dtype(node[2])).reshape(node[3])
    if kind in ("list", "tuple"):
        items = [_decode(item, tensors) for item in node[1]]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in node[1]}
    if kind == "cache":
        cls = _known_class(node[1])
        if not hasattr(cls, "from_state") or not isinstance(getattr(cls, "state", None), property):
            raise BadLayout(f"{node[1]} is not a layer cache")
        return cls.from_state(_decode(node[2], tensors))
    if kind == "dataclass":
        cls = _known_class(node[1])
        if not dataclasses.is_dataclass(cls):
            raise BadLayout(f"{node[1]} is not a dataclass")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        if set(node[2]) != names:
            raise BadLayout(f"{node[1]}'s fields differ")
        return cls(**{name: _decode(field, tensors) for name, field in node[2].items()})
    raise BadLayout(f"unknown node kind {kind!r}")


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict)) or isinstance(key, (mx.array, np.ndarray)):
        raise BadLayout("an unhashable dict key")
    return key
