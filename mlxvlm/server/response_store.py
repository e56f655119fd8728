"""The Responses API's store of answered conversations, which ``previous_response_id``
continues.

Each conversation is kept under the API key (namespace) that made it and is bounded three
ways: per key in count (``max_items``) and in bytes (``max_key_bytes``), and for all keys
together in bytes (``max_total_bytes``). A key's own least recently used conversations
make room for its new one, never another key's: a conversation that cannot fit that way is
not kept (its response says ``store: false``), and /metrics counts both.

What is kept is what a continuation needs: the messages as the chat template takes them
(texts, image URLs as sent, tool calls; not the instructions, the options or the
reasoning), with each image or long text once per key however many of the key's
conversations hold it (a conversation continued, or sent again whole). Images stay as
their data URLs: decoding the base64 to keep a quarter fewer bytes would cost a fifth of
a second per 20 MiB on the event loop, and as much again for each continuation. Sizes
are estimates of the Python objects kept (``sys.getsizeof``), a shared value charged
once.
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from typing import Any

logger = logging.getLogger("mlxvlm.server")

Conversation = list[dict[str, Any]]

# Strings at least this long are kept once per key (and charged once).
POOLED_CHARS = 1024
# What a kept conversation costs beyond its messages: its id, its place in the index.
ENTRY_BYTES = 256


class _Compacted:
    """One conversation in its kept form, with what it costs apart from the pooled values
    (``own_bytes``) and the pooled values it holds (``pooled``: value -> its size)."""

    def __init__(self, pool: dict[Any, list]):
        self._pool = pool
        self.own_bytes = ENTRY_BYTES
        self.pooled: dict[Any, int] = {}

    def value(self, value: Any) -> Any:
        if isinstance(value, dict):
            self.own_bytes += sys.getsizeof(value)
            return {key: self.value(item) for key, item in value.items()}
        if isinstance(value, list):
            self.own_bytes += sys.getsizeof(value)
            return [self.value(item) for item in value]
        if isinstance(value, str) and len(value) >= POOLED_CHARS:
            return self._shared(value)
        self.own_bytes += sys.getsizeof(value)
        return value

    def _shared(self, value: Any) -> Any:
        """The key's one copy of ``value`` (this one where the key holds none)."""
        held = self._pool.get(value)
        if held is not None:
            value = held[0]
        self.pooled.setdefault(value, sys.getsizeof(value))
        return value


class _KeyShelf:
    """One key's conversations, least recently used first, and its pooled values (value
    -> [the value, how many conversations hold it])."""

    def __init__(self) -> None:
        self.entries: OrderedDict[str, tuple[Conversation, _Compacted]] = OrderedDict()
        self.pool: dict[Any, list] = {}
        self.bytes = 0

    def cost(self, kept: _Compacted) -> int:
        """Bytes that adding ``kept`` would add."""
        return kept.own_bytes + sum(size for value, size in kept.pooled.items()
                                    if value not in self.pool)

    def add(self, response_id: str, conversation: Conversation, kept: _Compacted) -> int:
        added = self.cost(kept)
        for value in kept.pooled:
            held = self.pool.setdefault(value, [value, 0])
            held[1] += 1
        self.entries[response_id] = (conversation, kept)
        self.bytes += added
        return added

    def drop_oldest(self) -> int:
        """Forget the least recently used conversation; the bytes freed."""
        _, (_, kept) = self.entries.popitem(last=False)
        freed = kept.own_bytes
        for value, size in kept.pooled.items():
            held = self.pool[value]
            held[1] -= 1
            if not held[1]:
                del self.pool[value]
                freed += size
        self.bytes -= freed
        return freed


class ResponseStore:
    """Answered conversations by (namespace, response id); see the module's docstring
    for the bounds."""

    def __init__(self, max_items: int, max_key_bytes: int, max_total_bytes: int):
        self.max_items = max_items
        self.max_key_bytes = max_key_bytes
        self.max_total_bytes = max_total_bytes
        self.bytes = 0
        self.evicted = 0  # dropped to make room for a newer one of the same key
        self.refused = 0  # not kept: it did not fit
        self._shelves: dict[str | None, _KeyShelf] = {}

    def get(self, namespace: str | None, response_id: str) -> Conversation | None:
        """The kept conversation, or None."""
        shelf = self._shelves.get(namespace)
        if shelf is None or response_id not in shelf.entries:
            return None
        shelf.entries.move_to_end(response_id)
        return shelf.entries[response_id][0]

    def put(self, namespace: str | None, response_id: str, conversation: Conversation) -> bool:
        """Keep ``conversation`` (messages, or a kept conversation extended), making room
        among the key's own; False when it is not kept."""
        if self.max_items == 0:
            return False
        shelf = self._shelves.get(namespace) or _KeyShelf()
        kept = _Compacted(shelf.pool)
        compact = kept.value(conversation)
        alone = kept.own_bytes + sum(kept.pooled.values())
        room = min(self.max_key_bytes, self.max_total_bytes - (self.bytes - shelf.bytes))
        if alone > room:
            self.refused += 1
            logger.warning(
                "response %s not stored: its conversation (~%.1f MiB) does not fit the %s "
                "(%.1f MiB free for its key%s)", response_id, alone / 2**20,
                "--max-stored-response-bytes" if room == self.max_key_bytes else
                "--max-total-stored-response-bytes", room / 2**20,
                "" if room == self.max_key_bytes else ", the other keys' stay")
            return False
        while shelf.entries and (len(shelf.entries) >= self.max_items
                                 or shelf.bytes + shelf.cost(kept) > self.max_key_bytes
                                 or self.bytes + shelf.cost(kept) > self.max_total_bytes):
            self.bytes -= shelf.drop_oldest()
            self.evicted += 1
        self.bytes += shelf.add(response_id, compact, kept)
        self._shelves[namespace] = shelf
        return True

    def __len__(self) -> int:
        return sum(len(shelf.entries) for shelf in self._shelves.values())
