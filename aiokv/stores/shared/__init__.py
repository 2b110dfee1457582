"""One host's store shared by its serving processes: ``aiokv store-server``
(:mod:`.server`, over :mod:`.service`) owns the index, the host tier as a shared region
(:mod:`.region`) and the SSD tier; engines use it through :class:`SharedStore`
(``store.backend: shared``), copying their own pages on the embedded store's data plane
(:mod:`.plane`); :mod:`.wire` is what crosses the socket, :mod:`.sockets` how."""

from .client import SharedStore

__all__ = ["SharedStore"]
