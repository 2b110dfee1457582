"""aiokv's exceptions, grouped by whose fault they are.

::

    AiokvError
    ├── InvalidRequest (ValueError)   the caller's request is malformed; fails alone, at submit
    ├── ConfigError (ValueError)      the configuration is invalid (names the key)
    ├── Overloaded                    max_pending reached with ``overload: reject`` (or
    │                                 the most callers ``wait`` allows already wait)
    ├── EngineClosed                  the engine is not running (not started, draining, closed)
    ├── WrongLoop                     called from a loop or thread other than the engine's
    ├── StoreError                    the store failed a request (raised from the store's error)
    │   └── StoreFull                 nothing could be reserved for new pages
    ├── RequestTimeout (TimeoutError) request_timeout_ms passed before the request resolved
    ├── NotLoaded                     a load_layerwise moved fewer tokens than its Lookup
    │                                 held (0 after an evict): its layers are not in place
    └── BlockingCallOnLoop (RuntimeError)  a blocking call (aiokv.run_in_background) made
                                      on the engine's own loop thread, which would deadlock

Every message names the field or key at fault and the value that was rejected.
"""

from __future__ import annotations


class AiokvError(Exception):
    """Base of every error aiokv raises on purpose."""


class InvalidRequest(AiokvError, ValueError):
    """A request argument is malformed. ``field`` names the argument."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self._message = message

    def __reduce__(self) -> tuple[type[InvalidRequest], tuple[str, str], dict[str, object]]:
        # Rebuilt from both arguments (a store's error crosses from its process), with
        # its attributes (exception notes among them).
        return type(self), (self.field, self._message), self.__dict__


class ConfigError(AiokvError, ValueError):
    """A configuration value or key is invalid. ``key`` names it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self._message = message

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str], dict[str, object]]:
        # Rebuilt from both arguments (a store's error crosses from its process), with
        # its attributes (exception notes among them).
        return type(self), (self.key, self._message), self.__dict__


class Overloaded(AiokvError):
    """The engine holds ``max_pending`` unresolved requests and ``overload`` is
    ``reject``, or is ``wait`` and the most callers it lets wait for room already do
    (:func:`aiokv.loop.admission.max_waiting`). Raised at the call, which never suspends."""


class EngineClosed(AiokvError):
    """The engine is not accepting requests (not started, draining or closed)."""


class WrongLoop(AiokvError):
    """A call made from an event loop (or thread) other than the one that started the
    engine. It fails at once and nothing of it runs; other threads reach the engine
    through :func:`aiokv.run_in_background`."""


class StoreError(AiokvError):
    """The store failed this request; ``__cause__`` holds the store's own error if any."""


class StoreFull(StoreError):
    """The store could not reserve space for new pages (full, and nothing evictable)."""


class RequestTimeout(AiokvError, TimeoutError):
    """``request_timeout_ms`` passed before the request resolved. A launched transfer
    keeps running; the caller only stops waiting for it."""


class NotLoaded(AiokvError):
    """Raised by a :class:`~aiokv.LayerwiseLoad`'s layer waits when the load ended with
    fewer tokens in the pages than its Lookup held: 0 when the key was evicted or cleared
    after the lookup, fewer where a block read from SSD failed its checksum. The pages do
    not hold the hit, so no layer is reported ready; ``result()`` still gives the
    LoadResult (as ``load`` would). ``loaded_tokens`` and ``cached_tokens`` say how many."""

    def __init__(self, message: str, loaded_tokens: int, cached_tokens: int) -> None:
        super().__init__(message)
        self.loaded_tokens = loaded_tokens
        self.cached_tokens = cached_tokens

    def __reduce__(self) -> tuple[type[NotLoaded], tuple[str, int, int], dict[str, object]]:
        # Rebuilt from all three arguments (copied, pickled), with its attributes.
        return type(self), (str(self), self.loaded_tokens, self.cached_tokens), self.__dict__


class BlockingCallOnLoop(AiokvError, RuntimeError):
    """A blocking method of :func:`aiokv.run_in_background`'s handle was called on the
    engine's own loop thread, where waiting for the loop would wait forever. Code on that
    loop awaits the engine directly."""
