"""Keys that every host computes alike, and the generations that invalidation moves.

A block's key is ``aiokv1/<geometry>/<boot>/<namespace>/<epoch>.<generation>/<digest>``:

- ``geometry``: a hash of the host block's shape (layers, k/v, page size, heads,
  head_dim) and dtype: a host with another geometry never finds these blocks;
- ``boot``: the master's boot id (below) the write was offered under: a write that a
  host checked before a restart of the master and put after it (no check is atomic with
  a put) lands where the new master's hosts never look;
- ``namespace``: a hash of the namespace (a list of str), kept apart by structure as in
  the local index;
- ``digest``: the local index's chained digest of the token prefix up to the block end
  (:func:`aiokv.stores.local.digests.chain_digests`), so equal keys mean equal prefixes;
- ``epoch`` (moved by ``clear``) and ``generation`` (moved by ``evict`` of the
  namespace): a key of an old one never matches again, even where a host's write of it
  lands after the invalidation.

Hosts learn each other's invalidations from markers in Mooncake itself: the key
``<root>/cleared/<e>`` exists once epoch ``e`` was cleared, ``<root>/<ns>/evicted/<g>``
once generation ``g`` of the namespace was evicted. Every lookup asks for a few markers
past its known epoch and generation in the same ``batch_is_exist`` as its blocks, and
moves on past the ones it finds; where all of them are there (a host that started after
many invalidations) it finds the newest marker in a few calls more, however many there
are (:meth:`.markers.Markers.settle`). The blocks of the generation (epoch) an evict (clear)
ended are removed by regex (best effort: never those of the next one, which other hosts
may be writing already), and otherwise age out of Mooncake's LRU.

A master that restarts (without HA) loses every key, the markers too: a host that had
moved past some would go on using epochs and generations that hosts started since never
reach. So the first host to connect puts a boot id under ``<root>/boot`` (a put keeps
the first value) and ``<root>/boot/<id>``; every host reads the id back, and asks for
``<root>/boot/<id>`` with its markers (one key more in the same call): once it is gone,
so is everything the host knew of, and it starts again from epoch and generations 0 (a
new *lifetime* of its view); a host that wrote under the old id removes what is under it
once (best effort: a write that crossed the restart), never what is under the new one.

The boot id's keys and the markers are put hard-pinned (``markers._pinned``): Mooncake's
LRU, oldest lease first, would take them first once its segment nears full (a marker is
read once, then never asked for again), and a full Mooncake would then look like a
restart, or show a host that never saw an evict the bytes it ended. Only a master that
restarts (every key lost), or a store process whose segment the master unmounts (its
heartbeat late past the master's ``client_ttl``: the keys that segment held) loses them.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# The root of every key, markers' and blocks' alike. Blocks' keys gained the master's boot
# id without a new version on purpose: blocks of the two layouts can never be taken for
# each other (they differ by a segment), while the markers stay shared, so that an evict
# or clear by a host of either layout ends the key for hosts of both, as a rolling
# upgrade needs (a new version would let a new host serve what an old one evicted).
VERSION = "aiokv1"
BLIND = -1  # a view's lifetime, taken before this host learned any boot id
PROBE = 4  # markers asked for past the known epoch and generation, per lookup
_MAX_NAMESPACES = 1 << 16  # generations remembered; a forgotten one is found again by probes


def geometry_tag(block_shape: Sequence[int], dtype: torch.dtype, page_size: int) -> str:
    text = json.dumps([list(map(int, block_shape)), str(dtype), int(page_size)])
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def namespace_tag(namespace: Sequence[str]) -> str:
    text = json.dumps(list(namespace), ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class Keys:
    """Key names under one geometry, and this host's view of the epoch and generations
    (any thread: a lock guards the maps).

    An evict (clear) makes the namespace (every namespace) unusable here until its
    marker is out (:meth:`unpublish`, :meth:`published`): only then does this host know
    which generation it ended and which one follows, so meanwhile it neither reads nor
    writes the namespace on Mooncake. Where the marker cannot be published (the master
    does not answer), that lasts until it can."""

    def __init__(self, geometry: str) -> None:
        self.root = f"{VERSION}/{geometry}"
        self._lock = threading.Lock()
        self._epoch = 0
        self._generations: OrderedDict[str, int] = OrderedDict()
        # Namespace -> time.monotonic() of the newest call that asked for its markers and
        # was answered (a lookup's, the writer's): puts ask for markers not asked lately.
        self._asked_at: dict[str, float] = {}
        self._unpublished: Counter[str | None] = Counter()  # namespace (None: all) -> evicts
        # Of those, the evicts that wait for a write of theirs under way before their
        # marker (:meth:`unpublish`, ``held``): not the marker's yet, nor so its removal's.
        self._held: Counter[str | None] = Counter()
        self.boot: str | None = None  # the master's boot id, once learned
        self.lifetime = 0  # restarts of the master seen
        # The lifetime of views taken before the first boot id was learned (BLIND in
        # them): the first, unless this host was cut off from the master before it
        # reached it (None: of no known master, they never match; the remote tier's
        # link decides it as that id is learned).
        self.blind_lifetime: int | None = 0
        self.checked_at = 0.0  # time.monotonic() of the last markers Mooncake answered

    def view(self, ns: str) -> tuple[int, int, int]:
        """(lifetime, epoch, generation) of the namespace: what a write is offered under."""
        with self._lock:
            return self.lifetime, self._epoch, self._generations.get(ns, 0)

    def offered_view(self, ns: str) -> tuple[int, int, int]:
        """:meth:`view`, its lifetime BLIND before any boot id is learned: a master may
        restart before the one this host reaches first, forgetting evicts that ended
        what is offered now (:attr:`blind_lifetime` tells, once that one is known)."""
        with self._lock:
            blind = self.boot is None and self.lifetime == 0
            return (BLIND if blind else self.lifetime, self._epoch,
                    self._generations.get(ns, 0))

    def seen(self, view: tuple[int, int, int]) -> tuple[int, int, int] | None:
        """An offered view as of the lifetimes learned since (None: of none)."""
        if view[0] != BLIND:
            return view
        lifetime = self.blind_lifetime
        return None if lifetime is None else (lifetime, view[1], view[2])

    def learned(self, boot: str) -> None:
        with self._lock:
            if self.boot is None:
                self.boot = boot

    def restart(self, boot: str) -> bool:
        """The master that ``boot`` named is gone with every key: start again from epoch
        and generations 0, and drop the invalidations not out (what they would end is
        gone). Whether this call did it (not another thread first)."""
        with self._lock:
            if self.boot != boot:
                return False
            self.boot = None
            self.lifetime += 1
            self._epoch = 0
            self._generations.clear()
            self._asked_at.clear()
            self._unpublished.clear()
            return True

    def asked_since(self, ns: str, since: float) -> bool:
        """Whether a call asked since ``since`` (time.monotonic()) for the namespace's
        markers, and was answered."""
        return self._asked_at.get(ns, -1.0) >= since

    def usable(self, ns: str) -> bool:
        """Whether this host may read and write the namespace on Mooncake now."""
        if not self._unpublished:  # the usual case, without the lock
            return True
        with self._lock:
            return None not in self._unpublished and ns not in self._unpublished

    def unpublish(self, ns: str | None, held: bool = False) -> None:
        """An evict of the namespace (None: a clear) whose marker is not out yet.
        ``held``: it waits for a write of the namespace under way first, and until
        :meth:`release` its marker is not to be published (:meth:`publishable`): the
        removal that follows the marker would come before that put lands, and leave its
        blocks in Mooncake, read by nobody."""
        with self._lock:
            self._unpublished[ns] += 1
            if held:
                self._held[ns] += 1

    def release(self, ns: str | None) -> None:
        """A held evict (:meth:`unpublish`) of the namespace is done waiting."""
        with self._lock:
            self._held[ns] -= 1
            self._held = +self._held  # drops the namespaces at 0

    def unpublished(self) -> dict[str | None, int]:
        """The invalidations whose markers are not out, per namespace (None: clears)."""
        with self._lock:
            return dict(self._unpublished)

    def publishable(self) -> dict[str | None, int]:
        """:meth:`unpublished`, but for the namespaces with an evict held."""
        with self._lock:
            return {ns: n for ns, n in self._unpublished.items() if ns not in self._held}

    def published(self, ns: str | None, count: int) -> None:
        """``count`` invalidations of the namespace (None: clears) are out."""
        with self._lock:
            left = self._unpublished[ns] - count
            if left > 0:
                self._unpublished[ns] = left
            else:
                self._unpublished.pop(ns, None)

    def advance(self, ns: str, epoch: int, generation: int, lifetime: int) -> None:
        """Move to (at least) these, learned in ``lifetime``; never back (nor into a
        lifetime that has ended)."""
        with self._lock:
            if lifetime != self.lifetime:
                return
            self._epoch = max(self._epoch, epoch)
            if generation > self._generations.get(ns, 0):
                self._generations[ns] = generation
                self._generations.move_to_end(ns)
                if len(self._generations) > _MAX_NAMESPACES:
                    self._generations.popitem(last=False)

    def _asked(self, names: Sequence[str], asked_at: float, lifetime: int) -> None:
        with self._lock:
            if lifetime != self.lifetime:
                return
            if len(self._asked_at) > _MAX_NAMESPACES:
                self._asked_at.clear()  # forgotten: asked again, at most once each
            self._asked_at.update(dict.fromkeys(names, asked_at))

    def boot_of(self, lifetime: int) -> str | None:
        """The boot id of the master of ``lifetime``: None once that lifetime ended (or
        while its boot id is not known)."""
        with self._lock:
            return self.boot if lifetime == self.lifetime else None

    def blocks(self, boot: str, ns: str, epoch: int, generation: int,
               digests: Sequence[bytes]) -> list[str]:
        head = f"{self.root}/{boot}/{ns}/{epoch}.{generation}/"
        return [head + d.hex() for d in digests]

    def views_of(self, asked: Sequence[Sequence[str]], lifetime: int
                 ) -> list[tuple[int, int, int] | None]:
        """Per group of block keys (:meth:`blocks`' of one namespace), the (lifetime,
        epoch, generation) they are of, ``lifetime`` the one they were asked in (None
        for an empty group)."""
        views: list[tuple[int, int, int] | None] = []
        for group in asked:
            if not group:
                views.append(None)
                continue
            epoch, generation = group[0].rsplit("/", 2)[1].split(".")
            views.append((lifetime, int(epoch), int(generation)))
        return views

    def ask(self, items: Sequence[tuple[str, Sequence[bytes]]]) -> tuple[
            list[str], list[list[str]], Callable[[Sequence[int]], Moved | None]]:
        """What a lookup of (namespace, digests) items asks Mooncake (the boot id known):
        the markers past what this host knows (the boot id's, the epoch's, then each
        namespace's), the items' block keys under the newest epoch and generation known,
        and ``advance(answers)``: given whether each marker is there (1) or not, move
        past the markers found; whether the keys asked are stale (ask again) and which
        counters had all their ``PROBE`` markers there (:class:`Moved`), or None where
        the boot id's key is gone (the master may have restarted)."""
        names = sorted({ns for ns, _ in items})
        asked_at = time.monotonic()
        with self._lock:
            boot, lifetime, epoch = self.boot, self.lifetime, self._epoch
            current = {ns: self._generations.get(ns, 0) for ns in names}
        if boot is None:
            raise RuntimeError("the boot id is asked for before it is known")
        probes = [self.alive(boot)] + [self.cleared(epoch + i) for i in range(PROBE)]
        for ns in names:
            probes += [self.evicted(ns, current[ns] + i) for i in range(PROBE)]
        asked = [self.blocks(boot, ns, epoch, current[ns], digests) for ns, digests in items]

        def advance(found: Sequence[int]) -> Moved | None:
            if found[0] != 1:
                return None
            cleared = leading_ones(found[1 : PROBE + 1])
            moved = Moved(bool(cleared), [None] if cleared == PROBE else [])
            for i, ns in enumerate(names, start=1):
                evicted = leading_ones(found[PROBE * i + 1 : PROBE * (i + 1) + 1])
                self.advance(ns, epoch + cleared, current[ns] + evicted, lifetime)
                moved.stale = moved.stale or bool(evicted)
                if evicted == PROBE:
                    moved.behind.append(ns)
            if not names:
                self.advance("", epoch + cleared, 0, lifetime)
            if not moved.stale:  # else asked again (settle): its answer tells
                self._asked(names, asked_at, lifetime)
            return moved

        return probes, asked, advance

    def boot_key(self) -> str:
        return f"{self.root}/boot"

    def alive(self, boot: str) -> str:
        return f"{self.root}/boot/{boot}"

    def cleared(self, epoch: int) -> str:
        return f"{self.root}/cleared/{epoch}"

    def evicted(self, ns: str, generation: int) -> str:
        return f"{self.root}/{ns}/evicted/{generation}"

    def generation_pattern(self, ns: str, generation: int) -> str:
        """The namespace's blocks of this generation, under any epoch (not its markers),
        and any boot id (another's are a late write's that nobody reads)."""
        return f"^{self.root}/[^/]+/{ns}/[0-9]+\\.{generation}/"

    def epoch_pattern(self, epoch: int) -> str:
        """Every namespace's blocks of this epoch, any generation and boot id (not the
        markers)."""
        return f"^{self.root}/[^/]+/[0-9a-f]{{32}}/{epoch}\\.[0-9]+/"

    def boot_pattern(self, boot: str) -> str:
        """Every block under this boot id (not the markers): a master's that restarted
        since, where a write that crossed the restart lands unread."""
        return f"^{self.root}/{re.escape(boot)}/"

    def either(self, patterns: Sequence[str]) -> str:
        """One pattern for what any of these (:meth:`generation_pattern`,
        :meth:`epoch_pattern`, :meth:`boot_pattern`) matches, and nothing else: their
        shared ``^<root>/`` once. The master tries each alternative at each character of
        each key it holds, so ``^root/a|^root/b`` costs about a scan per pattern,
        ``^root/(?:a|b)`` one."""
        head = f"^{self.root}/"
        if len(patterns) == 1:
            return patterns[0]
        # A pattern of another shape keeps its ``^`` inside the group: it matches nothing.
        return head + "(?:" + "|".join(p.removeprefix(head) for p in patterns) + ")"


@dataclass
class Moved:
    """What a lookup's markers told (:meth:`Keys.ask`): whether the keys asked are stale
    (ask again), and the counters (None: the epoch; else a namespace) whose ``PROBE``
    markers all were there: the host may be any number behind (it started after many
    invalidations), which :meth:`.markers.Markers.settle` then catches up in a few calls."""

    stale: bool
    behind: list[str | None]


def leading_ones(codes: Sequence[int]) -> int:
    """How many of the codes lead with 1 (there)."""
    for i, code in enumerate(codes):
        if code != 1:
            return i
    return len(codes)
