"""aiokv's pytest plugin (entry point ``pytest11``), for users' tests and ours.

Fixtures, each overridable by a fixture of the same name in a conftest or test module:

- ``aiokv_kv_caches``: CPU caches of a small geometry (:data:`DEFAULT_GEOMETRY`), random
  and seeded, fresh per test;
- ``aiokv_store_config``: the embedded store's :class:`~aiokv.StoreConfig` (small);
- ``aiokv_engine_config``: the :class:`~aiokv.EngineConfig` (the defaults);
- ``aiokv_engine``: a started :class:`~aiokv.OffloadEngine` over those, on a
  :class:`~aiokv.LocalStore`, closed after the test. Teardown fails the test if the
  engine left anything behind: ``stats().pending`` or ``stats().store_tasks_open`` not 0
  after the close.

An engine belongs to the loop that started it, so ``aiokv_engine`` must run on the test's
loop. It is function-scoped and takes pytest-asyncio's default fixture loop scope
(``asyncio_default_fixture_loop_scope``, "function" unless configured), which suits
plain ``@pytest.mark.asyncio`` tests. Tests that share a wider loop and an engine use a
variant made by :func:`engine_fixture`::

    shared_engine = engine_fixture(scope="module")

    @pytest.mark.asyncio(loop_scope="module")
    async def test_one(shared_engine): ...

The async fixtures need pytest-asyncio (strict mode is fine); without it the plugin
still loads, and ``aiokv_engine`` fails the tests that use it, saying so. Loading it
imports aiokv (and torch); ``pytest -p no:aiokv`` turns it off.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import pytest
import torch

from .config import EngineConfig, StoreConfig
from .engine import OffloadEngine
from .stats import EngineStats
from .stores import make_store

Scope = Literal["function", "class", "module", "package", "session"]

# layers, pages, page_size, heads, head_dim: 2 x 64 x 2 x 4 x 2 x 8 float32 = 64 KiB a layer.
DEFAULT_GEOMETRY = (2, 64, 4, 2, 8)
DEFAULT_CPU_CACHE_GB = 0.01


def make_kv_caches(
    layers: int = DEFAULT_GEOMETRY[0],
    pages: int = DEFAULT_GEOMETRY[1],
    page_size: int = DEFAULT_GEOMETRY[2],
    heads: int = DEFAULT_GEOMETRY[3],
    head_dim: int = DEFAULT_GEOMETRY[4],
    seed: int = 0,
) -> list[torch.Tensor]:
    """CPU caches, one ``[page, 2, page_size, heads, head_dim]`` float32 table per layer,
    random from ``seed`` (distinct pages, so a load from the wrong page shows)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (pages, 2, page_size, heads, head_dim)
    return [torch.randn(shape, generator=generator) for _ in range(layers)]


def default_store_config() -> StoreConfig:
    return StoreConfig(backend="local", cpu_cache_gb=DEFAULT_CPU_CACHE_GB)


_SETTLE_S, _SETTLE_TRIES = 0.01, 100  # up to 1 s for calls in flight as a test ends


def leaks(stats: EngineStats) -> list[str]:
    """What a test left behind in its engine, from its stats (empty: nothing): calls
    never resolved, and store tasks not terminal (a Lookup never loaded or released)."""
    found = []
    if stats.pending:
        found.append(f"{stats.pending} requests accepted and never resolved")
    if stats.store_tasks_open:
        found.append(f"{stats.store_tasks_open} store tasks matched or launched, not terminal")
    return found


async def started_engine(
    kv_caches: list[torch.Tensor], store_config: StoreConfig, engine_config: EngineConfig
) -> AsyncIterator[OffloadEngine]:
    """The body of every engine fixture: start on the running loop, yield, close, and
    fail the test if anything leaked."""
    engine = OffloadEngine(make_store(store_config), kv_caches, engine_config)
    async with engine:
        yield engine
        # Before the close, which resolves and releases whatever is left: calls in
        # flight get a moment to end (their callers have returned).
        left = leaks(engine.stats())
        for _ in range(_SETTLE_TRIES):
            if not left:
                break
            await asyncio.sleep(_SETTLE_S)
            left = leaks(engine.stats())
    if left:
        pytest.fail("aiokv_engine: the test left " + "; ".join(left), pytrace=False)


@pytest.fixture
def aiokv_kv_caches() -> list[torch.Tensor]:
    return make_kv_caches()


@pytest.fixture
def aiokv_store_config() -> StoreConfig:
    return default_store_config()


@pytest.fixture
def aiokv_engine_config() -> EngineConfig:
    return EngineConfig()


try:
    import pytest_asyncio

    HAVE_PYTEST_ASYNCIO = True
except ImportError:  # the async fixtures say what they need instead of breaking pytest
    HAVE_PYTEST_ASYNCIO = False


def engine_fixture(
    scope: Scope = "function",
    *,
    kv_caches: Callable[[], list[torch.Tensor]] = make_kv_caches,
    store_config: Callable[[], StoreConfig] = default_store_config,
    engine_config: Callable[[], EngineConfig] | None = None,
) -> Any:
    """A started-engine fixture of ``scope`` whose loop scope is the same, so that tests
    marked ``@pytest.mark.asyncio(loop_scope=scope)`` share its loop. Assign it to a
    name in a test module or conftest; that name is the fixture's. The callables build
    the caches and configs once per fixture instance."""
    if not HAVE_PYTEST_ASYNCIO:
        raise RuntimeError("aiokv.pytest_plugin.engine_fixture needs pytest-asyncio")

    async def engine() -> AsyncIterator[OffloadEngine]:
        config = engine_config() if engine_config is not None else EngineConfig()
        async for started in started_engine(kv_caches(), store_config(), config):
            yield started

    return pytest_asyncio.fixture(engine, scope=scope, loop_scope=scope)


if HAVE_PYTEST_ASYNCIO:

    @pytest_asyncio.fixture
    async def aiokv_engine(
        aiokv_kv_caches: list[torch.Tensor],
        aiokv_store_config: StoreConfig,
        aiokv_engine_config: EngineConfig,
    ) -> AsyncIterator[OffloadEngine]:
        async for engine in started_engine(
            aiokv_kv_caches, aiokv_store_config, aiokv_engine_config
        ):
            yield engine

else:

    @pytest.fixture
    def aiokv_engine() -> None:
        pytest.fail("the aiokv_engine fixture needs pytest-asyncio", pytrace=False)
