"""The config dataclasses' keyword constructors refuse a key they do not have as the YAML
and mapping paths do: a ConfigError naming ``<section>.<key>`` and the keys there are (the
dataclass's own ``__init__`` raised a TypeError). They stay dataclasses: positional
arguments, equality, repr, ``dataclasses.replace`` and pickling work as before."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from collections.abc import Callable
from typing import Any

import pytest

import aiokv
from aiokv.config import parse_config
from aiokv.remote.config import RemoteConfig

REMOTE = {"master": "127.0.0.1:50051"}

# (class, its section, keywords it takes)
CLASSES: list[tuple[Callable[..., Any], str, dict[str, Any]]] = [
    (aiokv.EngineConfig, "engine", {"window_us": 0}),
    (aiokv.StoreConfig, "store", {"cpu_cache_gb": 0.01}),
    (RemoteConfig, "store.remote", dict(REMOTE)),
]
IDS = ["engine", "store", "remote"]


@pytest.mark.parametrize(("cls", "section", "good"), CLASSES, ids=IDS)
def test_an_unknown_keyword_is_a_config_error_naming_it_and_the_known_keys(
    cls: Callable[..., Any], section: str, good: dict[str, Any]
) -> None:
    with pytest.raises(aiokv.ConfigError) as caught:
        cls(**good, bogus=1)
    assert caught.value.key == f"{section}.bogus"
    assert isinstance(caught.value, ValueError)
    known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    assert all(name in str(caught.value) for name in known), str(caught.value)


def test_the_keyword_and_the_yaml_paths_give_the_same_error() -> None:
    with pytest.raises(aiokv.ConfigError) as by_keyword:
        aiokv.StoreConfig(cpu_cache=1)
    with pytest.raises(aiokv.ConfigError) as by_mapping:
        parse_config({"store": {"cpu_cache": 1}})
    assert str(by_keyword.value) == str(by_mapping.value)


def test_replace_with_an_unknown_keyword_is_a_config_error() -> None:
    with pytest.raises(aiokv.ConfigError, match=r"engine\.windw_us: unknown key"):
        dataclasses.replace(aiokv.EngineConfig(), windw_us=5)


def test_too_many_or_repeated_arguments_are_config_errors() -> None:
    fields = len(dataclasses.fields(aiokv.EngineConfig))
    with pytest.raises(aiokv.ConfigError, match=f"at most {fields} positional") as caught:
        aiokv.EngineConfig(*range(1, fields + 2))
    assert caught.value.key == "engine"
    with pytest.raises(aiokv.ConfigError) as twice:
        aiokv.EngineConfig(100, window_us=5)
    assert twice.value.key == "engine.window_us"


def test_positional_arguments_keep_their_meaning() -> None:
    assert aiokv.EngineConfig(100, 8) == aiokv.EngineConfig(window_us=100, max_batch_requests=8)
    assert aiokv.StoreConfig("local", 16, 0.01) == aiokv.StoreConfig(
        backend="local", page_size=16, cpu_cache_gb=0.01
    )
    assert RemoteConfig("mooncake", REMOTE["master"]) == RemoteConfig(**REMOTE)


@pytest.mark.parametrize(("cls", "section", "good"), CLASSES, ids=IDS)
def test_they_stay_dataclasses(cls: Callable[..., Any], section: str, good: dict[str, Any]) -> None:
    config = cls(**good)
    assert dataclasses.is_dataclass(config)
    assert config == cls(**good)
    assert repr(config).startswith(f"{cls.__name__}(")
    assert eval(repr(config), {cls.__name__: cls, "RemoteConfig": RemoteConfig}) == config
    assert pickle.loads(pickle.dumps(config)) == config
    assert copy.deepcopy(config) == config
    assert dataclasses.replace(config) == config
    assert next(iter(good)) in inspect.signature(cls).parameters  # help() shows the fields


def test_a_store_config_with_a_remote_tier_survives_pickling_for_the_child() -> None:
    # ProcessStore sends its StoreConfig (own_process=False) to the child in a pickle.
    config = aiokv.StoreConfig(cpu_cache_gb=0.01, own_process=True, remote=dict(REMOTE))
    assert isinstance(config.remote, RemoteConfig)
    sent = pickle.loads(pickle.dumps(dataclasses.replace(config, own_process=False)))
    assert sent == dataclasses.replace(config, own_process=False)
    assert sent.remote == config.remote and not sent.in_own_process()
