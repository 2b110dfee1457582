"""Which generation a key's pages on this host are of, as the remote tier's reads join
them with pages from Mooncake.

A key's blocks on Mooncake are named under the view they were written in (the master's
lifetime, the epoch, the key's generation: :mod:`.keys`); another host's evict ends a
generation, and a key written again under the next one has other bytes under the same
digests. This host's own pages of a key (its host and SSD tiers) are named by digest only,
so a lookup that finds some of them and reads the rest from Mooncake must know they are of
the view it read under, or it would load two versions in one. Pages of no known view (an
earlier run's SSD blocks, or a key forgotten below) join only reads of the key's first
generation and epoch: no evict or clear the master knows of has ended them; and only in
this run's first lifetime, where they were written under its master (a restarted master
knows of no evict from before: :mod:`.lineage` tells for an earlier run's SSD pages).
"""

from __future__ import annotations

from .keys import Keys

View = tuple[int, int, int]  # (master lifetime, epoch, generation)
_MOST_KEYS = 65536  # past this many, every key is forgotten (the safe side: no view known)


class PageViews:
    """Per key, the view its pages on this host are of (the store thread's)."""

    def __init__(self, keys: Keys | None = None) -> None:
        self._keys = keys  # resolves views noted before any boot id was learned
        self._views: dict[tuple[str, ...], View] = {}
        # The lifetime whose master every page of no known view here was written under
        # (None: not known, they never join): this run's first, unless an earlier run's
        # SSD pages are of another master (:mod:`.lineage`).
        self.unknown: int | None = 0

    def same(self, key: tuple[str, ...], view: View) -> bool:
        """Whether this host's pages of the key are of ``view``."""
        known = self._views.get(key)
        if known is None:
            return self.unknown is not None and view == (self.unknown, 0, 0)
        return (known if self._keys is None else self._keys.seen(known)) == view

    def joins(self, key: tuple[str, ...], own: bool, view: View | None) -> bool:
        """Whether pages read under ``view`` (None: not known) may join this host's pages
        of the key (``own``: it had some); where they do, the view is then the key's."""
        if view is None:
            return not own
        if own and not self.same(key, view):
            return False
        self.noted(key, view)
        return True

    def noted(self, key: tuple[str, ...], view: View) -> None:
        """Every page of the key on this host is of ``view`` (written or read under it).
        A put that only extends older pages does not say so: those keep the view they
        have, or none."""
        views = self._views
        if len(views) > _MOST_KEYS:
            views.clear()
        views[key] = view

    def forget(self, key: tuple[str, ...] | None) -> None:
        """This host dropped the key (None: every key)."""
        if key is None:
            self._views.clear()
        else:
            self._views.pop(key, None)
