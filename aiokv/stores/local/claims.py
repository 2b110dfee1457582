"""What a put's match may count as stored, and what room it needs: the rules the embedded
store's put matches (:mod:`.puts`) and the store server's
(:mod:`aiokv.stores.shared.puts`) share.

- A page of the key in a host block that is still being written (another put's, or a
  load's read from SSD) is not stored yet: that write may fail, and its block is then
  rolled back. A put that would count on such a page gets NoSpace instead of a mask that
  reads as stored: the engine holds it and matches it again when a task ends (or after
  its backoff, :mod:`aiokv.space`), and it then finds the page READY, or gone and so its
  own to write. So an offload never reports a page that is not stored, a failed offload
  fails alone, and two offloads of one key at once still write it once (the second waits
  for the first's write rather than writing the pages again).
- Every new page of a put gets a host block, all at once (the SSD tier is written from
  the host tier): more new pages than the host tier has blocks is TooLarge at the match,
  however much the SSD tier holds, rather than a wait for room that cannot come. Only the
  new pages count: a long history whose prefix is stored needs room for its tail alone;
  but with no tier below, its stored pages are held too (next item), and count.
  The blocks are those the tier can ever hand out (``capacity``): where pinning stopped
  short (a memlock limit), those pinned (such a put waited for room until
  request_timeout_ms). While pinning goes on, all of them: the reserve waits for them,
  and gets NoSpace if pinning stops short meanwhile (TooLarge when matched again).
- While its blocks are reserved, the put's stored pages on the host are held out of the
  LRU, so that the eviction making its room cannot take what it reports stored; but not
  those the SSD tier has too (evicting them loses nothing); and where the room is short
  without the others (write_back copies a block down only as it is evicted), their
  copies down start at once, for a later match to evict them. All held, a key's own
  pages filled the host tier and kept it from ever growing: every append waited out
  request_timeout_ms.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..base import Int64Array, NoSpace, TooLarge
from .blocks import READY, Tier
from .tiering import TierLink


def check_fits(host: Tier, new: int, pages: int, held: int = 0) -> None:
    """TooLarge when a put's ``new`` pages (of its ``pages`` full pages), with the
    ``held`` stored host blocks its reservation cannot evict (a host tier with no tier
    below holds them all), are more than the host tier can ever hold
    (:attr:`~.pool.BlockAllocator.capacity`)."""
    capacity = host.alloc.capacity
    if new + held > capacity:
        pinned = (f" that are pinned (of {host.num_blocks}: pinning stopped short, a "
                  "memlock limit)" if capacity < host.num_blocks else "")
        if new > capacity:
            what, keeping = f"{new} of its {pages} full pages are new, more than", ""
        else:  # room that never comes: its own stored pages must stay
            what = (f"{new} of its {pages} full pages are new and {held} stored on the "
                    f"{host.name} tier only, together more than")
            keeping = ", keeping its stored ones"
        raise TooLarge(
            f"{what} the {capacity} blocks of the {host.name} tier{pinned}, which takes "
            f"all of a put's new pages at once{keeping} (offload a shorter prefix first)"
        )


def on_host(present: list[int | None]) -> Int64Array:
    """The host blocks among a match's ``present`` (per page: a host block, -1 for a page
    only the tier below has, None for a new one), in page order."""
    return np.array([b for b in present if b is not None and b >= 0], dtype=np.int64)


def check_written(host: Tier, blocks: Int64Array) -> None:
    """NoSpace unless every one of a put's stored host ``blocks`` is READY."""
    writing = np.count_nonzero(host.state[blocks] != READY)
    if writing:
        raise NoSpace(
            f"{host.name}: {writing} of the key's pages are still being written (by "
            "another offload, or read from SSD); matched again once that ends"
        )


def to_hold(host: Tier, link: TierLink | None, key: tuple[str, ...], digests: Sequence[bytes],
            present: list[int | None], blocks: Int64Array, new: int) -> Int64Array:
    """Which of a put's stored host ``blocks`` (``on_host(present)``) its reservation of
    ``new`` blocks must not evict: all, unless it has to evict and the SSD tier has some
    of them too; those become the most recent, and evictable. Where the room is short
    without the others, their copies down start now (see the module docstring)."""
    if link is None or new <= host.alloc.num_free or not len(blocks):
        return blocks
    at = [i for i, b in enumerate(present) if b is not None and b >= 0]
    below = np.array(link.ssd.has(key, [digests[i] for i in at]), dtype=np.bool_)
    if below.any():
        host.index.make_evictable(host.index.make_unevictable(blocks[below]))
        blocks = blocks[~below]
    if len(blocks) and new > host.available() - len(blocks):
        link.write_down(blocks)
    return blocks
