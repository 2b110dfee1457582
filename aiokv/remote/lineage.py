"""Which Mooncake master this host's SSD pages from earlier runs were written under,
kept beside them (a file in the SSD tier's first directory).

Pages of no known view (:mod:`.views`), such as an earlier run's SSD blocks, join only
reads of a key's first generation and epoch: no evict or clear the master knows of has
ended them. A master that restarted knows of none from before, so that holds only where
the pages were written while the master of now lived. The file names the boot id
(:mod:`.keys`) of the master current when the SSD tier opened holding nothing; a restart
changes the boot id for good, so where it still names the master of now, every page on
the SSD was written during that master's life (by whichever run). An SSD that held pages
at open under another boot id (or none) keeps its file: its earlier pages never join. So
does one that took pages this run while the host, cut off, had reached no master yet:
those may be of a master that restarted before the one it reached first.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..stores.local.ssd_format import replace_durably

log = logging.getLogger("aiokv")

NAME = "remote-master"


class SsdLineage:
    """``directory``: where the file is; ``held``: whether the SSD tier held pages at
    open (else every page it will hold is of this run)."""

    def __init__(self, directory: Path, held: bool) -> None:
        self._directory = directory
        self._held = held
        try:
            self._recorded: str | None = (directory / NAME).read_text()
        except (OSError, UnicodeDecodeError):
            self._recorded = None

    def joins(self, boot: str, blind: bool = False) -> bool:
        """The master of this run's first lifetime is ``boot``: whether the SSD's pages
        from earlier runs may join its reads (its keys' first generation). An SSD that
        held none records ``boot`` for the runs after this one. ``blind``: this run put
        pages, cut off, before it learned ``boot``: of no known master, as an earlier
        run's are (none restarted meanwhile only where the SSD recorded ``boot``)."""
        if self._held or blind:
            return self._recorded == boot
        if self._recorded != boot:
            try:
                replace_durably(self._directory, NAME, boot.encode())
            except OSError as exc:  # the old name stays: never a boot id again, no join
                log.warning("aiokv: remote tier: cannot record the master's boot id in "
                            "%s: %s", self._directory, exc)
            self._recorded = boot
        return True
