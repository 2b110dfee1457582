"""The remote tier's one Mooncake Store client, and its health.

Connecting (``setup``) happens on the first call, not at open, so a master that is down
at start costs nothing but misses. Mooncake's ``setup`` holds the GIL for as long as it
waits for the master, so a master that accepts connections but does not answer (stopped,
hung) would stop every thread of this process: the master is asked first, within
``timeout_ms``, without the GIL (:func:`master_answers`). One that goes away after that
answer meets ``setup`` itself: it is made once, not retried (:func:`_one_setup_attempt`),
so the process stops for one attempt (about 4 s), not Mooncake's twenty. A call that
fails for want of the master (or raises), a connect among them, is counted and puts the
tier to rest for a while, doubling from ``timeout_ms`` to 30 s: while it rests lookups
miss and writes are dropped at once, without a call. The client reconnects to a master
that comes back by itself; the rest only keeps a dead master from costing every lookup
its full wait.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from .caller import current_call
from .config import RemoteConfig
from .native import import_store

log = logging.getLogger("aiokv")

NO_SPACE = -200  # Mooncake: no segment can take the value now
ABSENT = -704  # OBJECT_NOT_FOUND
NOT_READY = -703  # REPLICA_IS_NOT_READY: another host's put of the value is under way
_DOWN = -900  # this code and below: the master or the transport failed (RPC_FAIL, ...)
_MAX_REST_S = 30.0
_CONNECT_WAIT_S = 10.0
_SETUP_RETRIES = "MC_STORE_CLIENT_SETUP_RETRIES"  # read by each setup; Mooncake's default: 20
_setup_env = threading.Lock()  # one connect's setting of it at a time, in this process


def _local_hostname(config: RemoteConfig) -> str:
    if config.local_hostname:
        return config.local_hostname
    if config.on_loopback():
        return "127.0.0.1"
    # The address this host would use towards the master (a UDP connect sends nothing).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((config.master_host, 9))
        return str(probe.getsockname()[0])


def master_answers(config: RemoteConfig) -> None:
    """Return once the master's RPC server reacts to a connection, within ``timeout_ms``;
    else raise OSError (TimeoutError: it accepted but did not answer).

    A TCP connect alone proves nothing: the kernel accepts for a stopped process. Sixteen
    zero bytes are no request (coro_rpc's first byte is 0x21): a live master closes the
    connection at once (or answers), which a stopped one cannot."""
    timeout_s = config.timeout_ms / 1000
    deadline = time.monotonic() + timeout_s
    with socket.create_connection(config.master_address, timeout_s) as probe:
        probe.settimeout(max(0.001, deadline - time.monotonic()))
        probe.sendall(bytes(16))
        try:
            probe.recv(1)
        except ConnectionResetError:  # a reset is an answer too
            pass
        except TimeoutError:
            raise TimeoutError(
                f"the master at {config.master} accepts connections but did not answer "
                f"within {config.timeout_ms} ms"
            ) from None


@contextmanager
def _one_setup_attempt() -> Iterator[None]:
    """Within: Mooncake's ``setup`` makes one attempt, unless the environment says how many.

    Each attempt on a master that went away (after :func:`master_answers`) tries it for
    about 4 s with the GIL held, and Mooncake makes twenty: the loop and the store thread
    stopped for 90 s, a lookup with them (its ``timeout_ms`` cannot run out meanwhile:
    ``RequestTimeout`` at ``request_timeout_ms``). The tier makes the next attempt itself
    after its rest, the master asked first. Set for the call only: other Mooncake clients
    of this process (a connector's) keep their own."""
    with _setup_env:
        if _SETUP_RETRIES in os.environ:  # the user's choice
            yield
            return
        os.environ[_SETUP_RETRIES] = "1"
        try:
            yield
        finally:
            del os.environ[_SETUP_RETRIES]


class Closed(Exception):
    """The tier's close returned: no Mooncake call starts any more (:meth:`Connection.stop`)."""


class _Calls:
    """The client as the tier's threads call it: a call that would start after
    :meth:`Connection.stop` raises :class:`Closed` instead. A thread that close left in a
    call (a master that stopped answering) goes on with its work once the call returns:
    whatever step of it comes next, it makes no further call on the closed tier."""

    __slots__ = ("_client", "_connection")

    def __init__(self, client: Any, connection: Connection) -> None:
        self._client, self._connection = client, connection

    def __getattr__(self, name: str) -> Any:
        if self._connection.stopped:
            raise Closed(f"the remote tier is closed: no {name} call")
        return getattr(self._client, name)


class Connection:
    """The client, set up on first use with ``buffers()`` (address, bytes) registered, and
    whether the tier rests. Any thread."""

    def __init__(self, config: RemoteConfig,
                 buffers: Callable[[], list[tuple[int, int]]]) -> None:
        self.config = config
        self._buffers = buffers
        self._client: Any = None
        self._calls: _Calls | None = None  # the client, as the tier's threads call it
        # Close returned (:meth:`stop`): no call starts, and nothing more is counted.
        self.stopped = False
        self._connect_lock = threading.Lock()
        self._rest_s = config.timeout_ms / 1000
        self._retry_at = 0.0  # time.monotonic() before which calls are not tried
        self.rested = False  # whether the tier ever rested (a connect or a call failed)
        # Counted among the tier's errors: whichever thread's call it was (the reader's
        # checks too, which nobody waits on), and the only sign a user has of a rest.
        self.failed_connects = 0
        self.failed_calls = 0  # failed for want of the master, or raised
        self._counting = threading.Lock()  # the tier's three threads fail alike
        # The reader thread's calls whose failure was seen, and those whose timeout was
        # counted: each call is counted once, whoever sees it first.
        self._failed: weakref.WeakSet[Future[Any]] = weakref.WeakSet()
        self._timed_out: weakref.WeakSet[Future[Any]] = weakref.WeakSet()

    def resting(self) -> bool:
        return time.monotonic() < self._retry_at

    def rest_left_s(self) -> float:
        """How long the tier still rests (0: it does not)."""
        return max(0.0, self._retry_at - time.monotonic())

    def rest(self, what: str, detail: object) -> None:
        if not self.resting():
            log.warning("aiokv: remote tier: %s failed (%s); resting %.1f s",
                        what, detail, self._rest_s)
        self._retry_at = time.monotonic() + self._rest_s
        self._rest_s = min(_MAX_REST_S, self._rest_s * 2)
        self.rested = True

    def failed(self, what: str, detail: object, call: Future[Any] | None = None) -> None:
        """A call failed for want of the master, or raised (``call``: the reader thread's
        call that raised; else the one under way on this thread): counted, and the tier
        rests, once per call (:meth:`_failure`)."""
        if self.stopped:  # a call close left under way: the closed tier's figures are final
            return
        count, first = self._failure(current_call() if call is None else call)
        if count:
            with self._counting:
                self.failed_calls += 1
        if first:
            self.rest(what, detail)

    def refused(self) -> bool:
        """Mooncake answered the call under way on this thread with an error: whether to
        count it (:meth:`_failure`; not once close returned)."""
        return not self.stopped and self._failure(current_call())[0]

    def timed_out(self, call: Future[Any]) -> bool:
        """A lookup or an evict gave up waiting for ``call`` (the reader thread's call it
        waited for: its own, or the one it was queued behind): whether to count its
        timeout. Not if that call was counted already, as failed or timed out: two
        evicts that wait for one call, or a call that failed first, count it once."""
        with self._counting:
            if call in self._failed or call in self._timed_out:
                return False
            self._timed_out.add(call)
            return True

    def _failure(self, call: Future[Any] | None) -> tuple[bool, bool]:
        """A failure of ``call`` (None: not the reader thread's): whether to count it (not
        if the call was counted already: a waiter gave up on it first, or it failed
        before), and whether it is the call's first failure (the tier rests once for
        it). A call that times out and then fails is one error."""
        if call is None:
            return True, True
        with self._counting:
            first = call not in self._failed
            self._failed.add(call)
            return first and call not in self._timed_out, first

    def _succeeded(self) -> None:
        self._rest_s = self.config.timeout_ms / 1000

    def ready(self) -> Any:
        """The set-up client, or None (resting, setup failed now, or closed). While the
        tier rests no call is tried: on a master that stopped answering each waits about
        30 s."""
        if self.stopped or self.resting():
            return None
        if self._calls is not None:
            return self._calls
        # Another thread may be connecting: wait for it (a connect is bounded by the
        # probe below, but Mooncake's own setup is not: do not wait for ever).
        if not self._connect_lock.acquire(timeout=_CONNECT_WAIT_S):
            return None
        try:
            if self._client is None:
                self._client = self._connect()
                if self._client is not None:
                    self._calls = _Calls(self._client, self)
        finally:
            self._connect_lock.release()
        return self._calls

    def _connect(self) -> Any:
        config = self.config
        try:
            # Mooncake's setup waits for an absent master, or one that does not answer,
            # with the GIL held: ask it first, within the timeout (and let setup try once).
            master_answers(config)
            client = import_store().MooncakeDistributedStore()
            with _one_setup_attempt():
                rc = client.setup(
                    _local_hostname(config), config.metadata, 0, config.local_buffer_mb << 20,
                    config.protocol, config.devices, config.master,
                )
            if rc == 0:
                for address, size in self._buffers():
                    rc = rc or client.register_buffer(address, size)
            if rc != 0:
                client.close()
                self._failed_connect(f"code {rc}")
                return None
        except (ImportError, RuntimeError, OSError) as exc:
            self._failed_connect(exc)
            return None
        self._succeeded()
        return client

    def _failed_connect(self, detail: object) -> None:
        """A connect inside a call (the reader thread's: counted once, as any failure
        of it; :meth:`_failure`)."""
        if self.stopped:
            return
        count, first = self._failure(current_call())
        if count:
            with self._counting:
                self.failed_connects += 1
        if first:
            self.rest("setup", detail)

    def codes(self, what: str, codes: Sequence[int]) -> bool:
        """Whether a batch call reached Mooncake (else it is counted, and the tier
        rests). False once close returned: nothing of a call it left under way is used."""
        if self.stopped:
            return False
        if any(code <= _DOWN for code in codes):
            self.failed(what, f"code {min(codes)}")
            return False
        self._succeeded()
        return True

    def stop(self) -> None:
        """Close returned: no call starts from now on (:class:`Closed`), and a call that
        close left under way is neither counted nor rests the tier when it returns: the
        closed engine's figures are final, and its log says nothing more."""
        self.stopped = True

    def close(self) -> None:
        """Let go of Mooncake (once no thread calls it)."""
        self.stop()
        client, self._client, self._calls = self._client, None, None
        if client is not None:
            for address, _ in self._buffers():
                client.unregister_buffer(address)
            client.close()
