"""Helpers every benchmark shares: settings from flags, the loop, tables, JSON, plots.

A benchmark describes its settings once, as a frozen dataclass whose field defaults are
the full-size run; :func:`add_settings_arguments` turns the fields into flags (default
None, so "not given" is visible; a value out of range is a usage error, :func:`flag_type`)
and :func:`settings_from_args` fills what was not given from ``--quick``'s overrides or
the field default. The JSON a run writes carries the
environment (device, torch, CUDA, Python, argv, timestamp) next to settings and results,
so a number can always be traced back to the machine and command that produced it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from .. import flags
from ..errors import ConfigError
from ..running import pick_device as pick_device
from ..running import run_uvloop as run_uvloop

S = TypeVar("S")
T = TypeVar("T")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---- flags and settings ----------------------------------------------------------------


def or_zero(default: T) -> T:
    """A settings field whose flag also takes 0 (its help says what 0 means: auto, off,
    none); a numeric field without it takes positive values only (:func:`flag_type`)."""
    return dataclasses.field(default=default, metadata={"or_zero": True})


def flag_type(field: dataclasses.Field[Any]) -> Callable[[str], object]:
    """The argparse ``type=`` of a settings field's flag: ``metadata["type"]`` where the
    field has one; else from its default: a tuple is integers >= 1, an int >= 1 and a
    float > 0 (each also 0 with :func:`or_zero`), all finite; else the default's type.
    A value out of range is a usage error naming the flag (:mod:`aiokv.flags`)."""
    if "type" in field.metadata:
        given: Callable[[str], object] = field.metadata["type"]
        return given
    default, zero = field.default, bool(field.metadata.get("or_zero"))
    if isinstance(default, tuple):
        return flags.positive_int_list
    if isinstance(default, int) and not isinstance(default, bool):
        return flags.nonnegative_int if zero else flags.positive_int
    if isinstance(default, float):
        return flags.nonnegative_float if zero else flags.positive_float
    return type(default)


def _shown(value: object) -> str:
    """A default as its flag would take it."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def common_parent() -> argparse.ArgumentParser:
    """The flags every subcommand takes, as an argparse parent parser."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--json", metavar="PATH", type=flags.output_file,
                        help="write settings, environment and results")
    parent.add_argument("--plot", metavar="PATH", type=flags.output_file,
                        help="draw the results into a PNG (matplotlib)")
    parent.add_argument(
        "--quick", action="store_true", help="CPU-sized run (under a minute on two cores)"
    )
    return parent


def add_settings_arguments(
    parser: argparse.ArgumentParser,
    settings: type[Any],
    quick: Mapping[str, object],
    helps: Mapping[str, str],
) -> None:
    """One ``--field-name`` flag per dataclass field, typed by :func:`flag_type`; help
    shows the full and the ``--quick`` default. A default (or ``--quick`` value) that its
    own flag would refuse is a ValueError here: the field wants :func:`or_zero`."""
    for field in dataclasses.fields(settings):
        default = field.default
        shown = [_shown(default)]
        help_text = f"{helps.get(field.name, '')} (default {shown[0]}"
        if field.name in quick:
            shown.append(_shown(quick[field.name]))
            help_text += f"; --quick {shown[1]}"
        flag = "--" + field.name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text + ")"
            )
            continue
        kind = flag_type(field)
        for text in shown:
            try:  # a default its own flag refuses: the field wants or_zero (or a fix)
                kind(text)
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise ValueError(f"{settings.__name__}.{field.name}: {flag} refuses "
                                 f"{text!r}, a default of its own ({exc})") from None
        choices = sorted(DTYPES) if field.name == "dtype" else None
        if field.name == "device":
            choices = ["auto", "cpu", "cuda"]
        if "choices" in field.metadata:
            choices = list(field.metadata["choices"])
        parser.add_argument(flag, type=kind, default=None, choices=choices, help=help_text + ")")


def settings_from_args(
    settings: type[S], args: argparse.Namespace, quick: Mapping[str, object]
) -> S:
    """Given flags win, then ``--quick`` overrides, then the dataclass defaults."""
    values: dict[str, object] = {}
    for field in dataclasses.fields(settings):  # type: ignore[arg-type]
        given = getattr(args, field.name, None)
        if given is not None:
            values[field.name] = given
        elif args.quick and field.name in quick:
            values[field.name] = quick[field.name]
    made = settings(**values)
    _check_pages(made)
    return made


def _check_pages(settings: object) -> None:
    """ConfigError (a usage error to the bench's main) where a bench's ``tokens`` (a count
    or counts) are fewer than one page of its ``page_size``: only full pages are stored,
    so such a run would move nothing, and fail later on a message about something else."""
    tokens, page_size = getattr(settings, "tokens", None), getattr(settings, "page_size", None)
    if tokens is None or not page_size:
        return
    for count in tokens if isinstance(tokens, tuple) else (tokens,):
        if count < page_size:
            raise ConfigError("--tokens", f"{count} is fewer than one page of --page-size "
                              f"{page_size}; only full pages are stored")




# Bytes a tensor costs beyond its data (its Python object, TensorImpl and storage): a
# floor, so that a --layers of millions of tiny caches is refused as surely as huge ones.
TENSOR_OVERHEAD = 256


def _largest(value: int | tuple[int, ...]) -> int:
    return value if isinstance(value, int) else max(value)


def check_in_flight(settings: Any, *names: str, max_pending: int) -> None:
    """ConfigError (a usage error to the bench's main) where the calls a bench keeps in
    flight on one engine at once, the product of the fields ``names`` (a list flag: its
    largest), are more than that engine's ``max_pending``: under ``overload: reject`` the
    engine refuses the rest with Overloaded once the run is under way, after its caches
    were made (an exit status 1 naming no flag, or a child process's traceback)."""
    values = {name: _largest(getattr(settings, name)) for name in names}
    count = 1
    for value in values.values():
        count *= value
    if count <= max_pending:
        return
    shown = " x ".join(f"--{name.replace('_', '-')} {value}" for name, value in values.items())
    asked = shown.split(" ", 1)[1] if len(values) == 1 else f"{shown} = {count}"
    raise ConfigError(f"--{names[0].replace('_', '-')}",
                      f"{asked} calls in flight at once are more than the engine's "
                      f"max_pending ({max_pending}); ask for fewer")


def check_round_fits(
    settings: Any, device: torch.device, *, store: bool, extra: Mapping[str, int] = {},
    sized_too: Sequence[str] = (), users_too: Sequence[str] = (),
) -> None:
    """MemoryError (a usage error: :func:`aiokv.flags.check_fits`) before anything is made
    where one round of the largest ``--users`` x ``--tokens`` (or ``--pages``) would not
    fit in this machine's memory: in the caches, where they are on the host, and in the
    store, where ``store`` (the bench sizes its host tier to hold a round). A floor of what
    the bench makes, plus its ``extra`` host buffers (sized by the fields ``sized_too``
    names): sizes past it were allocated anyway
    and the kernel killed the run, or a size overflowed torch's int64 in a traceback.
    ``users_too`` names fields that count the users of a round of their own (of the
    same pages), one round at a time: the largest of them all sizes the round."""
    users = max(_largest(getattr(settings, name)) for name in ("users", *users_too))
    if hasattr(settings, "pages"):
        pages, sized_by = settings.pages, "pages"
    else:
        tokens = settings.tokens if isinstance(settings.tokens, int) else max(settings.tokens)
        pages, sized_by = -(-tokens // settings.page_size), "tokens"
    dtype = DTYPES[getattr(settings, "dtype", "bf16")]
    block = bytes_per_token(settings.layers, settings.heads, settings.head_dim, dtype)
    round_bytes = users * pages * block * settings.page_size
    on_host = device.type == "cpu"
    needs = {
        "caches": round_bytes + settings.layers * TENSOR_OVERHEAD if on_host else 0,
        "store": round_bytes if store else 0,
        **extra,
    }
    asked = ", ".join(f"--{name.replace('_', '-')} {_shown(getattr(settings, name))}" for name in (
        "users", *users_too, sized_by, "layers", "page_size", "heads", "head_dim", *sized_too))
    flags.check_fits(asked, needs)


@contextlib.contextmanager
def switch_interval(us: int) -> Iterator[None]:
    """``sys.setswitchinterval`` at ``us`` microseconds meanwhile (0: left as it is),
    restored after: it is process-wide."""
    previous = sys.getswitchinterval()
    if us:
        sys.setswitchinterval(us / 1e6)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


@contextlib.contextmanager
def offloads_ahead(mib: int) -> Iterator[None]:
    """The copier's ``MAX_BYTES_AHEAD`` (how much of an offload waits on the copy engines
    at once) at ``mib`` MiB meanwhile (0: left as it is; above a job's bytes: that job is
    not paced), restored after: to measure what pacing costs a run's offloads."""
    from ..copy import copier

    previous = copier.MAX_BYTES_AHEAD
    if mib:
        copier.MAX_BYTES_AHEAD = mib << 20
    try:
        yield
    finally:
        copier.MAX_BYTES_AHEAD = previous


def make_caches(
    layers: int,
    pages: int,
    page_size: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Per-layer paged caches ``[page, k/v, token, head, dim]``, uninitialized: the
    benchmarks that check data write it first, and the rest only move bytes."""
    shape = (pages, 2, page_size, heads, head_dim)
    return [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]


def bytes_per_token(layers: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return layers * 2 * heads * head_dim * torch.empty(0, dtype=dtype).element_size()


# ---- running -----------------------------------------------------------------------------




def progress(total: float, desc: str, unit: str = "it") -> tqdm:
    """A progress bar on stderr; tqdm turns it off when stderr is not a terminal, so
    logs and tests stay clean."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None, leave=False)


def percentiles_ms(samples_s: Sequence[float] | np.ndarray, points: Sequence[float]) -> list[float]:
    """Percentiles of second-valued samples, in ms (zeros when there are none)."""
    if len(samples_s) == 0:
        return [0.0 for _ in points]
    return [float(v) for v in np.percentile(np.asarray(samples_s, dtype=float), points) * 1e3]


# ---- output ------------------------------------------------------------------------------


def format_cell(value: object) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        magnitude = abs(value)
        if magnitude >= 1000:
            return f"{value:,.0f}"
        if magnitude >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if magnitude < 0.01 else f"{value:.2f}"
    return str(value)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A right-aligned plain-text table under ``title``, on stdout."""
    cells = [[format_cell(v) for v in row] for row in rows]
    widths = [
        max(len(header), *(len(row[i]) for row in cells)) if cells else len(header)
        for i, header in enumerate(headers)
    ]
    print(title)
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    print()


def cpu_name() -> str:
    """The host CPU's model name (Linux: /proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def environment(device: torch.device) -> dict[str, object]:
    """What a reader needs to reproduce or judge a number."""
    host_cpu = cpu_name()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else host_cpu
    try:
        uvloop_version: str | None = importlib.metadata.version("uvloop")
    except importlib.metadata.PackageNotFoundError:
        uvloop_version = None
    return {
        "device": str(device),
        "device_name": device_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "uvloop": uvloop_version,
        "platform": platform.platform(),
        "host_cpu": host_cpu,
        "cpu_count": os.cpu_count(),
        "argv": list(sys.argv),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(
    path: str,
    bench: str,
    settings: object,
    device: torch.device,
    bench_argv: Sequence[str] | None,
    results: Mapping[str, object],
) -> None:
    """One JSON document: bench name, environment, settings and ``results``."""
    document = {
        "bench": bench,
        "environment": {**environment(device), "bench_argv": list(bench_argv or sys.argv[1:])},
        "settings": dataclasses.asdict(settings),  # type: ignore[call-overload]
        **results,
    }
    Path(path).write_text(json.dumps(document, indent=2, default=str) + "\n")


def save_plot(path: str, title: str, draw: Callable[[Any], None]) -> None:
    """Draw into a new figure (``draw(axes)``) and save it as a PNG. matplotlib is
    imported here, with the Agg backend, so the benchmarks run without it or a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    try:
        draw(axes)
        axes.set_title(title)
        axes.grid(True, alpha=0.3)
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)
