"""What a put's match may count as stored: the rule the embedded store's ``put_match``
and the store server's put matches (:mod:`aiokv.stores.shared.puts`) share.

A page of the key in a host block that is still being written (another put's, or a
load's read from SSD) is not stored yet: that write may fail, and its block is then
rolled back. A put that would count on such a page gets NoSpace instead of a mask that
reads as stored: the engine holds it and matches it again when a task ends (or after
its backoff, :mod:`aiokv.space`), and it then finds the page READY, or gone and so its
own to write. So an offload never reports a page that is not stored, a failed offload
fails alone, and two offloads of one key at once still write it once (the second waits
for the first's write rather than writing the pages again).
"""

from __future__ import annotations

import numpy as np

from ..base import Int64Array, NoSpace
from .blocks import READY, Tier


def on_host(present: list[int | None]) -> Int64Array:
    """The host blocks among a match's ``present`` (per page: a host block, -1 for a page
    only the tier below has, None for a new one), in page order."""
    return np.array([b for b in present if b is not None and b >= 0], dtype=np.int64)


def check_written(host: Tier, blocks: Int64Array) -> None:
    """NoSpace unless every one of a put's stored host ``blocks`` is READY (see the
    module docstring)."""
    writing = np.count_nonzero(host.state[blocks] != READY)
    if writing:
        raise NoSpace(
            f"{host.name}: {writing} of the key's pages are still being written (by "
            "another offload, or read from SSD); matched again once that ends"
        )
