"""Pinning a host tier: one pinned allocation against HostMemory's chunks, side by side.

    python benchmarks/host_pinning.py [--gib 16] [--threads 16] [--json FILE]

Prints, from one run on one machine: the seconds of one ``torch.empty(n,
pin_memory=True)``; HostMemory's seconds to its first chunk and to the whole mapping; and
the copy bandwidth of a 512 MiB device-to-host and host-to-device copy into each, with the
HostMemory copy spanning chunk boundaries (a copy across two registrations must run at the
pinned rate, or the chunks would cost every transfer).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from aiokv.stores.local.hostmem import HostMemory

_BLOCK = 1 << 20


def _copy_gib_s(host: torch.Tensor, device: torch.Tensor) -> tuple[float, float]:
    """GiB/s of one device-to-host and one host-to-device copy of ``device``'s size."""
    rates = []
    for direction in ("d2h", "h2d"):
        best = 0.0
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            if direction == "d2h":
                host.copy_(device, non_blocking=True)
            else:
                device.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            best = max(best, device.numel() / (time.perf_counter() - start) / (1 << 30))
        rates.append(best)
    return rates[0], rates[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_pinning needs a CUDA device")
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context, outside every timing
    nbytes = int(args.gib * (1 << 30)) // _BLOCK * _BLOCK
    device = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")

    start = time.perf_counter()
    plain = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    plain_s = time.perf_counter() - start
    plain_d2h, plain_h2d = _copy_gib_s(plain[: device.numel()], device)
    del plain
    torch._C._host_emptyCache()  # give the plain buffer back before the next one

    start = time.perf_counter()
    memory = HostMemory(nbytes // _BLOCK, (_BLOCK,), torch.uint8, pin=True, threads=args.threads)
    memory.start()
    memory.wait_first()
    first_s = time.perf_counter() - start
    memory.wait_all()
    all_s = time.perf_counter() - start
    print(f"plain pinned {plain_s:.2f} s; chunked first {first_s:.3f} s, all {all_s:.2f} s")
    flat = memory.data.view(-1)
    # Inside one chunk (the fifth starts at 960 MiB and holds 1 GiB), then across two.
    inside = 960 << 20
    chunk_d2h, chunk_h2d = _copy_gib_s(flat[inside : inside + device.numel()], device)
    across = inside - (device.numel() // 2)
    try:
        _copy_gib_s(flat[across : across + device.numel()], device)
        across_error = ""
    except Exception as exc:  # what CUDA says of a copy across two registrations
        across_error = repr(exc).splitlines()[0]
        torch.cuda.synchronize()
    memory.close()

    result = {
        "gib": nbytes / (1 << 30),
        "threads": args.threads,
        "plain_pinned_s": plain_s,
        "chunked_first_s": first_s,
        "chunked_all_s": all_s,
        "ratio_all_to_plain": all_s / plain_s,
        "plain_d2h_gib_s": plain_d2h,
        "plain_h2d_gib_s": plain_h2d,
        "chunked_d2h_gib_s": chunk_d2h,
        "chunked_h2d_gib_s": chunk_h2d,
        "pinned_gib": memory.ready_blocks * _BLOCK / (1 << 30),
        "copy_across_chunks_error": across_error,
    }
    print(
        f"{result['gib']:.1f} GiB: plain pinned {plain_s:.2f} s | chunked first "
        f"{first_s:.3f} s, all {all_s:.2f} s ({result['ratio_all_to_plain']:.2f}x plain) | "
        f"copies GiB/s plain d2h {plain_d2h:.1f} h2d {plain_h2d:.1f}, across chunks d2h "
        f"{chunk_d2h:.1f} h2d {chunk_h2d:.1f}; across two: {across_error or 'ok'}"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
