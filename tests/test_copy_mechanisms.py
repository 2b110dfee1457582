"""benchmarks/copy_mechanisms.py on the CPU: the copy plans that mechanisms c, d and e
issue (checked here by carrying them out with memmove), the smoke run of the mechanisms
that run on a CPU, and the byte check that keeps a broken mechanism from reporting a
number."""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import copy_mechanisms
import copy_movers
from copy_plans import Geometry, plan

LAYERS, PAGES, PAGE, HEADS, DIM = 3, 40, 4, 2, 8


def _memmove_all(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
    for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(dst, src, size)


@pytest.mark.parametrize("layout", ["block", "layer"])
@pytest.mark.parametrize("adjacent", [False, True])
def test_a_plan_moves_each_page_of_each_layer_to_its_block_and_back(
    layout: str, adjacent: bool
) -> None:
    caches = [torch.randn(PAGES, 2, PAGE, HEADS, DIM) for _ in range(LAYERS)]
    users, each = 3, 4
    if adjacent:  # each user's pages in a row, users apart
        pages = np.concatenate([np.arange(s, s + each) for s in (20, 2, 30)])
    else:  # scattered: even pages in random order, so that no two are adjacent
        pages = np.random.default_rng(1).permutation(PAGES // 2)[: users * each] * 2
    n = len(pages)
    blocks = np.arange(n)
    lead = (n, LAYERS) if layout == "block" else (LAYERS, n)
    pool = torch.zeros((*lead, 2, PAGE, HEADS, DIM))
    page_bytes = caches[0][0].numel() * caches[0].element_size()
    geometry = Geometry(LAYERS, page_bytes, n, layout)
    bases = [c.data_ptr() for c in caches]

    out = plan(geometry, pages, blocks, bases, pool.data_ptr(), to_host=True)
    _memmove_all(out.dsts, out.srcs, out.sizes)
    for layer, cache in enumerate(caches):
        host = pool[:, layer] if layout == "block" else pool[layer]
        assert torch.equal(host, cache[torch.from_numpy(pages)])
    assert out.nbytes == n * LAYERS * page_bytes
    runs_per_layer = users if adjacent and layout == "layer" else n
    assert len(out) == runs_per_layer * LAYERS

    targets = np.arange(n) + PAGES - n  # the last n pages
    before = [c.clone() for c in caches]
    back = plan(geometry, targets, blocks, bases, pool.data_ptr(), to_host=False)
    _memmove_all(back.dsts, back.srcs, back.sizes)
    for cache, old in zip(caches, before, strict=True):
        expected = old.clone()
        expected[torch.from_numpy(targets)] = old[torch.from_numpy(pages)]
        assert torch.equal(cache, expected)


def test_the_cpu_run_checks_and_measures_a_and_b_and_says_why_the_rest_skip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mechanisms.json"
    assert copy_mechanisms.main(["--device", "cpu", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "data-plane mechanisms on cpu" in printed.out
    rows = {r["mechanism"]: r for r in json.loads(out.read_text())["rows"]}
    for name in ("a-gather", "b-torch"):
        assert rows[name]["status"] == "ok (bytes checked)"
        assert rows[name]["alone"]["offload"] > 0 and rows[name]["alone"]["load"] > 0
        assert [s["depth"] for s in rows[name]["sides"]] == ["all", "4"]
        assert all(s["slowdown"] > 0 for s in rows[name]["sides"])
    for name in ("c-bindings", "d-batch", "e-kernel-4", "e-kernel-8", "e-kernel-16"):
        assert rows[name]["status"].startswith("skipped: ")
        assert f"{name}: skipped: " in printed.err


def test_a_mechanism_that_misplaces_a_page_fails_its_check_and_reports_no_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    move = copy_movers.TorchRuns.move

    def off_by_one(self: copy_movers.TorchRuns, to_host: bool, pages: torch.Tensor) -> int:
        if to_host:  # the last page goes where the first one belongs
            pages = torch.cat([pages[-1:], pages[1:]])
        return move(self, to_host, pages)

    monkeypatch.setattr(copy_movers.TorchRuns, "move", off_by_one)
    out = tmp_path / "broken.json"
    assert copy_mechanisms.main(["--device", "cpu", "--only", "b", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"].startswith("FAILED: CheckFailed: ")
    assert "host blocks [0]" in row["status"]
    assert "alone" not in row and "sides" not in row
    assert "b-torch" in capsys.readouterr().out


def test_adjacent_pages_into_a_layer_major_pool_coalesce_into_a_copy_per_user_and_layer(
    tmp_path: Path,
) -> None:
    out = tmp_path / "runs.json"
    argv = ["--device", "cpu", "--only", "a,b", "--placement", "user", "--host-layout", "layer",
            "--depth", "4", "--json", str(out)]
    assert copy_mechanisms.main(argv) == 0
    rows = {r["mechanism"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"a-gather", "b-torch"}
    assert all(r["status"] == "ok (bytes checked)" for r in rows.values())
    users, layers = 4, 2  # the smoke run's
    assert rows["b-torch"]["copies"] == {"offload": users * layers, "load": users * layers}
    assert rows["a-gather"]["copies"] == {"offload": layers, "load": layers}  # one chunk
