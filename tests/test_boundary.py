"""The call boundary keeps what the caller gave at the call: a page-id or token-id buffer
reused right after the call changes nothing stored; a config given twice, of the wrong
type or for another backend, and a blocking wait's bad timeout, are typed errors naming
the key (they were silently the last value, an AttributeError, a private store, or an
error from inside threading)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import PAGE_SIZE, small_store

import aiokv

TOKENS = 4 * PAGE_SIZE


def _two_call_batches() -> aiokv.EngineConfig:
    # A batch dispatches only once both calls are in: the caller's edit lands before it.
    return aiokv.EngineConfig(window_us=200_000, max_batch_requests=2)


@pytest.mark.asyncio
async def test_reusing_the_page_id_buffer_after_offload_does_not_change_what_is_stored(
    caches: list[torch.Tensor],
) -> None:
    async with aiokv.OffloadEngine(small_store(), caches, _two_call_batches()) as engine:
        ids = torch.arange(0, 4)
        first = asyncio.ensure_future(engine.offload(1, ids, TOKENS))
        await asyncio.sleep(0)  # accepted, not yet dispatched
        ids.copy_(torch.arange(10, 14))  # the caller reuses its buffer for user 2
        await asyncio.gather(first, engine.offload(2, ids, TOKENS))
        async with await engine.lookup(1, TOKENS) as hit:
            await engine.load(hit, torch.arange(20, 24))
    assert all(torch.equal(c[20:24], c[0:4]) for c in caches), "user 1 got user 2's pages"


@pytest.mark.asyncio
async def test_reusing_the_token_id_buffer_after_offload_does_not_change_the_key(
    caches: list[torch.Tensor],
) -> None:
    async with aiokv.OffloadEngine(small_store(), caches, _two_call_batches()) as engine:
        tokens = np.arange(TOKENS, dtype=np.int64)
        first = asyncio.ensure_future(engine.offload(1, torch.arange(4), TOKENS, token_ids=tokens))
        await asyncio.sleep(0)
        tokens[:] = 7
        await asyncio.gather(first, engine.offload(2, torch.arange(4, 8), TOKENS))
        hit = await engine.lookup(1, TOKENS, token_ids=np.arange(TOKENS, dtype=np.int64))
        assert hit.cached_tokens == TOKENS
        hit.release()


@pytest.mark.parametrize(("text", "key", "line"), [
    ("store:\n  ssd_cache_gb: 4\nstore:\n  cpu_cache_gb: 0.05\n", "store", 3),
    ("engine:\n  request_timeout_ms: 5000\n  request_timeout_ms: 0\n",
     "engine.request_timeout_ms", 3),
    ("store:\n  cpu_cache_gb: 1\n  remote:\n    master: a:1\n    timeout_ms: 9\n"
     "    master: b:2\n", "store.remote.master", 6),
])
def test_a_key_given_twice_in_yaml_is_a_config_error_naming_it_and_the_file(
        tmp_path: Path, text: str, key: str, line: int) -> None:
    path = tmp_path / "c.yml"
    path.write_text(text)
    with pytest.raises(aiokv.ConfigError, match="twice") as caught:
        aiokv.load_config(path)
    assert caught.value.key == key
    assert str(path) in str(caught.value) and f"line {line}" in str(caught.value)


@pytest.mark.parametrize("text", ["store:\n  ? [cpu_cache_gb]\n  : 1\n",
                                  "? {store: 1}\n: 1\n"])
def test_a_yaml_key_that_is_a_list_or_mapping_is_a_config_error(tmp_path: Path, text: str) -> None:
    # It was a raw TypeError (unhashable type) from the check for keys given twice.
    path = tmp_path / "c.yml"
    path.write_text(text)
    with pytest.raises(aiokv.ConfigError, match="unhashable key") as caught:
        aiokv.load_config(path)
    assert caught.value.key == "path" and "line " in str(caught.value)


@pytest.mark.parametrize("config", [{"cpu_cache_gb": -1}, "x", [1]])
def test_local_store_takes_a_store_config_or_says_why(config: object) -> None:
    with pytest.raises(aiokv.ConfigError):
        aiokv.LocalStore(config)  # type: ignore[arg-type]


def test_local_store_refuses_a_config_for_another_backend() -> None:
    config = aiokv.StoreConfig(backend="shared", socket="/tmp/aiokv-none.sock")
    with pytest.raises(aiokv.ConfigError, match=r"store\.backend"):
        aiokv.LocalStore(config)


# 1e10: finite, but past threading.TIMEOUT_MAX (OverflowError from inside the wait).
@pytest.mark.parametrize("timeout", ["5", -1.0, float("nan"), 1e10,
                                     pytest.param(10**400, id="10**400")])
def test_background_layer_waits_refuse_a_bad_timeout(
    caches: list[torch.Tensor], timeout: object
) -> None:
    with aiokv.run_in_background(aiokv.OffloadEngine(small_store(), caches)) as kv:
        kv.offload(1, torch.arange(4), TOKENS)
        load = kv.load_layerwise(kv.lookup(1, TOKENS), torch.arange(20, 24))
        for wait in (lambda: load.layer_ready(0, timeout=timeout),
                     lambda: load.result(timeout=timeout)):
            with pytest.raises(aiokv.InvalidRequest, match="timeout"):
                wait()
        load.result()


def test_an_ssd_directory_without_an_ssd_size_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "aiokv"):
        aiokv.LocalStore(aiokv.StoreConfig(ssd_cache_dir=str(tmp_path)))
    assert any("ssd_cache_gb is 0: no SSD tier" in r.getMessage() and str(tmp_path)
               in r.getMessage() for r in caplog.records)


def test_store_restarts_for_a_store_in_this_process_is_a_config_error() -> None:
    # Only a store in a process of its own is ever started again: here it would be ignored.
    with pytest.raises(aiokv.ConfigError, match=r"^store\.store_restarts: .*got 5"):
        aiokv.stores.make_store(aiokv.StoreConfig(cpu_cache_gb=0.01, store_restarts=5))
    # The default, said or not, is no error.
    store = aiokv.stores.make_store(aiokv.StoreConfig(cpu_cache_gb=0.01, store_restarts=3))
    store.close()


def test_a_socket_path_longer_than_a_unix_socket_holds_is_a_config_error(tmp_path: Path) -> None:
    path = str(tmp_path / ("s" * 120))
    with pytest.raises(aiokv.ConfigError, match=r"^store\.socket: is \d+ bytes.*at most 107"):
        aiokv.StoreConfig(backend="shared", socket=path)


@pytest.mark.parametrize("backend", ["local", "shared"])
def test_a_socket_that_is_no_path_is_a_config_error(tmp_path: Path, backend: str) -> None:
    # A YAML `socket: 5` (or a mapping's) was a raw TypeError from os.fsencode.
    path = tmp_path / "c.yml"
    path.write_text(f"store:\n  backend: {backend}\n  socket: 5\n")
    for make in (lambda: aiokv.load_config(path),
                 lambda: aiokv.StoreConfig(backend=backend, socket=5)):  # type: ignore[arg-type]
        with pytest.raises(aiokv.ConfigError, match=r"^store\.socket: .*got int 5$"):
            make()
    # A path object is its str, as for ssd_cache_dir.
    socket = tmp_path / "s.sock"
    assert aiokv.StoreConfig(backend="shared", socket=socket).socket == str(socket)  # type: ignore[arg-type]


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
async def test_a_nested_page_id_tensor_is_an_invalid_request(caches: list[torch.Tensor]) -> None:
    nested = torch.nested.nested_tensor([torch.arange(4), torch.arange(2)])
    async with aiokv.OffloadEngine(small_store(), caches) as engine:
        with pytest.raises(aiokv.InvalidRequest, match="page_ids"):
            await engine.offload(1, nested, TOKENS)


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_caches_that_are_conjugate_or_negative_views_are_a_config_error(view: str) -> None:
    # Copies move a cache's memory, which holds the values before the view's conjugation
    # or negation: such caches could be registered, and every copy then failed.
    if view == "conj":
        caches = [torch.randn(8, 2, PAGE_SIZE, 2, 4, dtype=torch.complex64).conj()]
    else:
        caches = [torch._neg_view(torch.randn(8, 2, PAGE_SIZE, 2, 4))]
    with pytest.raises(aiokv.ConfigError, match=r"kv_caches\[0\].*negative view"):
        aiokv.OffloadEngine(small_store(), caches)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions")
@pytest.mark.parametrize("kind", ["quantized", "nested", "sparse"])
def test_caches_that_are_not_dense_plain_tensors_are_a_config_error(kind: str) -> None:
    # A quantized cache passed every check and crashed the process (SIGSEGV) at its first
    # copy; a nested one was a raw RuntimeError; a sparse one was called non-contiguous.
    dense = torch.zeros(8, 2, PAGE_SIZE, 2, 4)
    if kind == "quantized":
        cache = torch.quantize_per_tensor(dense, 1.0, 0, torch.qint8)
    elif kind == "nested":
        cache = torch.nested.nested_tensor(list(dense))
    else:
        cache = dense.to_sparse()
    with pytest.raises(aiokv.ConfigError, match=rf"^kv_caches\[0\]: must be a dense tensor.*"
                                                rf"{kind if kind != 'sparse' else 'sparse_coo'}"):
        aiokv.OffloadEngine(small_store(), [cache])


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
async def test_token_ids_that_are_not_dense_tensors_are_an_invalid_request(
    caches: list[torch.Tensor],
) -> None:
    # Both were raw errors from .numpy(): a TypeError and a RuntimeError.
    async with aiokv.OffloadEngine(small_store(), caches) as engine:
        for tokens in (torch.arange(TOKENS).to_sparse(),
                       torch.nested.nested_tensor([torch.arange(TOKENS)])):
            with pytest.raises(aiokv.InvalidRequest, match=r"^token_ids: must be a dense"):
                await engine.offload(1, torch.arange(4), TOKENS, token_ids=tokens)
            with pytest.raises(aiokv.InvalidRequest, match=r"^token_ids: must be a dense"):
                await engine.lookup(1, TOKENS, token_ids=tokens)


@pytest.mark.asyncio
async def test_token_ids_that_are_a_negative_view_key_their_values(
    caches: list[torch.Tensor],
) -> None:
    # A negative view's .numpy() was a raw RuntimeError; its values are the negated ones,
    # as run_in_background's copy of it already had them.
    async with aiokv.OffloadEngine(small_store(), caches) as engine:
        await engine.offload(1, torch.arange(4), TOKENS,
                             token_ids=torch._neg_view(torch.arange(TOKENS)))
        async with await engine.lookup(1, TOKENS, token_ids=-torch.arange(TOKENS)) as hit:
            assert hit.cached_tokens == TOKENS


@pytest.mark.parametrize("text", ["engine:\n  window_us: " + "9" * 5000 + "\n",
                                  "store: " + "[" * 2000 + "]" * 2000 + "\n"],
                         ids=["5000-digit int", "2000 nested lists"])
def test_yaml_that_python_cannot_build_is_a_config_error(tmp_path: Path, text: str) -> None:
    # A ValueError (int digits limit) and a RecursionError, raw, from yaml.load.
    path = tmp_path / "c.yml"
    path.write_text(text)
    with pytest.raises(aiokv.ConfigError, match="is not valid YAML") as caught:
        aiokv.load_config(path)
    assert caught.value.key == "path"


@pytest.mark.parametrize(("text", "where"), [
    ("engine:\n  page_size: [1, 2\nstore:\n  x: 1\n",
     "at line 3, column 6: expected ',' or ']', but got ':' "
     "(while parsing a flow sequence at line 2, column 14)"),
    ("engine:\n\tpage_size: 16\n",
     "at line 2, column 1: found character '\\t' that cannot start any token "
     "(while scanning for the next token)"),
    ('engine:\n  window_us: 5\nstore: "x\x01"\n',
     "at line 3, column 10: unacceptable character #x0001: special characters are not "
     "allowed"),
], ids=["unclosed list", "tab indent", "control character"])
def test_a_yaml_syntax_error_is_one_line_naming_the_file_line_and_column(
    tmp_path: Path, text: str, where: str
) -> None:
    # PyYAML's text was several lines (context, the source line, a caret) naming the input
    # "<unicode string>"; `aiokv demo --config` printed them all under its one-line prefix.
    path = tmp_path / "bad.yml"
    path.write_text(text)
    with pytest.raises(aiokv.ConfigError) as caught:
        aiokv.load_config(path)
    assert str(caught.value) == f"path: {str(path)!r} is not valid YAML {where}"
    assert isinstance(caught.value.__cause__, yaml.YAMLError)  # PyYAML's, for the rest


@pytest.mark.parametrize("path", ["c\0.yml", None, 5], ids=["NUL byte", "None", "int"])
def test_a_config_path_that_names_no_file_is_a_config_error(path: object) -> None:
    # A raw ValueError ("embedded null byte") and TypeErrors from pathlib.
    with pytest.raises(aiokv.ConfigError, match="cannot read config file") as caught:
        aiokv.load_config(path)  # type: ignore[arg-type]
    assert caught.value.key == "path"
    if isinstance(path, str):  # open_engine takes a str path as a YAML file's
        with pytest.raises(aiokv.ConfigError, match="cannot read config file"):
            aiokv.open_engine(path, kv_caches=[torch.zeros(8, 2, PAGE_SIZE, 2, 4)])
