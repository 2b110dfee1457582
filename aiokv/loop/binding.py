"""Which loop an engine belongs to: the one that started it. Its futures, timers and
batcher task live there, so a call from any other loop or thread fails at once with
:class:`~aiokv.errors.WrongLoop`, before it touches anything (nothing is counted, queued or
run). :func:`check_loop` is the one place the binding is checked: the engine's calls and
the objects it hands out (a :class:`~aiokv.layerwise.LayerwiseLoad`) all call it.
"""

from __future__ import annotations

import asyncio
import threading

from ..errors import WrongLoop

_running_loop = asyncio.events._get_running_loop  # None off a loop; no exception to catch


def check_loop(owner: asyncio.AbstractEventLoop | None) -> None:
    """Raise WrongLoop unless this runs on ``owner``, the engine's loop."""
    running = _running_loop()
    if running is not owner:
        raise wrong_loop(owner, running)


def wrong_loop(
    owner: asyncio.AbstractEventLoop | None, running: asyncio.AbstractEventLoop | None
) -> WrongLoop:
    closed = " (now closed)" if owner is not None and owner.is_closed() else ""
    here = "no running loop" if running is None else f"loop {running!r}"
    return WrongLoop(
        f"this engine belongs to the event loop that started it, {owner!r}{closed}; the "
        f"call came from {here} on thread {threading.current_thread().name!r}. Await the "
        "engine on its own loop; from other threads, use aiokv.run_in_background()"
    )
