"""Keys: int and str user ids never share one; other types must name their key."""

from __future__ import annotations

import asyncio
import enum
from typing import Any

import numpy as np
import pytest
import torch
from conftest import PAGE_SIZE, small_store

import aiokv
from aiokv import validate

TOKENS = 4 * PAGE_SIZE


class Color(enum.IntEnum):
    RED = 7


def engine_over(caches: list[torch.Tensor]) -> aiokv.OffloadEngine:
    return aiokv.OffloadEngine(small_store(), caches, aiokv.EngineConfig(window_us=0))


@pytest.mark.asyncio
@pytest.mark.parametrize(("stored", "asked"), [(1, "1"), ("1", 1), (0, "0"), (-3, "-3")])
async def test_an_int_and_a_str_user_id_never_share_a_key(
    caches: list[torch.Tensor], stored: Any, asked: Any
) -> None:
    async with engine_over(caches) as engine:
        assert (await engine.offload(stored, torch.arange(4), TOKENS)).stored_tokens == TOKENS
        async with await engine.lookup(asked, TOKENS) as other:
            assert other.cached_tokens == 0
        async with await engine.lookup(stored, TOKENS) as same:
            assert same.cached_tokens == TOKENS


@pytest.mark.asyncio
async def test_each_of_two_colliding_ids_loads_its_own_kv(caches: list[torch.Tensor]) -> None:
    """Stored under both 5 and "5", each key loads back the pages it was given."""
    original = [c.clone() for c in caches]
    async with engine_over(caches) as engine:
        await engine.offload(5, torch.arange(0, 4), TOKENS)
        await engine.offload("5", torch.arange(4, 8), TOKENS)
        for user, source, target in ((5, 0, 16), ("5", 4, 20)):
            hit = await engine.lookup(user, TOKENS)
            assert (await engine.load(hit, torch.arange(target, target + 4))).loaded_tokens
            for cache, before in zip(caches, original, strict=True):
                assert torch.equal(cache[target : target + 4], before[source : source + 4])


@pytest.mark.asyncio
@pytest.mark.parametrize("user_id", [True, False, np.bool_(True), 1.0, (1, 2), b"1", None])
async def test_other_user_id_types_need_a_namespace(
    caches: list[torch.Tensor], user_id: Any
) -> None:
    async with engine_over(caches) as engine:
        with pytest.raises(aiokv.InvalidRequest) as caught:
            await engine.offload(user_id, torch.arange(4), TOKENS)
        assert caught.value.field == "user_id" and type(user_id).__name__ in str(caught.value)
        with pytest.raises(aiokv.InvalidRequest, match="user_id"):
            await engine.lookup(user_id, TOKENS)
        # Named explicitly, any hashable id is fine (and the key is the namespace).
        named = await engine.offload(user_id, torch.arange(4), TOKENS, namespace=["mine"])
        assert named.stored_tokens == TOKENS and named.user_id == user_id
        async with await engine.lookup("other", TOKENS, namespace=["mine"]) as hit:
            assert hit.cached_tokens == TOKENS
        assert engine.stats().pending == 0


@pytest.mark.asyncio
async def test_a_bool_does_not_reach_the_key_of_its_int(caches: list[torch.Tensor]) -> None:
    async with engine_over(caches) as engine:
        await engine.offload(1, torch.arange(4), TOKENS)
        with pytest.raises(aiokv.InvalidRequest, match="bool"):
            await engine.lookup(True, TOKENS)


def test_int_keys_keep_the_recsys_examples_name_and_strs_get_their_own() -> None:
    # uid:<n> is the name recsys-examples' FlexKV backend gives user n: a cache shared
    # with it must keep it.
    assert validate.default_namespace(12) == ("uid:12",)
    assert validate.default_namespace(np.int64(12)) == ("uid:12",)
    assert validate.default_namespace(Color.RED) == ("uid:7",)
    assert validate.default_namespace("12") == ("uid:str:12",)
    # No str id can produce an int's name, nor an int a str's.
    assert validate.default_namespace("str:12") != validate.default_namespace(12)
    assert validate.namespace(None, "a") == ("uid:str:a",)
    assert validate.namespace(["x", "y"], (1, 2)) == ("x", "y")


@pytest.mark.asyncio
async def test_a_key_too_long_for_an_ssd_header_is_refused_naming_its_size(
    caches: list[torch.Tensor],
) -> None:
    # Every tier takes the key it is given, the SSD tier's header included: one longer
    # than that holds is refused at the call, not dropped at the SSD tier without a word.
    async with engine_over(caches) as engine:
        for call in (lambda: engine.offload(1, torch.arange(4), TOKENS, namespace=["x" * 5000]),
                     lambda: engine.lookup(1, TOKENS, namespace=["x" * 5000])):
            with pytest.raises(aiokv.InvalidRequest) as caught:
                await call()
            assert caught.value.field == "namespace" and "5004 bytes" in str(caught.value)
        with pytest.raises(aiokv.InvalidRequest) as caught:
            await engine.offload("y" * 5000, torch.arange(4), TOKENS)
        assert caught.value.field == "user_id"
        # 400 characters outside the BMP: JSON writes each as a surrogate pair, 12 bytes.
        with pytest.raises(aiokv.InvalidRequest) as caught:
            await engine.offload(1, torch.arange(4), TOKENS, namespace=["\U0001F600" * 400])
        assert caught.value.field == "namespace" and "4804 bytes" in str(caught.value)
        long = ["é" * 600]  # 600 characters, 3,604 bytes as JSON: still fits
        assert (await engine.offload(1, torch.arange(4), TOKENS, namespace=long)).stored_tokens
        assert engine.stats().pending == 0


@pytest.mark.asyncio
async def test_an_int_user_id_too_long_for_an_ssd_header_is_refused_naming_user_id(
    caches: list[torch.Tensor],
) -> None:
    # Only str ids were checked: an int of 4,101 digits was stored, never reached the SSD
    # tier, and was lost at host eviction, counted as ssd_full_drops on an empty SSD; one
    # past Python's int-to-text limit raised a bare ValueError.
    async with engine_over(caches) as engine:
        for user_id, said in ((10**4100, "4109 bytes"), (-(10**4027), "4037 bytes"),
                              (10**5000, "16610 bits")):
            with pytest.raises(aiokv.InvalidRequest) as caught:
                await engine.offload(user_id, torch.arange(4), TOKENS)
            assert caught.value.field == "user_id" and said in str(caught.value)
            with pytest.raises(aiokv.InvalidRequest) as caught:
                await engine.lookup(user_id, TOKENS)
            assert caught.value.field == "user_id" and said in str(caught.value)
        longest = 10**4028 - 1  # 4,028 digits: ["uid:<n>"] is 4,036 bytes, which fits
        assert (await engine.offload(longest, torch.arange(4), TOKENS)).stored_tokens == TOKENS
        hit = await engine.lookup(longest, TOKENS)
        hit.release()
        assert hit.cached_tokens == TOKENS


@pytest.mark.parametrize(("namespace", "user_id", "field"), [
    (None, "\udcff", "user_id"), (["ok", "a\ud800b"], 1, "namespace"),
    (["\ud83d\ude00"], 1, "namespace"),  # a pair of surrogates is no character either
])
def test_a_key_that_is_not_utf8_text_is_refused_naming_the_field(
    namespace: Any, user_id: Any, field: str
) -> None:
    with pytest.raises(aiokv.InvalidRequest) as caught:
        validate.namespace(namespace, user_id)
    assert caught.value.field == field and "not UTF-8 text" in str(caught.value)
    assert validate.namespace(["\U0001F600"], 1) == ("\U0001F600",)  # the character is fine


@pytest.mark.asyncio
async def test_a_surrogate_user_id_fails_its_own_call_only(caches: list[torch.Tensor]) -> None:
    # The store server's wire encodes every name of a batch as UTF-8: a surrogate failed
    # the whole batch there (other users' offloads too), so every store refuses it.
    async with engine_over(caches) as engine:
        good, bad, named = await asyncio.gather(
            engine.offload(1, torch.arange(4), TOKENS),
            engine.offload("\udcff", torch.arange(4, 8), TOKENS),
            engine.lookup(2, TOKENS, namespace=["\udcff"]),
            return_exceptions=True)
        assert isinstance(good, aiokv.OffloadResult) and good.stored_tokens == TOKENS
        assert isinstance(bad, aiokv.InvalidRequest) and bad.field == "user_id"
        assert isinstance(named, aiokv.InvalidRequest) and named.field == "namespace"
        assert "'\\udcff'" in str(bad)
        async with await engine.lookup(1, TOKENS) as hit:
            assert hit.cached_tokens == TOKENS


@pytest.mark.parametrize(("make", "every_layer", "says"), [
    (lambda c: c.requires_grad_(), True, "kv_caches[0]: requires grad"),
    (lambda c: c.to("meta"), True, "kv_caches[0]: is on the meta device"),
    (lambda c: c.to(torch.float16), False, "kv_caches[1]: has dtype torch.float16"),
])
def test_caches_no_store_could_use_are_refused_at_open(
    caches: list[torch.Tensor], make: Any, every_layer: bool, says: str
) -> None:
    bad = [make(c.clone()) if every_layer or layer else c for layer, c in enumerate(caches)]
    with pytest.raises(aiokv.ConfigError) as caught:
        validate.kv_caches(bad)
    assert says in str(caught.value)
