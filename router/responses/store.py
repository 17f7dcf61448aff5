"""The Responses API's stored responses: what `previous_response_id` continues and
`GET /v1/responses/{id}` reads back.

Bounded twice: at most `capacity` responses (the oldest dropped first) and each readable for
`ttl` seconds. Every response belongs to the API key that created it (a digest of the bearer
token, whatever it is, also where the router checks no keys): another key reads it as
absent, exactly as an id that never existed, so one tenant cannot learn of another's ids.
Kept in the router's memory: a router restarted, or a second replica, does not have them.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.completions.protocol import ChatMessage


@dataclass(frozen=True)
class Stored:
    """One response as created: its body, and the conversation a follow-up continues (the
    inputs of every turn before, then this turn's input and output, as chat messages;
    instructions not included: a follow-up gives its own, as OpenAI's API has it)."""

    body: dict[str, Any]
    conversation: tuple[ChatMessage, ...]


def tenant(bearer_token: str | None) -> bytes:
    """Whose responses a request may read: its API key's digest (no key: one shared tenant)."""
    return hashlib.sha256((bearer_token or "").encode()).digest()


class ResponseStore:
    def __init__(
        self, capacity: int = 1024, ttl: float = 3600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self.clock = clock
        # (tenant, id) -> (expiry, stored), oldest first
        self._items: OrderedDict[tuple[bytes, str], tuple[float, Stored]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def put(self, owner: bytes, response_id: str, stored: Stored) -> None:
        if self.capacity == 0:
            return
        self._expire()
        self._items[(owner, response_id)] = (self.clock() + self.ttl, stored)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, owner: bytes, response_id: str) -> Stored | None:
        """The response, if this tenant stored it and it has not expired or been dropped."""
        self._expire()
        found = self._items.get((owner, response_id))
        return None if found is None else found[1]

    def delete(self, owner: bytes, response_id: str) -> bool:
        self._expire()
        return self._items.pop((owner, response_id), None) is not None

    def _expire(self) -> None:
        """Drop the expired responses; all are stored with the same ttl, so they are the
        oldest ones."""
        now = self.clock()
        while self._items:
            key, (expiry, _) = next(iter(self._items.items()))
            if expiry > now:
                break
            del self._items[key]
