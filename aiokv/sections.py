"""The config dataclasses as sections of the YAML (``engine``, ``store``, ``store.remote``).

A key a section does not have is a :class:`~aiokv.errors.ConfigError` naming
``<section>.<key>`` and the keys it has, whichever way it comes: from a mapping (the YAML,
:func:`build_section`) or as a keyword of the class itself (``EngineConfig(bogus=1)``,
``dataclasses.replace``), where the dataclass's own ``__init__`` would raise a TypeError
that names neither the section nor the keys it takes (:func:`keys_checked`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from .errors import ConfigError

C = TypeVar("C")

# Past this, times in µs or ms stop converting to seconds (a float) and counts stop
# meaning anything; a typed error beats an OverflowError deep in start() or a thread.
MAX_INT = 10**12


def _keys(cls: type[Any]) -> tuple[str, ...]:
    """The keyword arguments of a config dataclass, in field order."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


def check_keys(section: str, keys: tuple[str, ...], given: Iterable[object],
               positional: int = 0) -> None:
    """ConfigError for a key of ``given`` that is not in ``keys`` (the section's), for more
    than ``len(keys)`` positional arguments, or for a key that one of the first
    ``positional`` arguments already set."""
    if positional > len(keys):
        raise ConfigError(section, f"takes at most {len(keys)} positional arguments "
                          f"({', '.join(keys)}), got {positional}")
    for key in given:
        if key not in keys:
            raise ConfigError(
                f"{section}.{key}", f"unknown key (known: {', '.join(sorted(keys))})"
            )
        if keys.index(key) < positional:
            raise ConfigError(f"{section}.{key}", "given twice: positionally and by keyword")


def keys_checked(section: str) -> Callable[[type[C]], type[C]]:
    """Class decorator, above ``@dataclass``: the class's ``__init__`` refuses an unknown
    keyword (and too many or repeated arguments) with :func:`check_keys`'s ConfigError
    before the dataclass's ``__init__`` runs. Equality, repr, ``dataclasses.replace`` and
    pickling are the dataclass's own (unpickling does not call ``__init__``)."""

    def decorate(cls: type[C]) -> type[C]:
        keys = _keys(cls)
        init = cls.__init__

        @functools.wraps(init)  # inspect.signature and help() show the dataclass's own
        def __init__(self: C, *args: Any, **kwargs: Any) -> None:
            check_keys(section, keys, kwargs, len(args))
            init(self, *args, **kwargs)

        setattr(cls, "__init__", __init__)  # noqa: B010  # mypy refuses an assignment
        return cls

    return decorate


def build_section(cls: type[C], section: str, raw: object) -> C:
    """``cls`` from a YAML section: ConfigError naming an unknown key or a non-mapping."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(section, f"must be a mapping, got {type(raw).__name__}")
    check_keys(section, _keys(cls), raw)  # also a key that is not a string, before **raw
    return cls(**raw)


__all__ = ["build_section", "check_keys", "keys_checked"]
