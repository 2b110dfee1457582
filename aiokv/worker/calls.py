"""The store thread's calls into the store: each store error translated, once, into a
StoreError raised from it (StoreFull for NoSpace; a match's TooLarge is the caller's
InvalidRequest), and a batch's matches asked in one call where the store matches many at
once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import InvalidRequest, StoreError, StoreFull
from ..requests import TERMINAL, Request
from ..stores.base import Int64Array, NoSpace, Store, TooLarge
from ..validate import positions
from .plans import Answer
from .recovery import OwedCancels

log = logging.getLogger("aiokv")


class StoreCalls:
    """Calls ``store`` for the store thread; ``yield_point`` is where that thread may hand
    the GIL over between calls (it does so once its slice is used)."""

    def __init__(self, store: Store, yield_point: Callable[[], None]) -> None:
        self._store = store
        self._yield_point = yield_point
        # Ids whose cancel raised: retried (recovery.py) until one succeeds.
        self.owed = OwedCancels(lambda ids: self.call(self._store.cancel, ids))

    def cancel(self, task_ids: list[int]) -> None:
        try:
            self.call(self._store.cancel, task_ids)
        except StoreError:
            log.warning("store.cancel of %d ids failed; retrying", len(task_ids), exc_info=True)
            self.owed.owe(task_ids)

    def call(self, method: Callable[..., Any], *args: Any) -> Any:
        """Call the store; translate its errors, once, into StoreError."""
        try:
            return method(*args)
        except Exception as exc:
            raise _store_error(method, exc) from exc

    def match(
        self,
        match: Callable[..., Any],
        match_many: Callable[..., list[Any]] | None,
        requests: Sequence[Request],
        wanted: list[int],
        limit: int | None = None,
    ) -> list[Answer]:
        """Each request's answer (by batch index) to ``match`` (put_match or get_match),
        asked for the ``wanted`` indexes only: in one call where the store matches many
        at once (one round trip to a store process), else one by one, handing the GIL
        over between calls once the slice is used. A failed match is its StoreError, or
        an InvalidRequest for a put that can never be stored (TooLarge). Each key is its
        first ``limit`` tokens at most (:func:`key_ids`)."""
        answers: list[Answer] = [None] * len(requests)
        if match_many is not None:
            if not wanted:
                return answers
            try:
                many: list[Any] = match_many(
                    [(key_ids(requests[i], limit), requests[i].namespace) for i in wanted]
                )
                if len(many) != len(wanted):  # a broken store: give back what it matched
                    self.cancel([a[0] for a in many if not isinstance(a, Exception)])
                    raise RuntimeError(f"{len(many)} answers to {len(wanted)} matches")
            except Exception as exc:
                many = [exc] * len(wanted)
            for index, answer in zip(wanted, many, strict=True):
                answers[index] = (
                    _translated(match, answer, requests[index])
                    if isinstance(answer, Exception) else answer
                )
            return answers
        for index in wanted:
            request = requests[index]
            if request.stage is TERMINAL:
                continue  # left since: never matched, nothing to roll back
            self._yield_point()
            try:  # as _call, without its frame: once per request
                answers[index] = match(key_ids(request, limit), request.namespace)
            except Exception as exc:
                answers[index] = _translated(match, exc, request)
        return answers


def key_ids(request: Request, limit: int | None) -> Int64Array:
    """The token ids the store is asked about for ``request``: the caller's, or the
    default positions, made here on the store thread (never on the loop), and no more
    than ``limit`` of them. A lookup's limit is the most tokens the store can hold: it
    cannot hold a longer prefix, so the rest could not change its answer, and the work
    and memory of a match stay bounded by the store whatever the caller asked."""
    tokens, count = request.token_ids, request.num_tokens
    if limit is not None and count > limit:
        count = limit
    if tokens is None:
        return positions(count)
    return tokens if count == len(tokens) else tokens[:count]


def _translated(method: Callable[..., Any], exc: Exception, request: Request
                ) -> StoreError | InvalidRequest:
    """``exc``, raised by the store's ``method`` matching ``request``, as the error raised
    from it: InvalidRequest naming ``num_tokens`` for a put too large ever to be stored,
    else its StoreError."""
    error: StoreError | InvalidRequest
    if isinstance(exc, TooLarge):
        error = InvalidRequest("num_tokens", f"{request.num_tokens} tokens: {exc}")
    else:
        error = _store_error(method, exc)
    error.__cause__ = exc  # as `raise error from exc` does
    return error


def _store_error(method: Callable[..., Any], exc: Exception) -> StoreError:
    """The StoreError that stands for ``exc``, raised by the store's ``method``."""
    if isinstance(exc, NoSpace):
        return StoreFull(f"store has no space: {exc}")
    name = getattr(method, "__name__", "call")
    return StoreError(f"store.{name} failed: {exc!r}")
