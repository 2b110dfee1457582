"""On a GPU: the remote tier over CUDA caches, whose host pool keeps a checksum's room
after each block (pinned in chunks of that stride, copied to and from with that pitch).
A host's own host-tier hit and another host's load from Mooncake are both the user's KV
bit for bit. Skipped without CUDA or without Mooncake's client."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_mooncake
from remote_host import HEAD_DIM
from remote_local import TOKENS, LocalHost

from aiokv.remote.servers import MooncakeServers

FRESH_MS = 20_000  # a fresh host's first lookup waits for its connect (test_remote_tier's)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    needs_mooncake(),
]


# 64-byte room after blocks of 1 KiB; 4 KiB after blocks of 512 KiB.
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 4096], ids=["small", "large"])
def test_cuda_caches_go_to_mooncake_and_back_bit_exact(
    mooncake: MooncakeServers, head_dim: int
) -> None:
    user = 700 + head_dim
    a = LocalHost(mooncake.master, head_dim=head_dim, device="cuda", cpu_cache_gb=0.1)
    try:
        a.offload_to_mooncake(user)
        assert a.load(user) == (TOKENS, True)  # from A's host tier
    finally:
        a.close()
    b = LocalHost(mooncake.master, head_dim=head_dim, device="cuda", cpu_cache_gb=0.1,
                  timeout_ms=FRESH_MS)
    try:
        assert b.load(user) == (TOKENS, True)  # from Mooncake, through B's host tier
    finally:
        b.close()
    read = b.kv.stats()  # final once closed
    assert (read.remote_hits, read.remote_checksum_failures) == (1, 0)
