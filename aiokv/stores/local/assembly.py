"""The parts of a registered :class:`~aiokv.stores.local.store.LocalStore`, built from its
config and the caches: the host pool and tier, the SSD link (``ssd_cache_gb``), a copier
(:mod:`aiokv.copy.copier`) per direction on a GPU (one on the CPU) and the remote tier
(``store.remote``). What was
built is closed again when a later part fails, so a failed ``register`` leaves nothing
pinned, locked or running."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...config import StoreConfig
from ...copy.copier import Copier
from ...copy.ids import OffloadsInFlight
from ...remote.config import RemoteConfig
from ...remote.link import RemoteLink
from .blocks import Tier
from .completion import TaskEnds
from .jobs import CopyJobs
from .pool import HostPool
from .tiering import TierLink


@dataclass(slots=True)
class Parts:
    pool: HostPool
    host: Tier
    link: TierLink | None  # the SSD tier's, None without one
    jobs: CopyJobs
    remote: RemoteLink | None


def build(
    config: StoreConfig,
    kv_caches: Sequence[torch.Tensor],
    page_size: int,
    wake: Callable[[], None],
    ends: TaskEnds,
) -> Parts:
    first = kv_caches[0]
    # A remote tier's values are a block and its checksum in one range: room after each.
    pool = HostPool.for_caches(kv_caches, config.cpu_cache_gb,
                               trailer=config.remote is not None)
    link: TierLink | None = None
    copiers: list[Copier] = []
    try:
        pool.memory.wait_first()  # the rest is pinned while the store serves
        if first.device.type == "cuda":
            # A copier per direction: a GPU copies both ways at once (a copy engine
            # each), so offloads and loads in flight together do not queue behind
            # each other; each knows of the other's offloads (how its ids come over).
            offloads = OffloadsInFlight()
            for name in ("aiokv-copy-out", "aiokv-copy-in"):
                copiers.append(Copier(kv_caches, pool.data, ends.job_done, name,
                                      chunk_starts=pool.memory.chunk_starts,
                                      offloads=offloads))
        else:
            copiers.append(Copier(kv_caches, pool.data, ends.job_done))
        jobs = CopyJobs(copiers, ends)
        if config.ssd_cache_gb > 0:
            link = TierLink(config, pool, first.dtype, page_size, wake, jobs.chunk,
                            ends.end_tasks)
        host = link.host if link is not None else Tier("host", pool)
        remote = None
        if config.remote is not None:  # last: nothing after it can fail
            remote = RemoteLink(RemoteConfig.from_mapping(config.remote), host, pool,
                                first.dtype, page_size, wake,
                                None if link is None else link.ssd)
    except BaseException:
        for copier in copiers:
            copier.close()
        if link is not None:
            link.close()
        pool.close()
        raise
    return Parts(pool, host, link, jobs, remote)
