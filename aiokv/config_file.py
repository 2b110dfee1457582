"""Reading a config file: YAML with every key given once, its errors on one line naming
the file (the sections' own checks are :func:`.config.parse_config`'s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .config import EngineConfig, StoreConfig, parse_config
from .errors import ConfigError


class _GivenTwice(Exception):
    """A key given twice in one mapping: its dotted name and its second line (1-based)."""

    def __init__(self, name: str, line: int) -> None:
        super().__init__(name, line)
        self.name, self.line = name, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping raises _GivenTwice (YAML
    would keep the last silently: a whole second ``store:`` section replaces the first).
    Each mapping's dotted name (``store.remote``) is found first, from the node tree:
    PyYAML builds nested mappings later, out of their parents' order."""

    def construct_document(self, node: Any) -> Any:
        self._names: dict[int, str] = {}
        self._name(node, "")
        return super().construct_document(node)

    def _name(self, node: Any, name: str) -> None:
        if isinstance(node, yaml.MappingNode):
            if id(node) in self._names:  # an alias of a mapping named already
                return
            self._names[id(node)] = name
            for key_node, value in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                self._name(value, f"{name}.{key}" if name else str(key))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self._name(item, f"{name}[{index}]")

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[str] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):  # a list key (`? [a]`) is unhashable: YAML says so
                continue
            if key in seen:
                within = self._names.get(id(node), "")
                raise _GivenTwice(f"{within}.{key}" if within else key,
                                  key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_config(path: str | Path) -> tuple[EngineConfig, StoreConfig]:
    """Read a YAML config file. Raises ConfigError for a missing file or bad content."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    # Not only OSError: a path with a NUL byte is a ValueError (as UnicodeDecodeError is),
    # and one that is no path at all (None, an int) a TypeError.
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError("path", f"cannot read config file {str(path)!r}: {exc}") from exc
    try:
        document = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no objects
    except _GivenTwice as twice:
        raise ConfigError(twice.name, f"given twice in {str(path)!r} (again at line "
                                      f"{twice.line}); YAML would keep only the last") from None
    # Not only YAMLError: an integer longer than Python converts (4300 digits) is a raw
    # ValueError from the int constructor, and deep nesting a RecursionError.
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        raise ConfigError("path", f"{str(path)!r} is not valid YAML{_yaml_problem(exc, text)}"
                          ) from exc
    return parse_config(document)


def _yaml_problem(exc: BaseException, text: str) -> str:
    """`` at line L, column C: what is wrong``, on one line, for a YAML error (lines and
    columns 1-based). PyYAML's own text spans several lines (the context, the source line
    and a caret under it) and names the input "<unicode string>", not the file."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or type(exc).__name__
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        if exc.problem and exc.context:  # "while parsing a flow sequence", where it began
            within = exc.context
            if exc.context_mark is not None and exc.context_mark is not mark:
                within += (f" at line {exc.context_mark.line + 1}, "
                           f"column {exc.context_mark.column + 1}")
            what += f" ({within})"
    elif isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not take
        before = text[:exc.position]  # it gives a position in the text, not a mark
        line, column = before.count("\n") + 1, len(before) - before.rfind("\n")
        where = f" at line {line}, column {column}"
        what = f"unacceptable character #x{exc.character:04x}: {exc.reason}"
    else:  # ValueError (an integer of too many digits), RecursionError (deep nesting)
        where, what = "", str(exc) or type(exc).__name__
    return f"{where}: {' '.join(what.split())}"
