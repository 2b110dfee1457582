"""FlexKVStore's slot mappings: a launch's page ids made into the host slots FlexKV takes.

One launch, one device-to-host copy: the tasks' page ids (views of the callers' device
tensors) are concatenated and expanded to slots (``page * page_size + offset``) on a
stream of this store's after the callers' ready events, and written into pinned host
memory (:func:`aiokv.copy.fused.fuse_page_ids`). The store thread waits for that copy,
checks every page id at once (out of range; a get's page twice) and cuts the slots per
task. The copier counts the copies (``store_stats``: ``d2h_copies``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...copy.fused import PageCopier, warm_up
from ..base import Int64Array


class SlotMaker:
    """Makes launches' slot mappings (store thread only)."""

    def __init__(self) -> None:
        self.num_pages = 0  # set by the store once it knows the caches' geometry
        self.copier = PageCopier()  # its d2h_copies are the store's

    def warm_up(self, device: torch.device, page_size: int) -> None:
        """Load the fused path's kernels now (registration), not in the first launches."""
        warm_up(device, page_size, self.copier.stream(device))

    def slots(
        self,
        pages: Sequence[torch.Tensor],
        ready: Sequence[Any],
        gets: Sequence[bool],
        page_size: int,
    ) -> tuple[list[Int64Array], dict[int, str]]:
        """Every task's slots (views of one host array, in task order) and {task index:
        error} for tasks with a bad page id (out of range, or a get's page twice), named
        as the caller gave it. Blocks until the one copy landed."""
        if len(gets) != len(pages):
            raise ValueError(f"{len(gets)} tasks for {len(pages)} page id tensors")
        fused, stream = self.copier.fuse(pages, ready, page_size)
        slots = fused.wait_slots(page_size)
        unique = [i for i, get in enumerate(gets) if get]
        errors = fused.page_errors(slots, self.num_pages, page_size, unique, _own_id(pages, stream))
        return fused.split(slots, page_size), errors


def _own_id(pages: Sequence[torch.Tensor], stream: Any) -> Callable[[int, int], int | None]:
    """A task's own page id at a position, for an error message only (the slots hold ids
    clamped into int64's range); None where the read fails. A device tensor is read on
    ``stream``, which already waited for the callers' events, not this thread's default
    stream, where the read would also wait for whatever the model queued since."""

    def own_id(index: int, position: int) -> int | None:
        try:
            with torch.cuda.stream(None if pages[index].is_cpu else stream):
                return int(pages[index][position])
        except Exception:
            return None

    return own_id
