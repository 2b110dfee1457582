"""Which CUDA events the callers' submits get, when they are recorded, and which a batch
waits for (aiokv.cuda.ReadyMarks), with fake streams and events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from aiokv.config import EngineConfig
from aiokv.cuda import ReadyMarks
from aiokv.loop.batcher import Batcher
from aiokv.requests import Kind, Request


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
    fail: bool = False

    def record(self, stream: FakeStream) -> None:
        if self.fail:
            raise RuntimeError("invalid resource handle")
        self.records.append(stream.cuda_stream)


class Rig:
    """ReadyMarks with fakes; ``soon`` holds the callbacks it scheduled on the 'loop'."""

    def __init__(self) -> None:
        self.stream = FakeStream(1)
        self.created: list[FakeEvent] = []
        self.soon: list[Callable[[], None]] = []
        self.synchronized = 0
        self.marks = ReadyMarks(
            torch.device("cpu"),
            self.soon.append,
            self._new_event,
            lambda device: self.stream,
            self._synchronize,
        )

    def _new_event(self) -> FakeEvent:
        self.created.append(FakeEvent())
        return self.created[-1]

    def _synchronize(self, device: torch.device) -> None:
        self.synchronized += 1

    def submit(self, stream: int) -> Request:
        self.stream = FakeStream(stream)
        r = request()
        self.marks.mark(r)
        return r

    def next_iteration(self) -> None:
        callbacks, self.soon[:] = list(self.soon), []
        for callback in callbacks:
            callback()


def test_submits_record_nothing_until_the_iteration_ends_then_one_per_stream() -> None:
    rig = Rig()
    window = [rig.submit(1), rig.submit(2), rig.submit(1), rig.submit(1)]
    assert len(rig.created) == 2  # streams 1 and 2, not one per request
    assert all(not e.records for e in rig.created)  # no CUDA call (nor GIL release) yet
    assert len(rig.soon) == 1  # one callback for the iteration, not one per submit
    rig.next_iteration()
    on_one, on_two = rig.created
    assert on_one.records == [1] and on_two.records == [2]  # once each, after all submits
    assert all(r.ready_event is on_one for r in (window[0], window[2], window[3]))
    # The next iteration's submits on the same window re-record the same event.
    later = rig.submit(1)
    rig.next_iteration()
    assert later.ready_event is on_one and on_one.records == [1, 1]


def test_closing_a_window_records_its_events_and_the_next_window_gets_new_ones() -> None:
    rig = Rig()
    first = rig.submit(1)
    rig.marks.close_window()  # before the iteration's callback: the batch is fused now
    assert first.ready_event.records == [1]
    second = rig.submit(1)
    # The first batch must not wait for the second window's submits (the callers' next
    # kernels may run between them).
    assert first.ready_event is not second.ready_event
    rig.next_iteration()
    assert first.ready_event.records == [1]
    assert second.ready_event.records == [1]


def test_a_failed_record_synchronizes_the_device_instead() -> None:
    rig = Rig()
    gone = rig.submit(7)
    gone.ready_event.fail = True
    fine = rig.submit(1)
    rig.next_iteration()  # must not raise into the loop
    assert rig.synchronized == 1
    assert fine.ready_event.records == [1]


def test_a_launch_waits_for_each_distinct_event_once_and_none_without_a_gpu() -> None:
    from aiokv.copy.fused import wait_ready

    rig = Rig()
    on_one, on_two, again, plain = rig.submit(1), rig.submit(2), rig.submit(1), request()
    events = [r.ready_event for r in (on_one, plain, again, on_two)]

    class Stream:
        def __init__(self) -> None:
            self.waited: list[object] = []

        def wait_event(self, event: object) -> None:
            self.waited.append(event)

    stream = Stream()
    # First-seen order, one wait per event, none for a request without one.
    assert wait_ready(events, stream) == [on_one.ready_event, on_two.ready_event]
    assert stream.waited == [on_one.ready_event, on_two.ready_event]
    assert wait_ready([None, None], stream) == [] and len(stream.waited) == 2


@pytest.mark.asyncio
async def test_the_batcher_closes_the_window_before_it_fuses_a_batch() -> None:
    order: list[str] = []
    batcher = Batcher(
        EngineConfig(window_us=0, max_batch_requests=2),
        submit=lambda batch: order.append(f"submit {len(batch.requests)}"),
        on_dropped=lambda r: None,
        on_batch=lambda batch: order.append("fused"),
        on_failed=lambda requests, exc: order.append(f"failed {exc!r}"),
        on_window_closed=lambda: order.append("window closed"),
    )
    loop = asyncio.get_running_loop()
    for _ in range(2):  # fills the batch: planned and dispatched from enqueue
        batcher.enqueue(
            Request(Kind.LOOKUP, "u", loop.create_future(), 16, None, ("u",), None, 0)
        )
    assert order == ["window closed", "fused", "submit 2"]


@pytest.mark.asyncio
async def test_a_window_emptied_by_a_full_batch_is_not_closed_again() -> None:
    closed: list[int] = []
    batcher = Batcher(
        EngineConfig(window_us=0, max_batch_requests=2),
        submit=lambda batch: None,
        on_dropped=lambda r: None,
        on_batch=lambda batch: None,
        on_failed=lambda requests, exc: None,
        on_window_closed=lambda: closed.append(1),
    )
    task = asyncio.get_running_loop().create_task(batcher.run())
    loop = asyncio.get_running_loop()
    batcher.enqueue(Request(Kind.LOOKUP, "u", loop.create_future(), 16, None, ("u",), None, 0))
    await asyncio.sleep(0)  # the batcher wakes and waits one iteration for more
    batcher.enqueue(Request(Kind.LOOKUP, "u", loop.create_future(), 16, None, ("u",), None, 0))
    for _ in range(5):
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert len(closed) == 1  # the full batch's window, once (the events map kept)


def test_current_streams_builds_one_object_per_stream_and_asks_torch_each_time() -> None:
    from aiokv.cuda import CurrentStreams

    current = [(11, 0, 1)]
    built: list[dict[str, int]] = []
    streams = CurrentStreams(lambda index: current[0], lambda **key: built.append(key) or key)
    cuda0 = torch.device("cuda", 0)
    first = streams(cuda0)
    assert streams(cuda0) is first  # the same stream: the object is handed out again
    current[0] = (12, 0, 1)  # the caller switched streams (torch.cuda.stream(...))
    second = streams(cuda0)
    assert second == {"stream_id": 12, "device_index": 0, "device_type": 1}
    current[0] = (11, 0, 1)
    assert streams(cuda0) is first
    assert built == [first, second]


def test_current_streams_stops_keeping_objects_past_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiokv.cuda import CurrentStreams

    monkeypatch.setattr(CurrentStreams, "_MAX_STREAMS", 2)
    current = [(0, 0, 1)]
    streams = CurrentStreams(lambda index: current[0], lambda **key: dict(key))
    for stream_id in range(5):
        current[0] = (stream_id, 0, 1)
        streams(torch.device("cuda", 0))
    assert len(streams._streams) == 2
    kept = streams(torch.device("cuda", 0))  # stream 4: built again, not kept
    assert kept is not streams(torch.device("cuda", 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_current_streams_matches_torch_on_every_stream() -> None:
    from aiokv.cuda import CurrentStreams

    streams = CurrentStreams()
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    assert streams(device) == torch.cuda.current_stream(device)
    with torch.cuda.stream(side):
        assert streams(device) == side == torch.cuda.current_stream(device)
        assert streams(device).cuda_stream == side.cuda_stream
    assert streams(device) == torch.cuda.default_stream(device)
