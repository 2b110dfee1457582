"""FlexKV's start-up: its environment, the caches' geometry, FlexKV's user config from a
StoreConfig, starting its KVManager, registering the caches from the process that owns
them, and waiting until it is ready.

FlexKV is imported lazily, inside functions: ``import aiokv.stores.flexkv`` must work
where FlexKV is not installed, and FlexKV reads its environment (``GLOBAL_CONFIG_FROM_ENV``)
once, when ``flexkv.common.config`` is first imported, so the variables set here have to
be in place before that import.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from ... import validate
from ...config import StoreConfig
from ...errors import ConfigError, StoreError
from .tiers import check_ssd_dirs, tier_values

# Environment FlexKV must see before its first import. MPS: FlexKV would otherwise try to
# start the MPS daemon (absent on most hosts). CE transfer: FlexKV's default moves host <->
# GPU with a copy kernel, which takes SMs from the model beside it (on an H200 it slowed a
# model stand-in by 55-67%, against 6-8% with the copy engines, for about 12% less speed
# alone: benchmarks/RESULTS.md); a serving GPU is never idle. setdefault: a user's own
# choice wins.
_ENV_DEFAULTS = {
    "FLEXKV_ENABLE_MPS": "0",
    "FLEXKV_USE_CE_TRANSFER_H2D": "1",
    "FLEXKV_USE_CE_TRANSFER_D2H": "1",
}

# FlexKV's logger says a line per operation at INFO, its default (34ab141): a serving
# process is quiet unless asked, as aiokv's own logger is.
# ERROR, not WARNING: 34ab141 logs every cancelled get task at WARNING, and aiokv cancels
# one for each released Lookup (a line per lookup in a serving process).
DEFAULT_LOG_LEVEL = "ERROR"


def log_level(config: StoreConfig | None) -> str:
    """FlexKV's log level: ``store.flexkv.log_level``, else the environment's
    ``FLEXKV_LOG_LEVEL``, else ERROR."""
    configured = None if config is None else config.flexkv.get("log_level")
    if configured is not None:
        return str(configured).upper()
    return os.environ.get("FLEXKV_LOG_LEVEL", DEFAULT_LOG_LEVEL)


def set_env(config: StoreConfig | None = None) -> None:
    """FlexKV's environment, before it is imported, and its log level: ``config``'s, or
    the one already set. FlexKV reads ``FLEXKV_LOG_LEVEL`` as it is imported, in this
    process and in each it starts (which inherit the environment, as aiokv's store
    process does); where this process imported it before the config was known
    (``flexkv_available``), its logger is set here too."""
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    level = log_level(config)
    os.environ["FLEXKV_LOG_LEVEL"] = level
    debug = sys.modules.get("flexkv.common.debug")
    logger = getattr(debug, "flexkv_logger", None)
    if logger is not None:
        logger.set_level(level)


def flexkv_available() -> str | None:
    """None if FlexKVStore can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        set_env()
        import flexkv.kvmanager  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:  # incl. c_ext failing to load
        return f"flexkv is not importable: {exc!r}"
    return None


@dataclass(frozen=True)
class CacheGeometry:
    """What FlexKV needs to know of the caches to start, without the caches themselves
    (a process that does not own them starts it: ProcessStore's child)."""

    num_layers: int
    num_pages: int
    page_size: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    device_index: int

    @classmethod
    def of(cls, kv_caches: Sequence[torch.Tensor]) -> CacheGeometry:
        """The geometry of per-layer CUDA caches [pages, 2, page_size, heads, head_dim],
        checked as the engine checks them (ConfigError naming the layer)."""
        num_pages, page_size, device, _ = validate.kv_caches(kv_caches)
        if device.type != "cuda":
            raise ConfigError("kv_caches", f"FlexKV needs CUDA caches, got {device}")
        first = kv_caches[0]
        return cls(
            len(kv_caches), num_pages, page_size, int(first.shape[3]), int(first.shape[4]),
            first.dtype, device.index or 0,
        )


def attach_caches(
    gpu_register_endpoint: str, kv_caches: Sequence[torch.Tensor], geometry: CacheGeometry
) -> Any:
    """Register the caches (of ``geometry``, ``CacheGeometry.of(kv_caches)``) with a
    started FlexKV (``FlexKVStore.gpu_register_endpoint``), from the process that owns
    them: FlexKV maps them by CUDA IPC. Returns FlexKV's KVTPClient, which must live (with
    the caches) as long as that FlexKV."""
    set_env()
    from flexkv.common.storage import KVCacheLayout, KVCacheLayoutType
    from flexkv.server.client import KVTPClient

    # LAYERBLOCK = one tensor per layer shaped [block, kv, token, head, dim].
    layout = KVCacheLayout(
        type=KVCacheLayoutType.LAYERBLOCK,
        num_layer=geometry.num_layers,
        num_block=geometry.num_pages,
        tokens_per_block=geometry.page_size,
        num_head=geometry.heads,
        head_size=geometry.head_dim,
        kv_dim=2,
        num_kv_heads=geometry.heads,
    )
    client = KVTPClient(gpu_register_endpoint, dp_client_id=0, device_id=geometry.device_index)
    client.register_to_server(list(kv_caches), layout)
    return client


def close_client(client: Any) -> None:
    """Close the sockets of FlexKV's KVTPClient (:func:`attach_caches`) at once and end
    their zmq context, once the FlexKV it registered with is shut down or gone. Left to
    the garbage collector, pyzmq's ``Context.__del__`` closes them with their own linger,
    forever by default, and then waits in ``term()`` for every message not yet delivered:
    a registration its FlexKV never took (it died at start-up) would hang whichever
    thread of this process next runs a collection."""
    if client is None:
        return
    sockets = [getattr(client, name, None) for name in ("send_to_server", "gpu_control_socket")]
    contexts = {id(s.context): s.context for s in sockets if s is not None}
    for context in contexts.values():
        context.destroy(linger=0)  # every socket it made, then term()


def start_manager(
    config: StoreConfig, geometry: CacheGeometry, endpoint: str, gpu_register_endpoint: str
) -> Any:
    """Start FlexKV's KVManager for caches of ``geometry``, without the caches: they are
    registered at ``gpu_register_endpoint`` by whichever process owns them
    (:func:`attach_caches`)."""
    set_env(config)
    from flexkv.common.config import (
        CacheConfig,
        ModelConfig,
        RankInfo,
        update_default_config_from_user_config,
    )
    from flexkv.kvmanager import KVManager

    model_config = ModelConfig(
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.heads,
        head_size=geometry.head_dim,
        kv_dim=2,
        dtype=geometry.dtype,
    )
    cache_config = CacheConfig(tokens_per_block=geometry.page_size, enable_cpu=True)
    user_config = flexkv_user_config(config)
    if user_config.ssd_cache_gb > 0:
        check_ssd_dirs(user_config.ssd_cache_dir, user_config.ssd_cache_gb)
    # FlexKV's own loader turns GiB into explicit block counts (its default
    # num_cpu_blocks would allocate a million blocks) and applies override_* keys.
    update_default_config_from_user_config(
        RankInfo(model_config=model_config), cache_config, user_config
    )
    # Those overrides patch this process's GLOBAL_CONFIG_FROM_ENV only; FlexKV's
    # spawned TransferManager re-reads the environment. Mirror them as FLEXKV_<KEY>,
    # the name FlexKV's override log gives them.
    for key, value in vars(user_config).items():
        if key.startswith("override_"):
            text = str(int(value)) if isinstance(value, bool) else str(value)
            os.environ[f"FLEXKV_{key[len('override_') :].upper()}"] = text
    if cache_config.num_cpu_blocks < 1:
        raise ValueError(
            f"cpu_cache_gb={config.cpu_cache_gb} holds no block of "
            f"{geometry.num_layers}x2x{geometry.page_size}x{geometry.heads}x"
            f"{geometry.head_dim} {geometry.dtype}"
        )
    manager = KVManager(
        model_config,
        cache_config,
        server_recv_port=endpoint,
        gpu_register_port=gpu_register_endpoint,
    )
    manager.start()
    return manager


def wait_ready(manager: Any, timeout_s: float, endpoint: str) -> None:
    """Wait up to ``timeout_s`` until FlexKV has the caches and is ready; StoreError if not."""
    deadline = time.monotonic() + timeout_s
    # In FlexKV's server-client mode is_ready() is a round trip to the server process,
    # and a reply that never comes (the server died at start-up, e.g. on an import
    # error) would block forever: bound each wait, and check that the server lives.
    reply_socket: Any = getattr(getattr(manager, "dp_client", None), "recv_from_server", None)
    no_reply: tuple[type[Exception], ...] = ()  # direct mode: nothing to time out
    if reply_socket is not None:
        import zmq

        reply_socket.setsockopt(zmq.RCVTIMEO, 1000)
        no_reply = (zmq.Again,)
    # A request whose reply did not come within the bound is still answered later:
    # take that reply before asking again, or every later call would read the reply
    # meant for the call before it (the channel is a plain PUSH/PULL pair).
    awaiting_reply = False
    try:
        while True:
            exit_code = server_exit_code(manager)
            if exit_code is not None:
                raise StoreError(
                    f"FlexKV's server process exited with code {exit_code} before it was "
                    "ready; see its output above (server-client mode)"
                )
            try:
                if awaiting_reply:
                    ready = bool(reply_socket.recv_pyobj().is_ready)
                else:
                    awaiting_reply = reply_socket is not None
                    ready = bool(manager.is_ready())
                awaiting_reply = False
                if ready:
                    return
            except no_reply:
                pass  # checked again: the server's exit, the deadline
            if time.monotonic() > deadline:
                raise StoreError(
                    f"FlexKV not ready {timeout_s:.0f}s after GPU registration "
                    f"(endpoint {endpoint}); see FlexKV's log for the TransferManager"
                )
            time.sleep(0.01)
    finally:
        if reply_socket is not None:
            reply_socket.setsockopt(zmq.RCVTIMEO, -1)  # FlexKV's own: calls wait


def flexkv_user_config(config: StoreConfig) -> Any:
    """FlexKV's UserConfig for ``config``: its ``flexkv`` mapping (and user_config_file)
    under the StoreConfig's own tier fields, which win."""
    from flexkv.common.config import UserConfig, load_user_config_from_file

    known = {f.name for f in fields(UserConfig)}
    cfg = config
    path = cfg.flexkv.get("user_config_file")
    values: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    if path is not None:  # FlexKV's own loader: its key checks and path parsing
        loaded = load_user_config_from_file(str(path))
        values = {f.name: getattr(loaded, f.name) for f in fields(UserConfig)}
        overrides = {k: v for k, v in vars(loaded).items() if k.startswith("override_")}
    for key, value in cfg.flexkv.items():
        if key in ("user_config_file", "log_level"):  # aiokv's: the file's, set_env's
            continue
        if key in known:
            values[key] = value
        else:  # the file loader's convention; applied by update_default_config_...
            overrides[f"override_{key}"] = value
    # StoreConfig's own tier keys are authoritative over the flexkv mapping (tiers.py).
    values.update(tier_values(cfg, values.get("ssd_cache_dir")))
    user_config = UserConfig(**values)  # runs FlexKV's validation
    for key, value in overrides.items():
        setattr(user_config, key, value)
    return user_config


def server_exit_code(manager: Any) -> int | None:
    """The exit code of FlexKV's server process (server-client mode), None while it runs
    or when there is none (direct mode)."""
    process = getattr(getattr(manager, "server_handle", None), "process", None)
    if process is None:
        return None
    if hasattr(process, "poll"):  # subprocess.Popen
        code: int | None = process.poll()
        return code
    return None if process.is_alive() else process.exitcode

