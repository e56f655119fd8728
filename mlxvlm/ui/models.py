"""The models the chat offers, loaded when chosen: at most ``max_loaded`` at a time
(default one), the least recently used unloaded first once no answer is using it.

The chat's own small registry (the server keeps its own): a name is the ``--model``
spelling (a path or a Hub repo id), or a checkpoint folder found under ``--models-dir``.
"""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import mlx.core as mx

from mlxvlm.errors import MlxvlmError

if TYPE_CHECKING:  # not at run time: the command line loads a model before Gradio
    from mlxvlm.ui.session import ChatSession

# name -> a started ChatSession for it (loads the model)
OpenSession = Callable[[str], "ChatSession"]


class ModelRegistry:
    """The offered ``names`` (the first is the one the page starts with); ``use(name)``
    gives that model's session, loading it (and unloading another) if needed."""

    def __init__(self, names: Sequence[str], open_session: OpenSession, max_loaded: int = 1):
        if not names:
            raise MlxvlmError("give at least one --model (or --models-dir)")
        self.names = list(dict.fromkeys(names))
        self.open_session = open_session
        self.max_loaded = max(1, max_loaded)
        self._loaded: OrderedDict[str, ChatSession] = OrderedDict()
        self._users: dict[str, int] = {}
        self._changed = threading.Condition()

    @classmethod
    def of_session(cls, session: ChatSession) -> "ModelRegistry":
        """A registry of one model, already loaded."""

        def cannot_reopen(name: str) -> ChatSession:
            raise MlxvlmError(f"{name} was closed")

        registry = cls([session.model_name], cannot_reopen)
        registry._loaded[session.model_name] = session
        return registry

    @property
    def loaded(self) -> list[str]:
        with self._changed:
            return list(self._loaded)

    def _unload_one(self) -> bool:
        """Unload the least recently used model no answer is using (False: none is free)."""
        free = next((name for name in self._loaded if not self._users.get(name)), None)
        if free is None:
            return False
        self._loaded.pop(free).close()
        # The model's arrays go with the last reference to it, which may sit in a cycle.
        gc.collect()
        mx.clear_cache()
        return True

    def _session(self, name: str) -> ChatSession:
        if name not in self.names:
            raise MlxvlmError(f"{name!r} is not one of this chat's models")
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return self._loaded[name]
        while len(self._loaded) >= self.max_loaded:
            if not self._unload_one():
                self._changed.wait()  # until an answer on a loaded model ends
        # Under the lock: one load at a time, and no answer starts on a half-swapped set.
        self._loaded[name] = session = self.open_session(name)
        return session

    @contextmanager
    def use(self, name: str) -> Iterator[ChatSession]:
        """``name``'s session, kept loaded until the block ends."""
        with self._changed:
            session = self._session(name)
            self._users[name] = self._users.get(name, 0) + 1
        try:
            yield session
        finally:
            with self._changed:
                self._users[name] -= 1
                self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            for session in self._loaded.values():
                session.close()
            self._loaded.clear()
