"""EngineConfig, StoreConfig, and building them from a config document
(:func:`parse_config`; :mod:`.config_file` reads one from YAML).

A document has an ``engine:`` and a ``store:`` section whose keys are exactly the
keyword arguments of :class:`EngineConfig` and :class:`StoreConfig`. Unknown keys, wrong
types and out-of-range values raise :class:`~aiokv.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .backends import BACKENDS
from .errors import ConfigError
from .remote.config import FLEXKV_REFUSAL, RemoteConfig
from .sections import MAX_INT, build_section, keys_checked

OverloadPolicy = Literal["reject", "wait"]
Backend = Literal["local", "flexkv", "shared"]
WritePolicy = Literal["write_through", "write_back"]


# What FlexKV's logger takes (FLEXKV_LOG_LEVEL; flexkv.common.debug.FlexkvLogger).
FLEXKV_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "OFF")



def _check_int(key: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value}")
    if value > MAX_INT:
        raise ConfigError(key, f"must be <= {MAX_INT}, got an integer of {len(str(value))} digits")


def store_slice_from_advice(advice: object, store_name: str) -> int:
    """``EngineConfig.store_slice_us`` when the config leaves it None: the store's advice
    (its ``store_slice_us``; None or absent: 0), held to the config's own rule."""
    if advice is None:
        return 0
    try:
        _check_int("engine.store_slice_us", advice, 0)
    except ConfigError as exc:
        raise ConfigError(
            "engine.store_slice_us",
            f"is None, so {store_name}'s advice applies, and it is bad ({exc}); "
            "set engine.store_slice_us to override it",
        ) from None
    assert isinstance(advice, int)
    return advice


def _check_number(key: str, value: object, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, f"must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite or value < minimum:
        raise ConfigError(key, f"must be a finite number >= {minimum}, got {value}")


# The largest tier, in GiB: 2**63 bytes, the most a file offset or a size in bytes holds.
# Beyond (1e300 GiB is inf bytes) the stores' block counts overflow as they open.
MAX_TIER_GB = float(1 << 33)


def _check_tier_gb(key: str, gib: float) -> None:
    _check_number(key, gib, 0.0)
    if gib > MAX_TIER_GB:
        raise ConfigError(key, f"must be at most {MAX_TIER_GB:.0f} GiB (2**63 bytes), got {gib}")


def size_text(n: int, places: int = 0) -> str:
    """``n`` bytes for a message: MiB below 1 GiB (to ``places`` decimals), GiB from it
    (one more), so that two figures a user compares, such as a need and the free space,
    never both read 0.01 GiB."""
    if n < 1 << 30:
        return f"{n / (1 << 20):,.{places}f} MiB"
    return f"{n / (1 << 30):,.{places + 1}f} GiB"


def machine_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        pages, page_bytes = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such name here (Windows, macOS)
        return None
    return pages * page_bytes if pages > 0 and page_bytes > 0 else None


def _check_fits_in_memory(key: str, gib: float) -> None:
    """A host tier larger than the machine's memory cannot be allocated: say so here,
    naming the key, rather than let torch fail with a raw RuntimeError at start."""
    memory = machine_memory_bytes()
    if memory is not None and gib * (1 << 30) > memory:
        raise ConfigError(
            key, f"{gib} GiB does not fit in this machine's {memory / (1 << 30):.1f} GiB of memory"
        )


def _check_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(key, f"must be one of {', '.join(choices)}; got {value!r}")


@keys_checked("engine")
@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches, admits and times out requests.

    window_us: how long a batch window stays open after its first request (0: flush on
        the next event-loop iteration).
    max_batch_requests / max_batch_tokens: a window flushes early when its queue reaches
        either; a batch never holds more (except one request larger than max_batch_tokens,
        which forms a batch of its own).
    max_pending: accepted requests not yet resolved; beyond it ``overload`` decides:
        ``reject`` raises Overloaded at once, ``wait`` waits for room (bounded by
        request_timeout_ms).
    request_timeout_ms: a request not resolved by then fails with RequestTimeout (0: never).
        An offload that finds the store full of blocks it cannot evict yet (being
        written, read or held) waits for room and matches again until then
        (:mod:`aiokv.space`), and then fails with StoreFull; with 0 it waits 30 s at most.
    lookup_ttl_ms: a Lookup's reservation not used by ``load`` is released after this.
    max_lookup_tokens: the largest ``num_tokens`` a ``lookup`` takes; beyond it the call
        fails at once with InvalidRequest (a history longer than the store can hold is
        fine up to it: the store is only asked about as many tokens as it can hold).
    poll_interval_us: how often the store thread polls outstanding tasks.
    store_slice_us: once the store thread has run this long since it last blocked on its
        inbox or handed over, it sleeps about 0.1 ms at its next pause between (or, with
        ``set_yield``, inside) store calls, so that an event loop waiting for the GIL
        gets it (0: never). It bounds the loop's stalls behind a Python-heavy store at
        some throughput; it cannot split one long call. None: the store's advice
        (``Store.store_slice_us``: 200 for FlexKV in this process; 0 for a store in a
        child process, whose Python holds the child's GIL, and for stores without one,
        such as the local store, whose calls are short and for which the pauses would
        only cost throughput).
    """

    window_us: int = 200
    max_batch_requests: int = 256
    max_batch_tokens: int = 1 << 20
    max_pending: int = 4096
    overload: OverloadPolicy = "reject"
    request_timeout_ms: int = 30_000
    lookup_ttl_ms: int = 10_000
    poll_interval_us: int = 50
    store_slice_us: int | None = None
    max_lookup_tokens: int = 1 << 24  # last: positional callers keep their meaning

    def __post_init__(self) -> None:
        _check_int("engine.window_us", self.window_us, 0)
        _check_int("engine.max_batch_requests", self.max_batch_requests, 1)
        _check_int("engine.max_batch_tokens", self.max_batch_tokens, 1)
        _check_int("engine.max_pending", self.max_pending, 1)
        _check_choice("engine.overload", self.overload, ("reject", "wait"))
        _check_int("engine.request_timeout_ms", self.request_timeout_ms, 0)
        _check_int("engine.lookup_ttl_ms", self.lookup_ttl_ms, 1)
        _check_int("engine.max_lookup_tokens", self.max_lookup_tokens, 1)
        _check_int("engine.poll_interval_us", self.poll_interval_us, 1)
        if self.store_slice_us is not None:
            _check_int("engine.store_slice_us", self.store_slice_us, 0)


# sockaddr_un's sun_path (108 bytes on Linux) less its terminating NUL.
MAX_SOCKET_PATH_BYTES = 107


@keys_checked("store")
@dataclass(frozen=True)
class StoreConfig:
    """Which store to use and how large it is.

    backend: ``local`` (aiokv's embedded store), ``flexkv``, or ``shared`` (the host's
        ``aiokv store-server``, at ``socket``).
    page_size: tokens per page; None takes it from the caches, a value must match them.
    cpu_cache_gb: host memory for KV blocks, in GiB.
    ssd_cache_gb: the SSD tier's size in GiB, spread evenly over the directories (0: no
        SSD tier). Checked against the free space at open.
    ssd_cache_dir: where the SSD tier lives: one directory, a list of them, or FlexKV's
        ``;``-separated string; several directories (disks) share every request. Each
        must exist and be writable; required when ssd_cache_gb > 0.
    ssd_write_policy: ``write_through`` (the default: a put completes once on the host
        and its SSD copy follows in the background) or ``write_back`` (only blocks the
        host tier evicts are written to SSD, and at close what only the host holds).
    ssd_reset_on_mismatch: a directory written with another geometry (layers, heads,
        head_dim, dtype, page size, directories) is a ConfigError saying what differs;
        true discards its contents instead.
    flexkv: FlexKV's own user-config keys, passed through its loaders, and ``log_level``
        (one of FLEXKV_LOG_LEVELS, any case): how much FlexKV's own logger says, in this
        process and the ones FlexKV starts. Unset: FlexKV's ``FLEXKV_LOG_LEVEL`` where the
        environment sets it, else ERROR (FlexKV's INFO is a line per operation, and its
        WARNING a line per cancelled lookup).
    own_process: run the store in a child process of its own (:class:`ProcessStore`), so
        that its Python never holds this process's GIL against the event loop; the caches
        stay here and reach it by CUDA IPC (or shared memory). None (the default): the
        backend decides, :meth:`in_own_process`.
    store_restarts: with ``own_process``, how many times a child that died is started
        again (with backoff) over the store's life; then every call fails with StoreError.
    socket: with ``backend: shared``, the UNIX socket of the host's ``aiokv store-server``
        (required then, and only then); the server's own config sizes the tiers.
    remote: the remote tier below host and SSD, on Mooncake Store (a mapping in the
        shape of :class:`aiokv.remote.config.RemoteConfig`, or one; None: no remote tier).
        The embedded store's (and ``aiokv store-server``'s, for its engines): with
        ``backend: flexkv`` it is a ConfigError, with ``backend: shared`` the server's.
    """

    backend: Backend = "local"
    page_size: int | None = None
    cpu_cache_gb: float = 1.0
    ssd_cache_gb: float = 0.0
    ssd_cache_dir: str | Sequence[str] | None = None
    ssd_write_policy: WritePolicy = "write_through"
    ssd_reset_on_mismatch: bool = False
    flexkv: Mapping[str, Any] = field(default_factory=dict)
    own_process: bool | None = None
    store_restarts: int = 3
    remote: RemoteConfig | Mapping[str, Any] | None = None
    socket: str | None = None

    def ssd_dirs(self) -> tuple[str, ...]:
        """``ssd_cache_dir`` as a tuple of directories (empty when None)."""
        value = self.ssd_cache_dir
        if value is None:
            return ()
        parts = value.split(";") if isinstance(value, str) else list(value)
        return tuple(p.strip() for p in parts if p.strip())

    def in_own_process(self) -> bool:
        """Whether the store runs in a child process: ``own_process`` when set, else the
        backend's default (:data:`aiokv.backends.BACKENDS`: FlexKV yes, local no)."""
        if self.own_process is not None:
            return self.own_process
        return BACKENDS[self.backend].own_process

    def _check_ssd_dir(self) -> None:
        value: object = self.ssd_cache_dir
        if isinstance(value, os.PathLike):
            object.__setattr__(self, "ssd_cache_dir", os.fspath(value))
        elif value is not None and not isinstance(value, str):
            paths = (str, os.PathLike)
            if not isinstance(value, Sequence) or not all(isinstance(v, paths) for v in value):
                raise _ssd_dir_error(value)
            # A list (from YAML) becomes a tuple: the config stays frozen and hashable.
            object.__setattr__(self, "ssd_cache_dir", tuple(map(os.fspath, value)))
        if len(set(self.ssd_dirs())) != len(self.ssd_dirs()):
            raise ConfigError("store.ssd_cache_dir", f"names a directory twice: {value!r}")

    def _check_socket_type(self) -> None:
        value: object = self.socket
        if isinstance(value, os.PathLike):  # as ssd_cache_dir: kept as its str
            value = os.fspath(value)
            object.__setattr__(self, "socket", value)
        if value is not None and not isinstance(value, str):
            raise ConfigError("store.socket", f"must be the path of a UNIX socket (a str) or "
                                              f"null, got {type(value).__name__} {value!r}")

    def _check_no_tier_keys(self) -> None:
        """An engine on ``backend: shared`` uses the server's tiers: a key that sizes or
        shapes them, set here, would be silently ignored, so it is a ConfigError."""
        for spec in dataclasses.fields(self):
            if spec.name not in _SERVER_KEYS:
                continue
            value = getattr(self, spec.name)
            default = (spec.default if spec.default_factory is dataclasses.MISSING
                       else spec.default_factory())
            if value != default:
                raise ConfigError(
                    f"store.{spec.name}",
                    f"is the store server's to set (aiokv store-server --config); an engine "
                    f"on backend: shared uses the server's tiers, got {value!r}")

    def __post_init__(self) -> None:
        _check_choice("store.backend", self.backend, tuple(BACKENDS))
        if self.page_size is not None:
            _check_int("store.page_size", self.page_size, 1)
        _check_tier_gb("store.cpu_cache_gb", self.cpu_cache_gb)
        if self.cpu_cache_gb <= 0:
            raise ConfigError("store.cpu_cache_gb", f"must be > 0, got {self.cpu_cache_gb}")
        _check_fits_in_memory("store.cpu_cache_gb", self.cpu_cache_gb)
        _check_tier_gb("store.ssd_cache_gb", self.ssd_cache_gb)
        self._check_ssd_dir()
        if self.ssd_cache_gb > 0 and not self.ssd_dirs():
            raise ConfigError("store.ssd_cache_dir", "is required when ssd_cache_gb > 0")
        _check_choice(
            "store.ssd_write_policy", self.ssd_write_policy, ("write_through", "write_back")
        )
        if not isinstance(self.ssd_reset_on_mismatch, bool):
            raise ConfigError(
                "store.ssd_reset_on_mismatch",
                f"must be true or false, got {self.ssd_reset_on_mismatch!r}",
            )
        # FlexKV's own rule, checked early; the embedded store's SSD tier checks it in slots
        # at register, once it knows the block size (a slot per host block: SsdTier).
        if 0 < self.ssd_cache_gb <= self.cpu_cache_gb:
            raise ConfigError(
                "store.ssd_cache_gb",
                f"must be 0 or larger than cpu_cache_gb ({self.cpu_cache_gb}); "
                f"got {self.ssd_cache_gb}",
            )
        if not isinstance(self.flexkv, Mapping):
            raise ConfigError("store.flexkv", f"must be a mapping, got {self.flexkv!r}")
        if self.flexkv and self.backend != "flexkv":  # nothing else reads it
            raise ConfigError("store.flexkv", f"is for backend: flexkv only (backend is "
                              f"{self.backend!r}), got {dict(self.flexkv)!r}")
        level = self.flexkv.get("log_level")
        if level is not None and (
            not isinstance(level, str) or level.upper() not in FLEXKV_LOG_LEVELS
        ):
            raise ConfigError(
                "store.flexkv.log_level",
                f"must be one of {', '.join(FLEXKV_LOG_LEVELS)} (any case), got {level!r}",
            )
        if self.own_process is not None and not isinstance(self.own_process, bool):
            raise ConfigError(
                "store.own_process",
                f"must be true, false or null (the backend decides), got {self.own_process!r}",
            )
        _check_int("store.store_restarts", self.store_restarts, 0)
        self._check_socket_type()
        if self.backend == "shared" and not (isinstance(self.socket, str) and self.socket):
            raise ConfigError("store.socket", f"must name the store server's socket with "
                              f"backend: shared, got {self.socket!r}")
        if self.socket is not None and "\0" in self.socket:
            # The kernel reads sun_path up to its first NUL: "a\0b" reaches the socket at
            # "a", and a leading NUL one in the abstract namespace, where any uid may
            # listen (no directory guards it) and no store server ever does.
            raise ConfigError("store.socket", f"must not contain a NUL byte (a UNIX "
                              f"socket's path ends at the first), got {self.socket!r}")
        if self.socket is not None and len(os.fsencode(self.socket)) > MAX_SOCKET_PATH_BYTES:
            raise ConfigError("store.socket", f"is {len(os.fsencode(self.socket))} bytes; a "
                              f"UNIX socket's path holds at most {MAX_SOCKET_PATH_BYTES} (use "
                              f"a shorter one, such as under /run/user), got {self.socket!r}")
        if self.backend == "flexkv" and self.socket is not None:
            raise ConfigError("store.socket", FLEXKV_SHARING_REFUSAL)
        if self.backend != "shared" and self.socket is not None:
            raise ConfigError("store.socket", f"is for backend: shared only (backend is "
                              f"{self.backend!r})")
        if self.backend == "shared":
            self._check_no_tier_keys()
        if self.backend == "flexkv" and (
            refused := flexkv_sharing_refused(self.flexkv, os.environ)
        ) is not None:
            raise refused
        if self.remote is not None:
            if self.backend == "flexkv":
                raise ConfigError("store.remote", FLEXKV_REFUSAL)
            object.__setattr__(self, "remote", RemoteConfig.from_mapping(self.remote))


# The keys that size or shape the tiers: with backend: shared they are the server's.
_SERVER_KEYS = ("cpu_cache_gb", "ssd_cache_gb", "ssd_cache_dir", "ssd_write_policy",
                "ssd_reset_on_mismatch", "flexkv", "remote")

# Why aiokv does not run several processes on one FlexKV (issue 31), read in FlexKV 34ab141:
# its StorageEngine keys a GPU's caches by device id and ignores a second registration
# for the same id (storage/storage_engine.py, allocate), so a second process on that GPU
# would have its pages read and written in the first process's caches; and its server
# takes a fixed set of clients that must all register before it is ready, and frees
# nothing of one that dies.
FLEXKV_SHARING_REFUSAL = (
    "aiokv does not share one FlexKV between processes: FlexKV's server-client mode keeps "
    "one set of caches per GPU (a second process's registration on the same GPU is dropped "
    "silently, and its copies would use the first process's caches), takes a fixed set of "
    "clients that must all start together, and frees nothing of one that dies. To share "
    "a host tier between processes, use backend: shared (aiokv store-server); else one "
    "FlexKV per process"
)
# FlexKV's ways to ask for it: its environment, or the same keys in store.flexkv (which
# aiokv hands to FlexKV as overrides of its environment), and the value each must keep.
_FLEXKV_SHARING_KEYS = {"instance_num": "1", "instance_id": "0", "server_launch_mode": "embedded"}


def flexkv_sharing_refused(
    flexkv: Mapping[str, Any], environ: Mapping[str, str]
) -> ConfigError | None:
    """The ConfigError for a FlexKV config (``store.flexkv``, then the environment) that
    asks for several processes on one FlexKV, naming the key and its value; else None."""
    for key, alone in _FLEXKV_SHARING_KEYS.items():
        env = f"FLEXKV_{key.upper()}"
        for name, value in ((f"store.flexkv.{key}", flexkv.get(key)), (env, environ.get(env))):
            if value is not None and str(value).strip().lower() != alone:
                return ConfigError(name, f"is {value!r}; {FLEXKV_SHARING_REFUSAL}")
    return None


def _ssd_dir_error(value: object) -> ConfigError:
    return ConfigError(
        "store.ssd_cache_dir",
        f"must be a directory, a list of directories or a ';'-separated string, "
        f"got {value!r}",
    )


def parse_config(document: object) -> tuple[EngineConfig, StoreConfig]:
    """Build both configs from a parsed YAML document (a mapping with two sections)."""
    if document is None:
        document = {}
    if not isinstance(document, Mapping):
        raise ConfigError("<root>", f"must be a mapping, got {type(document).__name__}")
    for key in document:
        if key not in ("engine", "store"):
            raise ConfigError(str(key), "unknown section (known: engine, store)")
    engine = build_section(EngineConfig, "engine", document.get("engine"))
    store = build_section(StoreConfig, "store", document.get("store"))
    return engine, store


def store_config(config: object, backend: str | None = None) -> StoreConfig:
    """A store's ``config`` argument: a StoreConfig, a mapping of the ``store:`` section's
    keys, or None (the defaults); ConfigError otherwise, or for another ``backend``."""
    if config is None:
        config = StoreConfig()
    elif isinstance(config, Mapping):
        config = build_section(StoreConfig, "store", config)
    elif not isinstance(config, StoreConfig):
        raise ConfigError("config", f"must be an aiokv.StoreConfig, a mapping of its keys or "
                                    f"None, got {type(config).__name__}")
    if backend is not None and config.backend != backend:
        raise ConfigError("store.backend", f"is {config.backend!r}; this store is {backend!r} "
                                           "(aiokv.stores.make_store picks the backend's)")
    return config
