"""The child side of :class:`~aiokv.stores.process.ProcessStore`.

``python -m aiokv.stores.child FD``: FD is this end of the socket. The parent sends its
multiprocessing key (bytes), then ``(StoreConfig, caches or CacheGeometry)``. The child
builds the store, registers it (FlexKV: starts it, asks the parent to attach the caches,
waits for ready) and answers ``("ready", page_size)`` or ``("failed", exception)``. Then
it serves ``(op, args)`` requests one at a time, answering ``(True, value)`` or ``(False,
exception)``, until ``("close", None)`` or until the socket closes (the parent is gone);
either way it closes its store before it exits.

FlexKV starts its transfer engine with multiprocessing "spawn", which imports this
module again as its main module: everything runs under the ``__main__`` guard.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch.multiprocessing  # noqa: F401  (registers tensor reductions for Connection.recv)

from . import make_store
from .base import NoSpace, Store
from .process import pack_results, portable

log = logging.getLogger("aiokv")


def _launch(store: Store, args: Any) -> None:
    task_ids, lengths, joined = args  # the slots, one array (ProcessStore.launch)
    store.launch(task_ids, np.split(joined, np.cumsum(lengths)[:-1]) if lengths else [])


def _put_match_many(store: Store, args: Any) -> list[Any]:
    """Each put_match's answer, or the exception it raised, in order."""
    answers: list[Any] = []
    for token_ids, namespace in args:
        try:
            answers.append(store.put_match(token_ids, namespace))
        except Exception as exc:
            if not isinstance(exc, (NoSpace, ValueError)):  # the contract's own errors
                log.warning("aiokv store process: put_match failed", exc_info=True)
            answers.append(portable(exc))
    return answers


_CALLS: dict[str, Callable[[Store, Any], Any]] = {
    "put_match": lambda store, args: store.put_match(*args),
    "put_match_many": _put_match_many,
    "get_match": lambda store, args: store.get_match(*args),
    "launch": _launch,
    "cancel": lambda store, args: store.cancel(args),
    "try_wait": lambda store, args: pack_results(store.try_wait(args)),
}


def _register(store: Store, payload: Any, conn: Connection) -> None:
    from .flexkv import CacheGeometry, FlexKVStore

    if not isinstance(payload, CacheGeometry):
        store.register(payload)
        return
    assert isinstance(store, FlexKVStore)
    store.start(payload)
    try:
        conn.send(("attach", (store.gpu_register_endpoint, store.socket_files)))
        attached, error = conn.recv()
        if not attached:
            raise error
    except BaseException:
        store.close()
        raise
    store.wait_attached()


def serve(conn: Connection) -> int:
    multiprocessing.current_process().authkey = conn.recv()
    store: Store | None = None
    try:
        config, payload = conn.recv()  # tensors: may fail to map here
        store = make_store(config)  # e.g. FlexKV not importable from this process
        _register(store, payload, conn)
    except Exception as exc:
        if store is not None:
            store.close()
        with contextlib.suppress(OSError):
            conn.send(("failed", portable(exc)))
        return 1
    reply: tuple[bool, Any] = (True, None)
    try:
        try:
            conn.send(("ready", store.page_size))
        except OSError:  # the parent gave up or died meanwhile
            return 0
        while True:
            try:
                op, args = conn.recv()
            except (EOFError, OSError):  # the parent is gone: nobody waits for an answer
                return 0
            if op == "close":
                break
            try:
                reply = (True, _CALLS[op](store, args))
            except Exception as exc:
                if not isinstance(exc, (NoSpace, ValueError)):  # the contract's own errors
                    log.warning("aiokv store process: %s failed", op, exc_info=True)
                reply = (False, portable(exc))
            try:
                conn.send(reply)
            except OSError:  # the parent is gone
                return 0
    finally:
        try:
            store.close()
            reply = (True, None)
        except Exception as exc:
            log.exception("aiokv store process: close failed")
            reply = (False, portable(exc))
    with contextlib.suppress(OSError):
        conn.send(reply)
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(format="%(asctime)s %(name)s[child]: %(message)s")
    with Connection(int(argv[1])) as conn:
        return serve(conn)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
