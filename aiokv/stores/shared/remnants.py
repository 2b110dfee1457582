"""What an evict or clear could not free at once on the store server.

In one embedded store, the engine gives back every Lookup of a key and waits for its
loads before the store drops the key, so nothing of it is in use then. The server drops
a key while other engines may hold gets of it (taken back, but their blocks still read
until those engines say so), staged SSD reads may be reading it, and puts of it may be
on their way. Those blocks cannot be freed yet, and must not be found either: the key's
tables that still hold some are taken out of reach (:meth:`BlockIndex.detach
<aiokv.stores.local.index.BlockIndex.detach>`), so that a lookup or put of the key from
then on starts afresh, and kept here; :meth:`Remnants.sweep` forgets and frees (for the
SSD tier, voids on disk) each block once nothing uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..local.blocks import Tier
from ..local.index import Space
from ..local.ssd import SsdTier


@dataclass(slots=True)
class Remnants:
    """Detached tables and the tier each belongs to (an SsdTier for SSD slots)."""

    buried: list[tuple[Tier | SsdTier, Space]] = field(default_factory=list)

    def bury(self, tier: Tier | SsdTier, namespace: tuple[str, ...] | None) -> None:
        """Take the tables of ``namespace`` (None: all) still holding blocks (in use:
        the idle ones are dropped already) out of reach, to sweep later."""
        index = tier.tier.index if isinstance(tier, SsdTier) else tier.index
        spaces = index.spaces() if namespace is None else [index.space(namespace)]
        for space in spaces:
            if space is not None and len(space):
                index.detach(space)
                self.buried.append((tier, space))

    def sweep(self) -> None:
        """Forget and free the blocks of the detached tables that nothing uses now."""
        if not self.buried:
            return
        left = []
        for tier, space in self.buried:
            blocks = np.fromiter(space.values(), dtype=np.int64, count=len(space))
            if isinstance(tier, SsdTier):
                tier.void(tier.tier.drop_idle(blocks))
            else:
                tier.drop_idle(blocks)
            if len(space):
                left.append((tier, space))
        self.buried = left

    def __len__(self) -> int:
        return sum(len(space) for _, space in self.buried)
