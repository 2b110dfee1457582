"""FlexKV's own logging follows aiokv's (CPU, without FlexKV): quiet (ERROR) unless
``store.flexkv.log_level`` or the user's FLEXKV_LOG_LEVEL says otherwise, in this process
and in the processes started from it, and a bad level is a ConfigError naming the key."""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import pytest

import aiokv
from aiokv.stores.flexkv.setup import set_env


def child_level() -> str:
    """FLEXKV_LOG_LEVEL as a process started now from this one sees it (FlexKV's
    TransferManager, aiokv's store process)."""
    code = "import os; print(os.environ.get('FLEXKV_LOG_LEVEL'))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def flexkv_config(**flexkv: object) -> aiokv.StoreConfig:
    return aiokv.StoreConfig(backend="flexkv", flexkv=flexkv)  # FlexKV starts later, if ever


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEXKV_LOG_LEVEL", raising=False)
    monkeypatch.delenv("FLEXKV_ENABLE_MPS", raising=False)


def test_flexkv_is_quiet_by_default() -> None:
    set_env(flexkv_config())
    assert child_level() == "ERROR"


def test_the_config_key_turns_it_up_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXKV_LOG_LEVEL", "ERROR")
    set_env(flexkv_config(log_level="info"))
    assert child_level() == "INFO"


def test_without_the_key_the_users_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXKV_LOG_LEVEL", "DEBUG")
    set_env(flexkv_config())
    assert child_level() == "DEBUG"


@pytest.mark.parametrize("bad", ["loud", 3, ""])
def test_a_bad_level_is_a_config_error_naming_the_key(bad: object) -> None:
    with pytest.raises(aiokv.ConfigError, match=r"store\.flexkv\.log_level"):
        flexkv_config(log_level=bad)


def test_a_flexkv_imported_before_the_config_follows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # FlexKV's logger (flexkv.common.debug.flexkv_logger), as 34ab141 has it: a level
    # name, set once from FLEXKV_LOG_LEVEL at import and by set_level after.
    logger = logging.getLogger("aiokv-test-FLEXKV")

    class FlexkvLogger:
        def set_level(self, level: str) -> None:
            logger.setLevel(logging.getLevelName(level))

    debug = types.ModuleType("flexkv.common.debug")
    debug.flexkv_logger = FlexkvLogger()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flexkv.common.debug", debug)
    logger.setLevel(logging.INFO)  # imported under FlexKV's default
    set_env(flexkv_config())
    assert not logger.isEnabledFor(logging.INFO)
    set_env(flexkv_config(log_level="DEBUG"))
    assert logger.isEnabledFor(logging.DEBUG)


@pytest.mark.parametrize("backend", ["local", "shared"])
def test_the_flexkv_section_on_another_backend_is_a_config_error(backend: str) -> None:
    # Nothing would read it: a user who meant backend: flexkv hears so at once.
    socket = "/run/user/1/aiokv/store.sock" if backend == "shared" else None
    with pytest.raises(aiokv.ConfigError, match=r"^store\.flexkv: .*backend: flexkv only "
                       rf"\(backend is '{backend}'\)"):
        aiokv.StoreConfig(backend=backend, socket=socket, flexkv={"num_cpu_blocks": 1})
    assert aiokv.StoreConfig(backend=backend, socket=socket, flexkv={}).flexkv == {}
