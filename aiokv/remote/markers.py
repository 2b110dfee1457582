"""How hosts tell each other of invalidations through Mooncake (the keys are
:mod:`.keys`'): asking for the markers past what this host knows, and publishing the
marker that ends the epoch or a namespace's generation current now. Any thread that
holds a set-up client (the reader's, the writer's)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .connection import Connection
from .keys import PROBE, Keys, leading_ones
from .native import import_store


class Markers:
    """``errors``: the counters that a call answered with an error adds to
    (``remote_read_errors``)."""

    def __init__(self, keys: Keys, connection: Connection, errors: dict[str, float]) -> None:
        self.keys = keys
        self._connection = connection
        self._errors = errors

    def past(self, client: Any,
             items: Sequence[tuple[str, list[bytes]]]) -> list[list[str]] | None:
        """Ask for the markers past what this host knows of the epoch and of each
        namespace's generation, and for the items' blocks, in one call; move past the
        markers found and ask again (rarely). Per item, its leading present keys; None
        when Mooncake did not answer."""
        for _ in range(8):  # each pass moves past at least one marker
            probes, asked, advance = self.keys.ask(items)
            found = client.batch_is_exist(probes + [key for group in asked for key in group])
            if not self._connection.codes("batch_is_exist", found):
                return None
            if any(code < 0 for code in found):
                self._errors["remote_read_errors"] += 1
                return None
            if advance(found[: len(probes)]):
                continue
            answers, at = [], len(probes)
            for group in asked:
                answers.append(group[: leading_ones(found[at : at + len(group)])])
                at += len(group)
            return answers
        return None

    def end(self, client: Any, ns: str | None) -> str | None:
        """End the epoch (``ns`` None) or the namespace's generation that is current now:
        other hosts may have ended the one this host knows, so the first one whose
        marker is absent is found first; then publish its marker and move this host past
        it. The pattern of the blocks that ended (to remove), or None where the marker
        is not in Mooncake."""
        keys = self.keys
        epoch, generation = keys.current(ns or "")
        marker_of: Callable[[int], str] = (
            keys.cleared if ns is None else lambda g: keys.evicted(ns, g))
        current = self._first_absent(client, marker_of, epoch if ns is None else generation)
        if current is None:
            return None
        config = import_store().ReplicateConfig()
        config.with_hard_pin = True  # a marker must outlive the LRU
        # Another host may publish it meanwhile: a put keeps the first value (code 0),
        # and both meant to end what was current when they began.
        rc = int(client.put(marker_of(current), b"1", config))
        if not self._connection.codes("put", [rc]) or rc != 0:
            return None
        if ns is None:
            keys.advance("", current + 1, 0)
            return keys.epoch_pattern(current)
        keys.advance(ns, 0, current + 1)
        return keys.generation_pattern(ns, current)

    def _first_absent(self, client: Any, marker_of: Callable[[int], str],
                      start: int) -> int | None:
        """The first epoch or generation from ``start`` on whose marker (``marker_of``)
        Mooncake lacks: the current one; None when Mooncake did not answer."""
        count = PROBE
        while True:
            found = client.batch_is_exist([marker_of(start + i) for i in range(count)])
            if not self._connection.codes("batch_is_exist", found) or any(
                    code < 0 for code in found):
                return None
            present = leading_ones(found)
            if present < count:
                return start + present
            start, count = start + count, count * 2  # far behind: larger steps
