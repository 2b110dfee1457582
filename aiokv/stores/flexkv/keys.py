"""Evict for FlexKV, which has no such API: key generations and the adapter's own records.

FlexKV hashes a request's namespace into its block-hash chain and offers no way to drop
the blocks of one namespace. So :class:`KeyGenerations` remaps an evicted key: from the
evict on, the adapter asks FlexKV for the key's namespace with a generation suffix
(``aiokv-gen:<instance>:<n>``), whose hashes match none of the old blocks. The old
blocks are never matched again and age out by FlexKV's LRU. The tokens an evict
reports come from the adapter's records: what its puts of the key wrote successfully
since the key's last evict (or the last clear).

What that cannot do:

- Free space: the old blocks stay in FlexKV's CPU (and SSD) tiers until its LRU takes
  them; until then they take room from new puts.
- Count exactly: the count is what this adapter wrote, including blocks FlexKV's LRU
  has already dropped, and none that another FlexKV client (or an earlier process)
  wrote under the same namespace.
- Outlive the process: the generation map lives in this adapter's memory. A new adapter
  (a restart of the serving process or of aiokv's store process) maps every key back to
  its plain namespace: had FlexKV's cache outlived the adapter (a FlexKV shared with
  another process), KV evicted under the plain namespace would be matched again. Each
  instance's suffixes are its own (a random instance tag), so no other generation comes
  back.
- Reach other clients: a FlexKV client that is not this adapter (recsys-examples'
  backend on the same FlexKV) still matches the old blocks under the plain namespace,
  and no longer shares the evicted key's new blocks with this adapter.
- Take back a match made before the evict: a lookup reservation (get_match) of the old
  generation still loads the old KV if launched (the engine gives such reservations back
  before it evicts), and a put of the old generation in flight completes into it.

The map keeps one entry per key ever evicted (until a clear, which resets FlexKV and so
lets every key go back to its plain namespace).

A clear whose reset failed (FlexKV 34ab141's ``reset_cache`` raises before it drops
anything: its task table is an ``expiring_dict.ExpiringDict`` built with keyword
arguments that the version FlexKV pins, expiring-dict 1.1.2, stores as two entries, and
counting in-flight tasks trips on them) moves every key at once to a new generation
instead (:meth:`KeyGenerations.clear` with ``reset=False``): the old KV is never matched
again, as after an evict, and keeps its space until FlexKV's LRU takes it.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterable, Sequence

Key = tuple[str, ...]


class KeyGenerations:
    """Per key: its generation suffix (after an evict) and the tokens its puts wrote."""

    def __init__(self) -> None:
        self._tag = secrets.token_hex(4)  # this instance's: no other instance reuses a suffix
        self._counter = itertools.count(1)
        self._suffix: dict[Key, str] = {}  # evicted keys -> their current generation
        self._every_key: str | None = None  # every other key's, after a clear without reset
        self._written: dict[Key, int] = {}  # tokens written by successful puts, per key
        self._puts: dict[int, tuple[Key, str | None, int]] = {}  # put id -> key, suffix, tokens

    def namespace(self, namespace: Sequence[str]) -> list[str]:
        """The namespace to ask FlexKV for: the key's, with its generation suffix."""
        suffix = self._generation(tuple(namespace))
        return list(namespace) if suffix is None else [*namespace, suffix]

    def put_matched(self, task_id: int, namespace: Sequence[str], tokens: int) -> None:
        """A put of the key that will write ``tokens`` tokens if it succeeds."""
        key = tuple(namespace)
        self._puts[task_id] = (key, self._generation(key), tokens)

    def put_ended(self, task_id: int, succeeded: bool) -> None:
        """A put's terminal answer: its tokens count for its key unless it failed or was
        written into a generation that an evict has left since."""
        put = self._puts.pop(task_id, None)
        if put is None or not succeeded:
            return
        key, suffix, tokens = put
        if self._generation(key) == suffix:
            self._written[key] = self._written.get(key, 0) + tokens

    def forget(self, task_ids: Iterable[int]) -> None:
        """Puts rolled back (cancelled) before they wrote anything."""
        for task_id in task_ids:
            self._puts.pop(task_id, None)

    def evict(self, namespace: Sequence[str]) -> int:
        """Move the key to a new generation; the tokens recorded for it."""
        key = tuple(namespace)
        self._suffix[key] = self._new_generation()
        return self._written.pop(key, 0)

    def clear(self, reset: bool = True) -> int:
        """The tokens recorded for every key. ``reset``: FlexKV dropped everything, so
        every key goes back to its plain namespace; otherwise every key moves to one new
        generation (the old blocks are still there, and must not be matched)."""
        dropped = sum(self._written.values())
        self._written.clear()
        self._suffix.clear()
        self._every_key = None if reset else self._new_generation()
        return dropped

    def _generation(self, key: Key) -> str | None:
        """The key's current generation suffix (None: its plain namespace)."""
        return self._suffix.get(key, self._every_key)

    def _new_generation(self) -> str:
        return f"aiokv-gen:{self._tag}:{next(self._counter)}"
