"""Where a host block's bytes are: the host tier's memory (a private pool's mapping, or
the store server's shared region) holds block ``b`` at byte ``b * block_stride``, each
block's bytes contiguous (``[layer, k/v, token, head, dim]``).

With a remote tier a block is followed by a trailer where its checksum goes, so that a
value (the block, then its checksum: :mod:`aiokv.remote.values`) is one range of
registered memory and Mooncake moves it as one slice; a second slice a value cost
Mooncake about as much as the checksum's bytes were worth in time at 512 KiB, and more
at smaller blocks (benchmarks/RESULTS.md). Without one, blocks are back to back.
"""

from __future__ import annotations

import torch

ALIGN = 4096  # O_DIRECT's buffer and length alignment on the filesystems we meet
TRAILER_BYTES = 8  # a remote value's checksum (aiokv.remote.values), right after its block
_TRAILER_ALIGN = 64  # where a trailer keeps a stride off 4 KiB: a cache line


def block_stride(block_bytes: int, trailer: bool) -> int:
    """Bytes from one host block to the next: the block, and with ``trailer`` room for
    ``TRAILER_BYTES`` after it. A block of whole 4 KiB pages keeps a 4 KiB stride (the
    SSD tier's O_DIRECT) where that wastes at most 1/64 of it; smaller blocks round to
    a cache line instead, and the SSD tier moves them buffered."""
    if not trailer:
        return block_bytes
    if block_bytes % ALIGN == 0 and block_bytes >= 64 * ALIGN:
        return block_bytes + ALIGN
    return -(-(block_bytes + TRAILER_BYTES) // _TRAILER_ALIGN) * _TRAILER_ALIGN


def block_text(block_bytes: int, stride: int) -> str:
    """A host block's size as a message says it: with a trailer, what the block takes
    with it (cpu_cache_gb holds that many bytes a block)."""
    if stride == block_bytes:
        return f"{block_bytes} bytes"
    return f"{stride} bytes (a block of {block_bytes} and room for its remote checksum)"


def strided_blocks(raw: torch.Tensor, num_blocks: int, block_shape: tuple[int, ...],
                   dtype: torch.dtype, stride: int) -> torch.Tensor:
    """``[block, *block_shape]`` of ``dtype`` over the bytes ``raw``, block ``b`` at
    byte ``b * stride`` (each block contiguous)."""
    block = torch.empty(block_shape, dtype=dtype, device="meta")  # its strides, no memory
    typed = raw[: num_blocks * stride].view(dtype)
    return typed.as_strided((num_blocks, *block_shape),
                            (stride // block.element_size(), *block.stride()))
