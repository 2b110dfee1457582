"""The store thread's answer to a store verb that raises now and then (a transient fault):
retry with capped backoff, and lose nothing meanwhile.

- :class:`OwedCancels`: ids whose ``cancel`` raised stay owed (counted as open tasks)
  and are cancelled again, in one call, each time their backoff has passed, until a
  cancel succeeds or the store closes (the worker makes one last attempt before it
  closes the store). An id is never dropped while the store is open.
- :class:`PollFailures`: a ``try_wait`` that raises is asked again after a backoff; only
  :data:`POLL_ATTEMPTS` failures in a row (no answer in between) fail the launched
  requests, because then the store can no longer tell about them.

Clock: ``time.perf_counter``, read here (store thread only).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable

log = logging.getLogger("aiokv")

FIRST_BACKOFF_S = 0.001
MAX_BACKOFF_S = 0.5
POLL_ATTEMPTS = 8  # try_wait failures in a row before the launched requests fail


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
    """Consecutive ``try_wait`` failures and when the next poll is due."""

    def __init__(self) -> None:
        self._failures = 0
        self._backoff_s = FIRST_BACKOFF_S
        self._due = 0.0

    @property
    def backing_off(self) -> bool:
        return self._failures > 0

    def due(self) -> bool:
        return not self._failures or time.perf_counter() >= self._due

    def wait_s(self) -> float:
        return max(self._due - time.perf_counter(), 0.0)

    def failed(self) -> bool:
        """A poll raised: True when the launched requests must fail now (too many in a
        row), else the next poll waits for a backoff."""
        self._failures += 1
        if self._failures >= POLL_ATTEMPTS:
            self.answered()
            return True
        self._due = time.perf_counter() + self._backoff_s
        self._backoff_s = _next_backoff(self._backoff_s)
        return False

    def answered(self) -> None:
        self._failures = 0
        self._backoff_s = FIRST_BACKOFF_S
        self._due = 0.0


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
