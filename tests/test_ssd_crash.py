"""A kill -9 in the middle of heavy SSD writes leaves a directory that opens and serves
only intact blocks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import aiokv

LAYERS, PAGE, HEADS, DIM, USER_PAGES = 2, 16, 2, 16, 8
BLOCK = LAYERS * 2 * PAGE * HEADS * DIM * 4
SLOT = 4096 + BLOCK
CONFIG = dict(cpu_cache_gb=16 * BLOCK / (1 << 30), ssd_cache_gb=48 * SLOT / (1 << 30))

# The writer: users' pages (content a function of the user) offloaded one after another
# through a small SSD tier (six users), so that slots are overwritten all the time.
CHILD = f"""
import sys, numpy as np, torch, aiokv
caches = [torch.zeros(2 * {USER_PAGES}, 2, {PAGE}, {HEADS}, {DIM}) for _ in range({LAYERS})]
store = aiokv.LocalStore(aiokv.StoreConfig(ssd_cache_dir=sys.argv[1], **{CONFIG!r}))
store.register(caches)
tokens = np.arange({USER_PAGES * PAGE}, dtype=np.int64)
user = 0
while True:
    generator = torch.Generator().manual_seed(user)
    for cache in caches:
        cache[:{USER_PAGES}] = torch.randn(cache[:{USER_PAGES}].shape, generator=generator)
    while True:
        try:
            task, mask = store.put_match(tokens, ["u%d" % user])
            break
        except aiokv.stores.NoSpace:
            store.try_wait([])
    new = torch.arange({USER_PAGES})[torch.from_numpy(mask[::{PAGE}])]
    store.launch([task], [new], [None])
    while not store.try_wait([task]):
        pass
    print(user, flush=True)
    user += 1
"""


def expected(user: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(user)
    shape = (USER_PAGES, 2, PAGE, HEADS, DIM)
    return [torch.randn(shape, generator=generator) for _ in range(LAYERS)]


def test_kill_9_during_heavy_writes_then_reopen_serves_only_intact_blocks(
    tmp_path: Path,
) -> None:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env, text=True
    )
    assert child.stdout is not None
    last = -1
    for line in child.stdout:  # past several rounds of the SSD tier, then at once
        last = int(line)
        if last >= 30:
            break
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    assert last >= 30, "the writer died before the kill"

    caches = [torch.zeros(2 * USER_PAGES, 2, PAGE, HEADS, DIM) for _ in range(LAYERS)]
    store = aiokv.LocalStore(aiokv.StoreConfig(ssd_cache_dir=str(tmp_path), **CONFIG))
    store.register(caches)
    recovered = store.store_stats()["ssd_blocks_used"]
    assert 0 < recovered <= 48
    tokens = np.arange(USER_PAGES * PAGE, dtype=np.int64)
    target = torch.arange(USER_PAGES, 2 * USER_PAGES)
    served = 0
    for user in range(last + 3):
        for cache in caches:
            cache[USER_PAGES:] = 0
        task, mask = store.get_match(tokens, [f"u{user}"])
        if not mask.any():
            store.cancel([task])
            continue
        store.launch([task], [target[: int(mask.sum()) // PAGE]], [None])
        result: dict[int, aiokv.TaskResult] = {}
        while not result:
            result = store.try_wait([task])
        assert result[task].status is aiokv.TaskStatus.SUCCESS
        got = result[task].mask
        loaded = int((got if got is not None else mask).sum()) // PAGE
        want = expected(user)
        for layer, cache in enumerate(caches):
            assert torch.equal(cache[USER_PAGES : USER_PAGES + loaded], want[layer][:loaded]), (
                f"user {user}: a loaded page is not what was written"
            )
            assert not cache[USER_PAGES + loaded :].any()  # nothing past what loaded
        served += loaded
    assert served > 0  # the recent users are back
    store.close()
