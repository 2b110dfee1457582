"""``store.remote``: the remote tier's settings, validated where the config is read.

The embedded store honours them, and so does ``aiokv store-server`` for its engines (an
engine on ``backend: shared`` leaves them to the server). FlexKV has a Mooncake mode of
its own, but it needs RDMA and FlexKV's P2P build; aiokv does not drive it, and says so
(a ConfigError) rather than ignore the section.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from ..errors import ConfigError
from ..sections import MAX_INT, build_section, keys_checked

_SECTION = "store.remote"
P2P = "P2PHANDSHAKE"
FLEXKV_REFUSAL = (
    "the remote tier runs on the embedded store (backend: local); FlexKV's own Mooncake "
    "mode needs RDMA and FlexKV's P2P build, which aiokv does not drive: remove "
    "store.remote or use backend: local"
)


def _host_port(key: str, value: object) -> tuple[str, int]:
    if not isinstance(value, str) or value.count(":") < 1:
        raise ConfigError(key, f'must be "host:port", got {value!r}')
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    # ASCII digits only: isdigit() is true for '²' (int() refuses it) and for other
    # scripts' digits (int() reads '١٢' as 12), neither of which Mooncake takes.
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ConfigError(key, f'must be "host:port" with a port in 1..65535, got {value!r}')
    return host, int(port)


@keys_checked(_SECTION)
@dataclass(frozen=True)
class RemoteConfig:
    """The remote tier on Mooncake Store (``store.remote`` in YAML).

    backend: ``mooncake`` (the only one).
    master: the Mooncake master's ``"host:port"`` (required).
    metadata: ``P2PHANDSHAKE`` (no metadata server) or the metadata server's URL
        (``http://...``, ``etcd://...``, ``redis://...``).
    protocol: ``tcp`` (default) or ``rdma``; devices: RDMA device names, comma-separated
        (empty: Mooncake picks).
    local_hostname: the address this engine's transfer engine listens on; None: 127.0.0.1
        when the master is on loopback, else this host's address towards the master.
    local_buffer_mb: Mooncake's staging buffer for the few copies that are not zero-copy
        (the tier's own small records), in MiB.
    timeout_ms: the longest a lookup waits for Mooncake (a longer answer is a miss), and
        the pause after a failed call before the tier is tried again (doubling to 30 s).
    write_queue_blocks: background writes waiting at most; beyond, a write is dropped
        (counted) rather than wait. Writes queued or under way never hold more than a
        half the host tier's blocks either.
    checksum_threads: threads that hash a read's values (the reader among them;
        xxhash runs without the GIL); None: half the cores, at most 4. The writer hashes
        on its own thread, beside the put of the batch before.
    """

    backend: str = "mooncake"
    master: str = ""
    metadata: str = P2P
    protocol: str = "tcp"
    devices: str = ""
    local_hostname: str | None = None
    local_buffer_mb: int = 16
    timeout_ms: int = 500
    write_queue_blocks: int = 4096
    checksum_threads: int | None = None

    def __post_init__(self) -> None:
        if self.backend != "mooncake":
            raise ConfigError(f"{_SECTION}.backend", f"must be mooncake, got {self.backend!r}")
        if self.master == "":
            raise ConfigError(f"{_SECTION}.master", 'is required ("host:port" of the master)')
        _host_port(f"{_SECTION}.master", self.master)
        metadata = self.metadata
        if not isinstance(metadata, str) or not (metadata == P2P or "://" in metadata):
            raise ConfigError(
                f"{_SECTION}.metadata", f"must be {P2P} or a URL (http://, etcd://, ...), "
                f"got {metadata!r}"
            )
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"{_SECTION}.protocol", f"must be tcp or rdma, got {self.protocol!r}")
        if not isinstance(self.devices, str):
            raise ConfigError(f"{_SECTION}.devices", f"must be a string, got {self.devices!r}")
        if self.local_hostname is not None and (
            not isinstance(self.local_hostname, str) or not self.local_hostname
        ):
            raise ConfigError(
                f"{_SECTION}.local_hostname", f"must be a host name or null, got "
                f"{self.local_hostname!r}"
            )
        for key, minimum in (("local_buffer_mb", 1), ("timeout_ms", 1),
                             ("write_queue_blocks", 1), ("checksum_threads", 1)):
            value = getattr(self, key)
            if key == "checksum_threads" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"{_SECTION}.{key}", f"must be an integer >= {minimum}, "
                                  f"got {value!r}")
            if value > MAX_INT:  # a typed error, not an OverflowError in a tier's thread
                raise ConfigError(f"{_SECTION}.{key}", f"must be <= {MAX_INT}, got an "
                                  f"integer of {len(str(value))} digits")

    @property
    def threads_for_checksums(self) -> int:
        if self.checksum_threads is not None:
            return self.checksum_threads
        return max(1, min(4, (os.cpu_count() or 1) // 2))

    @property
    def master_address(self) -> tuple[str, int]:
        return _host_port(f"{_SECTION}.master", self.master)

    @property
    def master_host(self) -> str:
        return self.master_address[0]

    def on_loopback(self) -> bool:
        host = self.master_host
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    @classmethod
    def from_mapping(cls, raw: object) -> RemoteConfig:
        """From the YAML section; ConfigError naming ``store.remote.<key>``."""
        if isinstance(raw, RemoteConfig):
            return raw
        return build_section(cls, _SECTION, raw)
