"""FlexKV's registration client (its KVTPClient) holds pyzmq sockets. Left to the garbage
collector, a zmq context with a message its peer never took waits in ``term()`` forever,
in whichever thread collects: aiokv closes them itself once its FlexKV is gone. Runs
without FlexKV: the client is a stand-in with the same two sockets."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("zmq", reason="pyzmq (the dev extra) is not installed")

# A client whose registration was never taken (its FlexKV died at start-up), in a
# reference cycle, as a failed start's traceback leaves it: freed by a collection.
SCRIPT = textwrap.dedent(
    """
    import gc, sys, tempfile, zmq
    from aiokv.stores.flexkv.handover import HANDOVER
    from aiokv.stores.flexkv.setup import close_client

    class KVTPClient:
        def __init__(self):
            context = zmq.Context(2)
            self.send_to_server = context.socket(zmq.PUSH)
            self.send_to_server.connect(f"ipc://{tempfile.mktemp()}")  # nobody binds
            self.send_to_server.send(b"registration")
            self.gpu_control_socket = context.socket(zmq.REQ)
            self.cycle = self

    client = KVTPClient()
    {release}
    del client
    gc.collect()
    print("collected", flush=True)
    """
)


def collect(release: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.replace("{release}", release)],
        capture_output=True, text=True, timeout=30,
    )


@pytest.mark.parametrize("release", ["close_client(client)", "HANDOVER.detach(client)"])
def test_a_released_client_leaves_nothing_for_the_collector_to_hang_on(release: str) -> None:
    done = collect(release)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "collected"


def test_close_client_of_none_does_nothing() -> None:  # shut down before it attached
    from aiokv.stores.flexkv.setup import close_client

    close_client(None)
