"""How hosts tell each other of invalidations (and of a master that restarted) through
Mooncake, the keys being :mod:`.keys`': learning the master's boot id, asking for the
markers past what this host knows in the same call as a lookup's blocks, and publishing
the marker that ends the epoch or a namespace's generation current now. Any thread that
holds a set-up client (the reader's, the writer's)."""

from __future__ import annotations

import functools
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .connection import Connection
from .keys import PROBE, Keys, leading_ones
from .native import import_store

T = TypeVar("T")
# A host far behind asks this many markers per counter a call (doubling distances first,
# up to 2**31 past, then as many points of the gap): 8 calls move it past any number.
_SPLIT = 32
_CATCH_UP_CALLS = 8
# Given the markers to ask for and the blocks' keys: whether each marker is there, and
# what the call brought for the blocks; None where Mooncake did not answer.
Ask = Callable[[list[str], list[list[str]]], "tuple[list[bool], T] | None"]


class Markers:
    """``errors``: the counters that a call answered with an error adds to
    (``remote_read_errors``; a call that failed for want of the master is the
    connection's to count); ``restarted``: called (on the thread that saw it) with the
    boot id that ended once the master is found to have restarted, after this host's
    view started again; ``learned``:
    called (on the thread that learned it) with the boot id of the master, the
    lifetime it starts, and whether the tier rested before (failed to reach a master)."""

    def __init__(self, keys: Keys, connection: Connection, errors: dict[str, float],
                 restarted: Callable[[str], None],
                 learned: Callable[[str, int, bool], None] | None = None) -> None:
        self.keys = keys
        self._connection = connection
        self._errors = errors
        self._restarted = restarted
        self._learned = learned
        self._learning = threading.Lock()

    def settle(self, client: Any, items: Sequence[tuple[str, Sequence[bytes]]],
               ask: Ask[T]) -> tuple[list[list[str]], T] | None:
        """Ask (``ask``) for the markers past what this host knows and for the items'
        blocks, in one call; move past the markers found and ask again (rarely), also
        after a restart of the master. The blocks' keys asked, per item, and what the
        call brought for them; None when Mooncake did not answer."""
        keys = self.keys
        for _ in range(8):  # each pass moves past at least one marker
            if keys.boot is None and not self._learn_boot(client):
                return None
            asked_at = time.monotonic()
            probes, asked, advance = keys.ask(items)
            answer = ask(probes, asked)
            if answer is None:
                return None
            present, brought = answer
            moved = advance([int(there) for there in present])
            if moved is None:  # the boot id's key is gone
                if not self._lost(client, probes[0]):
                    return None
                continue
            # Far behind: moving PROBE markers a pass, the passes would run out first, and
            # a master that answered would read as one that did not (an evict's marker
            # not out, a write dropped, a lookup missing).
            if moved.behind and not self._catch_up(client, probes[0], moved.behind):
                return None
            if moved.stale:
                continue
            keys.checked_at = asked_at
            return asked, brought
        return None

    def _catch_up(self, client: Any, alive: str, behind: Sequence[str | None]) -> bool:
        """Move past the newest markers of these counters (None: the epoch; else a
        namespace's generations), any number past what this host knows, in a few calls:
        each asks markers at doubling distances until one is absent, then ``_SPLIT``
        points between the last one there and the first one absent, until they are
        adjacent. A marker there means that every epoch (generation) up to it ended: a
        host publishes one only once it saw those before it there (:meth:`end`). This
        host moves past it only, never onto one it saw absent: settle's next pass asks
        for that one's marker in the same call as the blocks, as ever. The boot id's key
        (``alive``) goes with each call: once it is gone, so is what the markers told
        (settle's next pass sees to the restart). Whether Mooncake answered."""
        keys = self.keys
        lifetime = keys.view("")[0]
        marker_of: dict[str | None, Callable[[int], str]] = {
            c: keys.cleared if c is None else functools.partial(keys.evicted, c)
            for c in behind}
        # Per counter: the newest marker seen there, and the oldest seen absent past it.
        there = {c: keys.view(c or "")[1 if c is None else 2] - 1 for c in behind}
        absent: dict[str | None, int | None] = dict.fromkeys(behind)
        for _ in range(_CATCH_UP_CALLS):
            points = {c: _between(there[c], absent[c]) for c in behind}
            points = {c: p for c, p in points.items() if p}
            if not points:
                return True
            asked = [alive] + [marker_of[c](g) for c, p in points.items() for g in p]
            found = client.batch_is_exist(asked)
            if not self._connection.codes("batch_is_exist", found):
                return False
            if any(code < 0 for code in found):
                return self._refused()
            if found[0] != 1:
                return True
            at = 1
            for c, p in points.items():
                codes, at = found[at : at + len(p)], at + len(p)
                first = leading_ones(codes)
                if first:
                    there[c] = p[first - 1]
                    generation = there[c] + 1
                    if c is None:
                        keys.advance("", generation, 0, lifetime)
                    else:
                        keys.advance(c, 0, generation, lifetime)
                if first < len(p):
                    absent[c] = p[first]
        return True

    def _lost(self, client: Any, alive: str) -> bool:
        """The key of the boot id this host knows is not there: another host may still
        be putting it (a put answers at once where the key exists), or the master
        restarted. Mooncake's boot id tells: the same, or none or another. Whether
        Mooncake answered."""
        keys = self.keys
        boot = keys.boot
        if boot is None or alive != keys.alive(boot):
            return True  # another thread saw to it meanwhile
        there = int(client.is_exist(keys.boot_key()))
        if not self._connection.codes("is_exist", [there]):
            return False
        if there < 0:
            return self._refused()
        if there == 1:
            now = bytes(client.get(keys.boot_key())).decode(errors="replace")
            if not now:  # it is there: an error, not an answer
                return self._refused()
            if now == boot:
                rc = int(client.put(alive, b"1", _pinned()))
                if not self._connection.codes("put", [rc]):
                    return False
                if rc != 0:  # an answer all the same: asked again on the next pass
                    self._refused()
                return True
        if keys.restart(boot):  # none, or another host's since: a new master
            self._restarted(boot)
        return True

    def past(self, client: Any,
             items: Sequence[tuple[str, Sequence[bytes]]]) -> list[list[str]] | None:
        """:meth:`settle` with ``batch_is_exist``: per item, its leading keys that
        Mooncake has; None when Mooncake did not answer."""

        def exist(probes: list[str],
                  asked: list[list[str]]) -> tuple[list[bool], list[int]] | None:
            found = client.batch_is_exist(probes + [key for group in asked for key in group])
            if not self._connection.codes("batch_is_exist", found):
                return None
            if any(code < 0 for code in found):
                self._refused()
                return None
            return [code == 1 for code in found[: len(probes)]], found[len(probes) :]

        settled = self.settle(client, items, exist)
        if settled is None:
            return None
        asked, found = settled
        answers, at = [], 0
        for group in asked:
            answers.append(group[: leading_ones(found[at : at + len(group)])])
            at += len(group)
        return answers

    def _learn_boot(self, client: Any) -> bool:
        """Put a boot id (a put keeps the first: the first host's stays), read back the
        one Mooncake holds, and put the key whose absence tells of a restart."""
        keys = self.keys
        with self._learning:  # once for the reader and the writer
            if keys.boot is not None:
                return True
            rc = int(client.put(keys.boot_key(), secrets.token_hex(8).encode(), _pinned()))
            if not self._connection.codes("put", [rc]):
                return False
            if rc != 0:
                return self._refused()
            boot = bytes(client.get(keys.boot_key())).decode(errors="replace")
            if not boot:  # not there yet (another host's put under way), or gone again
                return False
            rc = int(client.put(keys.alive(boot), b"1", _pinned()))
            if not self._connection.codes("put", [rc]):
                return False
            if rc != 0:
                return self._refused()
            if self._learned is not None:  # first: a read goes on once the id is known
                self._learned(boot, keys.lifetime, self._connection.rested)
            keys.learned(boot)
            return True

    def end(self, client: Any, ns: str | None) -> str | None:
        """End the epoch (``ns`` None) or the namespace's generation that is current now:
        other hosts may have ended the one this host knows, so the first one whose
        marker is absent is found first; then publish its marker and move this host past
        it. The pattern of the blocks that ended (to remove), or None where the marker
        is not in Mooncake. The caller has asked for the markers just before
        (:meth:`past`), so that a restart of the master is seen first."""
        keys = self.keys
        lifetime, epoch, generation = keys.view(ns or "")
        marker_of: Callable[[int], str] = (
            keys.cleared if ns is None else lambda g: keys.evicted(ns, g))
        current = self._first_absent(client, marker_of, epoch if ns is None else generation)
        if current is None:
            return None
        # Another host may publish it meanwhile: a put keeps the first value (code 0),
        # and both meant to end what was current when they began.
        rc = int(client.put(marker_of(current), b"1", _pinned()))
        if not self._connection.codes("put", [rc]):
            return None
        if rc != 0:
            self._refused()
            return None
        if ns is None:
            keys.advance("", current + 1, 0, lifetime)
            return keys.epoch_pattern(current)
        keys.advance(ns, 0, current + 1, lifetime)
        return keys.generation_pattern(ns, current)

    def _first_absent(self, client: Any, marker_of: Callable[[int], str],
                      start: int) -> int | None:
        """The first epoch or generation from ``start`` on whose marker (``marker_of``)
        Mooncake lacks: the current one; None when Mooncake did not answer."""
        count = PROBE
        while True:
            found = client.batch_is_exist([marker_of(start + i) for i in range(count)])
            if not self._connection.codes("batch_is_exist", found):
                return None
            if any(code < 0 for code in found):
                self._refused()
                return None
            present = leading_ones(found)
            if present < count:
                return start + present
            start, count = start + count, count * 2  # far behind: larger steps

    def _refused(self) -> bool:
        """Mooncake answered a call with an error: counted (once for the reader thread's
        call, and not where a waiter counted its timeout: :meth:`Connection.refused`);
        False (the call's outcome)."""
        if self._connection.refused():
            self._errors["remote_read_errors"] += 1
        return False


def _between(there: int, absent: int | None) -> list[int]:
    """The epochs (generations) to ask for next between the newest marker seen there and
    the oldest seen absent (None: none yet), ascending; none once adjacent."""
    if absent is None:
        return [there + (1 << i) for i in range(_SPLIT)]
    gap = absent - there
    return sorted({there + -(-gap * k // _SPLIT) for k in range(1, _SPLIT)} - {absent})


def _pinned() -> Any:
    """A put's config for the tier's own records: they must outlive Mooncake's LRU."""
    config = import_store().ReplicateConfig()
    config.with_hard_pin = True
    return config
