"""On a GPU: a model thread that reads layer i on a stream of its own right after
``wait_layer(i)`` (no host sync) reads the loaded bytes, for every layer; the load is
large enough (32 MiB over 8 layers) that a read not ordered after its layer's copy
would catch the zeros the pages held before. Through run_in_background, as a model
thread calls it. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import aiokv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 8, 256, 16, 8, 128
USED = 64  # pages per load: 4 MiB per layer
TOKENS = USED * PAGE_SIZE


ROUNDS = 3


def test_a_read_right_after_wait_layer_on_another_stream_sees_the_loaded_layer() -> None:
    device = torch.device("cuda")
    caches = [
        torch.randn(PAGES, 2, PAGE_SIZE, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        for _ in range(LAYERS)
    ]
    source = torch.arange(0, USED, device=device)
    target = torch.arange(128, 128 + USED, device=device)
    expected = [cache[:USED].clone() for cache in caches]
    reader = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    out = [torch.empty_like(e) for e in expected]
    torch.cuda.synchronize(device)
    store = aiokv.LocalStore(aiokv.StoreConfig(cpu_cache_gb=0.1))
    engine = aiokv.OffloadEngine(store, caches, aiokv.EngineConfig(window_us=0))
    with aiokv.run_in_background(engine) as kv:
        assert kv.offload(1, source, TOKENS).stored_tokens == TOKENS
        for _ in range(ROUNDS):
            for cache in caches:
                cache[128 : 128 + USED].zero_()  # on this thread's stream: the load waits
            load = kv.load_layerwise(kv.lookup(1, TOKENS), target)
            with torch.cuda.stream(reader):
                for layer in range(LAYERS):
                    load.wait_layer(layer)  # the reader's stream, the current one here
                    out[layer].copy_(caches[layer][128 : 128 + USED])
            reader.synchronize()
            assert load.result(timeout=30).loaded_tokens == TOKENS
            for layer in range(LAYERS):
                assert torch.equal(out[layer], expected[layer]), f"layer {layer}"
