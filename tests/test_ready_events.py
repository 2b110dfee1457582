"""Which CUDA events the callers' submits record, and which a batch waits for
(aiokv.requests.ReadyMarks and ready_events), with fake streams and events."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from aiokv.requests import Kind, ReadyMarks, Request, ready_events


def request() -> Request:
    loop = asyncio.new_event_loop()
    try:
        return Request(Kind.OFFLOAD, "u", loop.create_future(), 16, None, ("u",), None, 1)
    finally:
        loop.close()


@dataclass
class FakeStream:
    cuda_stream: int


@dataclass
class FakeEvent:
    records: list[int] = field(default_factory=list)  # the streams it was recorded on

    def record(self, stream: FakeStream) -> None:
        self.records.append(stream.cuda_stream)


class Rig:
    def __init__(self) -> None:
        self.windows = 0
        self.stream = FakeStream(1)
        self.created: list[FakeEvent] = []
        self.marks = ReadyMarks(
            torch.device("cpu"), lambda: self.windows, self._new_event, lambda device: self.stream
        )

    def _new_event(self) -> FakeEvent:
        self.created.append(FakeEvent())
        return self.created[-1]

    def submit(self, stream: int) -> Request:
        self.stream = FakeStream(stream)
        r = request()
        self.marks.mark(r)
        return r


def test_one_event_per_stream_per_window_recorded_at_every_submit() -> None:
    rig = Rig()
    window = [rig.submit(1), rig.submit(2), rig.submit(1), rig.submit(1)]
    assert len(rig.created) == 2  # streams 1 and 2, not one per request
    on_one = rig.created[0]
    assert on_one.records == [1, 1, 1]  # its latest record covers every submit before it
    assert all(r.ready_event is on_one for r in (window[0], window[2], window[3]))
    assert ready_events(window) == [on_one, rig.created[1]]


def test_a_new_window_gets_new_events() -> None:
    rig = Rig()
    first = rig.submit(1)
    rig.windows += 1  # the batcher closed the window: its batch may not be dispatched yet
    second = rig.submit(1)
    # The first batch must not wait for the second window's submits (the callers' next
    # kernels may run between them).
    assert first.ready_event is not second.ready_event
    assert first.ready_event.records == [1]
    assert ready_events([first, second]) == [first.ready_event, second.ready_event]


def test_no_events_without_a_gpu() -> None:
    assert ready_events([request(), request()]) == []
