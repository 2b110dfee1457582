"""FlexKVStore's wait for readiness in FlexKV's server-client mode, against fakes of the
pieces it touches (the manager, its reply socket, zmq), so it runs without FlexKV."""

from __future__ import annotations

import sys
import types
from collections import deque
from typing import Any

import pytest

import aiokv
from aiokv.stores.flexkv import FlexKVStore


class Again(Exception):
    """Stands in for zmq.Again: no reply within RCVTIMEO."""


@pytest.fixture
def fake_zmq(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("zmq")
    module.Again = Again  # type: ignore[attr-defined]
    module.RCVTIMEO = 27  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "zmq", module)


class Reply:
    def __init__(self, is_ready: bool) -> None:
        self.is_ready = is_ready


class Socket:
    """A PULL socket: replies arrive in order; ``late`` receives time out before a reply
    that is due shows up."""

    def __init__(self, late: int) -> None:
        self.due: deque[Reply] = deque()
        self.late = late
        self.timeouts: list[int] = []

    def setsockopt(self, option: int, value: int) -> None:
        self.timeouts.append(value)

    def recv_pyobj(self) -> Reply:
        if self.late:
            self.late -= 1
            raise Again()
        return self.due.popleft()


class Manager:
    """is_ready() as FlexKV's client does it: send a request, then block on its reply."""

    def __init__(self, socket: Socket, answers: list[bool], exit_code: int | None = None):
        self.dp_client = types.SimpleNamespace(recv_from_server=socket)
        self.answers = deque(answers)
        self.asked = 0
        self.server_handle = types.SimpleNamespace(process=types.SimpleNamespace(
            poll=lambda: exit_code))

    def is_ready(self) -> Any:
        self.asked += 1
        self.dp_client.recv_from_server.due.append(Reply(self.answers.popleft()))
        return self.dp_client.recv_from_server.recv_pyobj().is_ready


def store(timeout_s: float = 5.0) -> FlexKVStore:
    return FlexKVStore(aiokv.StoreConfig(backend="flexkv"), ready_timeout_s=timeout_s)


@pytest.mark.usefixtures("fake_zmq")
def test_a_late_reply_is_taken_before_asking_again() -> None:
    socket = Socket(late=3)  # the first reply is three bounded waits late
    manager = Manager(socket, [False, True])
    store()._wait_ready(manager)
    # Asked twice: once, then again only after the late "not ready" came in; nothing is
    # left on the socket for the first put_match to read by mistake.
    assert manager.asked == 2
    assert not socket.due
    assert socket.timeouts == [1000, -1]  # bounded while waiting, FlexKV's own after


@pytest.mark.usefixtures("fake_zmq")
def test_a_dead_server_fails_registration_instead_of_hanging() -> None:
    manager = Manager(Socket(late=10**9), [False], exit_code=1)
    with pytest.raises(aiokv.StoreError, match="exited with code 1"):
        store()._wait_ready(manager)
    assert manager.dp_client.recv_from_server.timeouts == [1000, -1]


@pytest.mark.usefixtures("fake_zmq")
def test_a_server_that_never_answers_fails_at_the_deadline() -> None:
    manager = Manager(Socket(late=10**9), [False])
    with pytest.raises(aiokv.StoreError, match="not ready"):
        store(timeout_s=0.05)._wait_ready(manager)
    assert manager.asked == 1  # never asked again while a reply was outstanding
