"""Which callers' CUDA events a batch waits for (aiokv.requests.latest_ready_events)."""

from __future__ import annotations

import asyncio

from aiokv.requests import Kind, Request, latest_ready_events


def request(stream: int, order: int, event: str | None) -> Request:
    loop = asyncio.new_event_loop()
    try:
        r = Request(Kind.OFFLOAD, "u", loop.create_future(), 16, None, ("u",), None, 1)
    finally:
        loop.close()
    r.ready_event, r.ready_stream, r.ready_order = event, stream, order
    return r


def test_one_event_per_stream_the_latest_recorded_not_the_last_listed() -> None:
    batch = [
        request(stream=1, order=5, event="s1-late"),  # queued first, recorded last
        request(stream=1, order=2, event="s1-early"),
        request(stream=2, order=3, event="s2"),
        request(stream=0, order=0, event=None),  # caches on the CPU: no event
        request(stream=1, order=4, event="s1-middle"),
    ]
    assert sorted(latest_ready_events(batch)) == ["s1-late", "s2"]


def test_no_events_without_a_gpu() -> None:
    assert latest_ready_events([request(0, 0, None), request(0, 0, None)]) == []
