"""Throwaway probe (2026-12-06): how long one Python thread takes to wake another, on
this host, when the woken thread has been idle (a lone batch's hops) or busy waiting.

    python benchmarks/results/wake_probe_1206.py [--idle-ms 2] [--reps 300]

Each row is the median and p90 of the one-way time, in µs, from the signal (stamped just
before it) to the first line of the woken thread, over ``--reps`` signals, each sent
``--idle-ms`` after the woken thread went back to waiting (so it sleeps, as the engine's
threads do between lone batches). Rows: threading.Event, queue.SimpleQueue, a concurrent
Future's result, asyncio's call_soon_threadsafe onto a loop thread; and the Event again
with the waiter spinning on ``is_set()`` (holding and dropping the GIL) instead of
sleeping.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import queue
import statistics
import threading
import time


def _summary(name: str, samples: list[float]) -> None:
    samples.sort()
    p90 = samples[int(0.9 * (len(samples) - 1))]
    print(f"{name:>28}: median {statistics.median(samples) * 1e6:7.1f} us, "
          f"p90 {p90 * 1e6:7.1f} us")


def event_row(reps: int, idle_s: float, spin: bool) -> list[float]:
    ping, pong = threading.Event(), threading.Event()
    sent = [0.0]
    out: list[float] = []

    def waiter() -> None:
        for _ in range(reps):
            if spin:
                while not ping.is_set():
                    pass
            else:
                ping.wait()
            out.append(time.perf_counter() - sent[0])
            ping.clear()
            pong.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    for _ in range(reps):
        time.sleep(idle_s)
        sent[0] = time.perf_counter()
        ping.set()
        pong.wait()
        pong.clear()
    thread.join()
    return out


def queue_row(reps: int, idle_s: float) -> list[float]:
    inbox: queue.SimpleQueue[float | None] = queue.SimpleQueue()
    back: queue.SimpleQueue[float] = queue.SimpleQueue()

    def waiter() -> None:
        while (stamp := inbox.get()) is not None:
            back.put(time.perf_counter() - stamp)

    thread = threading.Thread(target=waiter)
    thread.start()
    out = []
    for _ in range(reps):
        time.sleep(idle_s)
        inbox.put(time.perf_counter())
        out.append(back.get())
    inbox.put(None)
    thread.join()
    return out


def future_row(reps: int, idle_s: float) -> list[float]:
    out = []
    for _ in range(reps):
        future: concurrent.futures.Future[float] = concurrent.futures.Future()

        def setter(f: concurrent.futures.Future[float] = future) -> None:
            time.sleep(idle_s)
            f.set_result(time.perf_counter())

        thread = threading.Thread(target=setter)
        thread.start()
        stamp = future.result()
        out.append(time.perf_counter() - stamp)
        thread.join()
    return out


def loop_row(reps: int, idle_s: float) -> list[float]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    done = threading.Event()
    out: list[float] = []

    def on_loop(stamp: float) -> None:
        out.append(time.perf_counter() - stamp)
        done.set()

    for _ in range(reps):
        time.sleep(idle_s)
        loop.call_soon_threadsafe(on_loop, time.perf_counter())
        done.wait()
        done.clear()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--idle-ms", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    idle = args.idle_ms / 1e3
    print(f"one-way wake-ups after {args.idle_ms} ms idle, {args.reps} each:")
    _summary("threading.Event", event_row(args.reps, idle, spin=False))
    _summary("queue.SimpleQueue", queue_row(args.reps, idle))
    _summary("concurrent Future.result", future_row(args.reps, idle))
    _summary("call_soon_threadsafe", loop_row(args.reps, idle))
    _summary("Event, waiter spinning", event_row(args.reps, idle, spin=True))
    _summary("threading.Event, no idle", event_row(args.reps, 0.0, spin=False))


if __name__ == "__main__":
    main()
