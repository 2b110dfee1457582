"""The remote tier: blocks below the host and SSD tiers, on Mooncake Store, shared by
hosts that agree on the cache geometry. ``store.remote`` in the config turns it on
(:mod:`.config`); :mod:`.keys` says how hosts agree on keys and :mod:`.markers` how they
learn each other's invalidations, :mod:`.client` does the I/O on threads of its own (the
client and its health in :mod:`.connection`, the writer thread in :mod:`.writer`),
:mod:`.link` is a store's side (the embedded store's or the store server's),
:mod:`.reads` its lookups' reads and markers (:mod:`.views` and :mod:`.lineage`: which
generation this host's own pages are of), :mod:`.servers` starts a master and a
store process (tests, benchmarks, one-machine setups). Importing this package does not
load Mooncake."""

from .config import RemoteConfig

__all__ = ["RemoteConfig"]
