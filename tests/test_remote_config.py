"""store.remote in the config: what it accepts, and a ConfigError naming the key for
what it does not (no Mooncake needed)."""

from __future__ import annotations

from typing import Any

import pytest

import aiokv
from aiokv.config import parse_config
from aiokv.remote import RemoteConfig


def test_the_yaml_section_needs_only_the_master() -> None:
    _, store = parse_config({"store": {"remote": {"backend": "mooncake",
                                                  "master": "10.0.0.5:50051"}}})
    assert store.remote == RemoteConfig(master="10.0.0.5:50051")
    assert store.remote.metadata == "P2PHANDSHAKE" and store.remote.protocol == "tcp"
    assert parse_config({"store": {}})[1].remote is None


@pytest.mark.parametrize(
    ("remote", "key", "bad"),
    [
        ({}, "store.remote.master", "required"),
        ({"master": "no-port"}, "store.remote.master", "no-port"),
        ({"master": "h:70000"}, "store.remote.master", "h:70000"),
        # Digits to str.isdigit(), not to a port: int() refused the first, read 12 for the last.
        ({"master": "10.0.0.1:\u00b2"}, "store.remote.master", "10.0.0.1:\u00b2"),
        ({"master": "h:8\u00b9"}, "store.remote.master", "h:8\u00b9"),
        ({"master": "h:\u0661\u0662"}, "store.remote.master", "h:\u0661\u0662"),
        ({"master": "h:1", "metadata": "somewhere"}, "store.remote.metadata", "somewhere"),
        ({"master": "h:1", "protocol": "udp"}, "store.remote.protocol", "udp"),
        ({"master": "h:1", "backend": "redis"}, "store.remote.backend", "redis"),
        ({"master": "h:1", "timeout_ms": 0}, "store.remote.timeout_ms", "0"),
        ({"master": "h:1", "write_queue_blocks": True}, "store.remote.write_queue_blocks",
         "True"),
        ({"master": "h:1", "checksum_threads": 0}, "store.remote.checksum_threads", "0"),
        # Past this a wait of timeout_ms overflows the platform's timeouts deep in a thread.
        ({"master": "h:1", "timeout_ms": 10**13}, "store.remote.timeout_ms", "14 digits"),
        ({"master": "h:1", "local_buffer_mb": 10**30}, "store.remote.local_buffer_mb",
         "31 digits"),
        ({"master": "h:1", "masters": "h:2"}, "store.remote.masters", "unknown key"),
        ("h:1", "store.remote", "mapping"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_the_key(remote: Any, key: str, bad: str) -> None:
    with pytest.raises(aiokv.ConfigError) as caught:
        aiokv.StoreConfig(remote=remote)
    assert str(caught.value).startswith(f"{key}:") and bad in str(caught.value)


def test_a_metadata_url_and_rdma_are_accepted() -> None:
    remote = RemoteConfig(master="h:1", metadata="http://h:8080/metadata", protocol="rdma",
                          devices="mlx5_0,mlx5_1")
    assert aiokv.StoreConfig(remote=remote).remote == remote


def test_flexkv_refuses_the_remote_tier_saying_why() -> None:
    with pytest.raises(aiokv.ConfigError) as caught:
        aiokv.StoreConfig(backend="flexkv", remote={"master": "h:1"})
    message = str(caught.value)
    assert message.startswith("store.remote:") and "RDMA" in message and "P2P" in message
