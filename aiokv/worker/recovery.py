"""The store thread's answer to a store verb that raises now and then (a transient fault):
retry with capped backoff, and lose nothing meanwhile.

- :class:`OwedCancels`: ids whose ``cancel`` raised stay owed (counted as open tasks)
  and are cancelled again, in one call, each time their backoff has passed, until a
  cancel succeeds or the store closes (the worker makes one last attempt before it
  closes the store). An id is never dropped while the store is open.
- :class:`PollFailures`: a ``try_wait`` that raises (an outage, however long) is asked
  again after a capped backoff. Launched ids are never dropped while the store is open:
  their copies still run, and a caller told that its offload failed would reuse pages
  that the store may still read (and then commit under the old key). Their requests stay
  pending until their tasks are terminal or their ``request_timeout_ms`` passes
  (``RequestTimeout``: the transfer may still complete); the ids stay open tasks. Only
  the engine's close gives up on them, at its deadline, as the store closes. An evict or
  clear waits through :data:`EVICT_POLL_ATTEMPTS` failures in a row for what was launched
  before it, then fails itself (nothing dropped) rather than hold the store thread.

Clock: ``time.perf_counter``, read here (store thread only).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable

log = logging.getLogger("aiokv")

FIRST_BACKOFF_S = 0.001
MAX_BACKOFF_S = 0.5
EVICT_POLL_ATTEMPTS = 8  # try_wait failures in a row an evict waits through, then fails


def _next_backoff(backoff_s: float) -> float:
    return min(2 * backoff_s, MAX_BACKOFF_S)


class OwedCancels:
    """Ids whose cancel failed, retried by ``cancel`` (which raises on failure)."""

    def __init__(self, cancel: Callable[[list[int]], None]) -> None:
        self._cancel = cancel
        self._ids: dict[int, None] = {}  # insertion-ordered set
        self._backoff_s = FIRST_BACKOFF_S
        self._due = 0.0

    def __len__(self) -> int:
        return len(self._ids)

    def owe(self, task_ids: Iterable[int]) -> None:
        now = time.perf_counter()
        if not self._ids:
            self._due = now + self._backoff_s
        self._ids.update(dict.fromkeys(task_ids))

    def wait_s(self) -> float | None:
        """Seconds until the next retry is due; None when nothing is owed."""
        return max(self._due - time.perf_counter(), 0.0) if self._ids else None

    def retry(self, final: bool = False) -> None:
        """Cancel every owed id once the backoff has passed (``final``: now, the store is
        about to close; what still fails is then logged and given up)."""
        if not self._ids:
            return
        now = time.perf_counter()
        if now < self._due and not final:
            return
        ids = list(self._ids)
        try:
            self._cancel(ids)
        except Exception:
            self._backoff_s = _next_backoff(self._backoff_s)
            self._due = now + self._backoff_s
            if final:
                log.exception("aiokv: giving up cancelling %d ids; the store closes", len(ids))
                self._ids.clear()
            else:
                log.warning("aiokv: cancelling %d ids failed again; retry in %.3fs",
                            len(ids), self._backoff_s)
            return
        self._ids.clear()
        self._backoff_s = FIRST_BACKOFF_S


    def settle(self, attempts: int = 5, pause_s: float = 0.001) -> bool:
        """Cancel every owed id now, retrying a few times with a short, growing pause;
        whether none is owed afterwards. For an evict or clear: the store keeps blocks
        that a match still holds, so dropping a key while its cancel is owed would leave
        old KV to be found."""
        for attempt in range(attempts):
            if not self._ids:
                return True
            try:
                self._cancel(list(self._ids))
            except Exception:
                time.sleep(pause_s * 2**attempt)
                continue
            self._ids.clear()
            self._backoff_s = FIRST_BACKOFF_S
        return not self._ids


class PollFailures:
    """A ``try_wait`` outage: its failures in a row, since when, and the next poll's due."""

    def __init__(self) -> None:
        self._failures = 0
        self._since = 0.0
        self._backoff_s = FIRST_BACKOFF_S
        self._due = 0.0

    @property
    def backing_off(self) -> bool:
        return self._failures > 0

    @property
    def failures(self) -> int:
        """Failures in a row (0: the last poll was answered)."""
        return self._failures

    def due(self) -> bool:
        return not self._failures or time.perf_counter() >= self._due

    def wait_s(self) -> float:
        return max(self._due - time.perf_counter(), 0.0)

    def failed(self) -> bool:
        """A poll raised: the next one waits for a backoff (doubling up to
        :data:`MAX_BACKOFF_S`). True for an outage's first failure (the one to log)."""
        now = time.perf_counter()
        self._failures += 1
        if self._failures == 1:
            self._since = now
        self._due = now + self._backoff_s
        self._backoff_s = _next_backoff(self._backoff_s)
        return self._failures == 1

    def answered(self) -> tuple[int, float] | None:
        """A poll was answered: the outage it ends, as (failures, seconds), if any."""
        outage = None
        if self._failures:
            outage = (self._failures, time.perf_counter() - self._since)
        self._failures = 0
        self._backoff_s = FIRST_BACKOFF_S
        self._due = 0.0
        return outage


def retry_timeout(
    timeout: float | None, owed: OwedCancels, polls: PollFailures, launched: Collection[int]
) -> float | None:
    """The store thread's wait for its inbox (``timeout``), shortened to when an owed
    cancel or, while tasks are ``launched``, a failed poll is retried."""
    backing_off = bool(launched) and polls.backing_off
    if not owed and not backing_off:
        return timeout  # the usual case: nothing to retry
    waits = [owed.wait_s(), timeout]
    if backing_off:
        waits.append(polls.wait_s())
    due = [wait for wait in waits if wait is not None]
    return min(due) if due else None
