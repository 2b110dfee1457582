"""Checks at the API boundary: shapes, dtypes and types only (GPU values are never read
here). Each raises InvalidRequest (or ConfigError for the caches) naming the argument."""

from __future__ import annotations

import json
import reprlib
import threading
from collections.abc import Hashable, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch

from .errors import ConfigError, InvalidRequest
from .stores.local.ssd_format import MAX_NAMESPACE_BYTES

Int64Array = npt.NDArray[np.int64]  # as stores.base names it; validate imports no layer above


def kv_caches(kv_caches: Sequence[torch.Tensor]) -> tuple[int, int, torch.device, int]:
    """(num_pages, page_size, device, bytes per token over all layers) of valid caches."""
    if not isinstance(kv_caches, Sequence) or len(kv_caches) == 0:
        raise ConfigError("kv_caches", "must be a non-empty list of per-layer tensors")
    first = kv_caches[0]
    for layer, cache in enumerate(kv_caches):
        if not isinstance(cache, torch.Tensor):
            raise ConfigError(f"kv_caches[{layer}]", f"must be a tensor, got {type(cache)}")
        # Before anything reads the shape: a nested tensor has none (a raw RuntimeError),
        # and a quantized one passed every check and crashed the process at the first copy.
        if cache.is_nested or cache.layout is not torch.strided or cache.is_quantized:
            kind = ("a nested tensor" if cache.is_nested else
                    f"a quantized {cache.dtype} tensor" if cache.is_quantized else
                    f"a {cache.layout} tensor")
            raise ConfigError(f"kv_caches[{layer}]", f"must be a dense tensor of plain "
                                                    f"values, got {kind}")
        if cache.dim() != 5 or cache.shape[1] != 2:
            raise ConfigError(
                f"kv_caches[{layer}]",
                f"must be shaped [pages, 2, page_size, heads, head_dim], got {list(cache.shape)}",
            )
        for what, mine, theirs in (("shape", list(cache.shape), list(first.shape)),
                                   ("dtype", cache.dtype, first.dtype),
                                   ("device", cache.device, first.device)):
            if mine != theirs:
                raise ConfigError(f"kv_caches[{layer}]",
                                  f"has {what} {mine}, kv_caches[0] {theirs}: one for all layers")
        if not cache.is_contiguous():
            raise ConfigError(f"kv_caches[{layer}]", "must be contiguous")
        if cache.requires_grad:  # every load writes into it in place
            raise ConfigError(f"kv_caches[{layer}]", "requires grad: pass the tensor's "
                                                    ".detach() (the same memory)")
        if cache.is_conj() or cache.is_neg():  # copies move the memory, not the view
            raise ConfigError(f"kv_caches[{layer}]", "is a conjugate or negative view: its "
                                                    "memory holds other values; pass the "
                                                    "tensor it views")
        if cache.device.type == "meta":
            raise ConfigError(f"kv_caches[{layer}]", "is on the meta device: it has no memory")
    if first.numel() == 0:
        raise ConfigError("kv_caches[0]", f"has an empty dimension: {list(first.shape)}")
    num_pages, _, page_size = first.shape[:3]
    bytes_per_token = first[0, :, 0].numel() * first.element_size() * len(kv_caches)
    return int(num_pages), int(page_size), first.device, int(bytes_per_token)


def num_tokens(num_tokens: object) -> int:
    if type(num_tokens) is int and num_tokens >= 0:  # the usual case, without isinstance
        return num_tokens
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
        raise InvalidRequest("num_tokens", f"must be an int, got {type(num_tokens).__name__} "
                                           f"{reprlib.repr(num_tokens)}")
    if num_tokens < 0:
        raise InvalidRequest("num_tokens", f"must be >= 0, got {num_tokens}")
    return int(num_tokens)


def page_ids(page_ids: object, device: torch.device) -> torch.Tensor:
    # On every submit: attribute reads chosen for speed (device.type builds an object;
    # dtypes are singletons, so identity is enough).
    if not isinstance(page_ids, torch.Tensor):
        if not isinstance(page_ids, np.ndarray):
            raise InvalidRequest("page_ids", f"must be a tensor, got {type(page_ids).__name__}")
        if page_ids.dtype.kind != "i" or page_ids.dtype.itemsize not in (4, 8):
            raise InvalidRequest("page_ids", f"must be int32 or int64, got {page_ids.dtype}")
        # torch takes neither negative strides nor a foreign byte order.
        page_ids = torch.from_numpy(  # a copy: the caller may reuse its array at once
            np.array(page_ids, dtype=page_ids.dtype.newbyteorder("="), order="C", copy=True)
        )
    elif page_ids.is_cpu:
        page_ids = page_ids.clone()  # the caller may reuse its buffer before the batch runs
    if page_ids.is_nested:  # (a strided nested tensor has no .shape to name)
        raise InvalidRequest("page_ids", "must be a 1-D tensor, got a nested tensor")
    if page_ids.ndim != 1:
        raise InvalidRequest("page_ids", f"must be 1-D, got shape {list(page_ids.shape)}")
    if page_ids.is_neg():  # a device view: its memory holds the ids negated
        raise InvalidRequest("page_ids", "is a negative view: pass .resolve_neg()")
    if page_ids.layout is not torch.strided:  # a sparse tensor cannot be sliced per move
        raise InvalidRequest("page_ids", f"must be a dense tensor, got {page_ids.layout}")
    dtype = page_ids.dtype
    if dtype is not torch.int64 and dtype is not torch.int32:
        raise InvalidRequest("page_ids", f"must be int32 or int64, got {dtype}")
    if not page_ids.is_cpu and page_ids.device != device:
        raise InvalidRequest(
            "page_ids", f"is on {page_ids.device}; use the CPU or the caches' {device}"
        )
    return page_ids


def token_ids(token_ids: Any, num_tokens: int) -> Int64Array | None:
    """The caller's token ids, checked; None for the default (positions, made on the
    store thread: :func:`positions`)."""
    if token_ids is None:
        return None
    if isinstance(token_ids, torch.Tensor):
        if token_ids.device.type != "cpu":
            raise InvalidRequest("token_ids", "must be on the CPU (or a numpy array)")
        if token_ids.dtype is not torch.int64:
            raise InvalidRequest("token_ids", f"must be int64, got {token_ids.dtype}")
        if token_ids.is_nested or token_ids.layout is not torch.strided:  # numpy() refuses
            kind = "nested" if token_ids.is_nested else str(token_ids.layout)
            raise InvalidRequest("token_ids", f"must be a dense tensor, got a {kind} tensor")
        # A negative view's numpy() is a raw RuntimeError; its values are the negated ones
        # (as run_in_background's copy of it holds them).
        token_ids = token_ids.resolve_neg().numpy()
    if not isinstance(token_ids, np.ndarray) or token_ids.dtype != np.int64:
        raise InvalidRequest("token_ids", "must be an int64 numpy array or CPU tensor")
    if token_ids.shape != (num_tokens,):
        raise InvalidRequest("token_ids", f"must have shape ({num_tokens},), got {token_ids.shape}")
    return token_ids.copy()  # read on the store thread, after the caller may reuse it


def default_namespace(user_id: Hashable) -> tuple[str, ...]:
    """The key's namespace when the call gives none: ``uid:<n>`` for an int (the name
    recsys-examples gives its users, so a FlexKV cache stays shared with it) and
    ``uid:str:<s>`` for a str, so that ``1`` and ``"1"`` never share a key. bool (an int
    to Python) and every other type are refused: their str() is no stable, distinct name
    (a tuple's repr, an object's address), so the caller must name the key itself."""
    kind = type(user_id)
    if kind is int:  # the usual cases first, without isinstance
        if -_INT_FITS < user_id < _INT_FITS:
            return (f"uid:{user_id}",)
        return _int_key(cast(int, user_id))  # kind is int
    if kind is str:
        return _fits("user_id", (f"uid:str:{user_id}",))
    if isinstance(user_id, (bool, np.bool_)):
        raise InvalidRequest(
            "user_id", f"must be an int or a str, got bool {user_id!r}; or pass namespace="
        )
    if isinstance(user_id, (int, np.integer)):  # an IntEnum, a numpy integer: its value
        return _int_key(int(user_id))
    if isinstance(user_id, str):  # a str subclass (a StrEnum): its characters
        return _fits("user_id", ("uid:str:" + str.__str__(user_id),))
    raise InvalidRequest(
        "user_id",
        f"must be an int or a str to name a key, got {kind.__name__} {reprlib.repr(user_id)}; "
        "pass namespace= (a list of str) to name the key yourself",
    )


# An int id below this in size fits an SSD header (its key, sign included, at most 4036
# bytes as JSON): the usual id is checked by one comparison, not by writing out its key.
_INT_FITS = 10 ** (MAX_NAMESPACE_BYTES - len('["uid:-"]'))


def _int_key(user_id: int) -> tuple[str, ...]:
    """An int id's key, refused (naming ``user_id``) where it does not fit an SSD header,
    as a str id's is: the SSD tier could not store it, and dropped it at host eviction."""
    try:
        text = str(user_id)
    except ValueError:  # more digits than Python writes out (sys.set_int_max_str_digits)
        raise InvalidRequest("user_id", f"is an int of {user_id.bit_length()} bits: its "
                                        f"key is longer than {MAX_NAMESPACE_BYTES} bytes as "
                                        f"JSON, the most an SSD block header holds") from None
    return _fits("user_id", (f"uid:{text}",))


def namespace(namespace: Any, user_id: Hashable) -> tuple[str, ...]:
    if namespace is None:
        return default_namespace(user_id)
    kind = type(namespace)
    # list and tuple first: the Sequence check is an ABC lookup, slow on every submit.
    if kind is not list and kind is not tuple and (
        isinstance(namespace, str) or not isinstance(namespace, Sequence)
    ):
        raise InvalidRequest("namespace", f"must be a list of str, got {kind.__name__} "
                                          f"{reprlib.repr(namespace)}")
    for part in namespace:  # a plain loop: a generator in all() costs a frame more
        if not isinstance(part, str):
            raise InvalidRequest("namespace", f"must be a list of str, got an item of "
                                              f"{type(part).__name__} {reprlib.repr(part)}")
    return _fits("namespace", tuple(namespace))


def _fits(field: str, key: tuple[str, ...]) -> tuple[str, ...]:
    """``key`` if every store takes it (else InvalidRequest naming it): UTF-8 text (the
    store server's wire and the remote tier's key name encode it; a lone surrogate fails
    there, on the store thread, for the whole batch) that fits in an SSD block's header
    (so that a key never stops at the SSD tier silently)."""
    # JSON bytes at most: 6 a character (\uXXXX), 12 for one outside the BMP (a pair of
    # them), which only a non-ASCII part holds. The exact size only for long keys.
    bound = 3 * len(key) + 2
    for part in key:
        if part.isascii():
            bound += 6 * len(part)
            continue
        try:
            part.encode()
        except UnicodeEncodeError as exc:
            raise InvalidRequest(field, f"names a key that is not UTF-8 text (the surrogate "
                                        f"{exc.object[exc.start:exc.end]!r} in "
                                        f"{reprlib.repr(part)})") from exc
        bound += 12 * len(part)
    if bound <= MAX_NAMESPACE_BYTES:
        return key
    size = len(json.dumps(list(key), separators=(",", ":")).encode())
    if size > MAX_NAMESPACE_BYTES:
        raise InvalidRequest(field, f"names a key of {size} bytes as JSON "
                                    f"({reprlib.repr(key)}); at most {MAX_NAMESPACE_BYTES}")
    return key


_positions: Int64Array = np.arange(0, dtype=np.int64)


def positions(num_tokens: int) -> Int64Array:
    """Positions 0..num_tokens-1, the default token ids (the recommender case, an
    append-only history): a read-only view of one shared array, grown as needed.

    Called on the store thread, as a request is matched, never on the loop, and only with
    lengths the engine has bounded: a lookup's by what the store can hold (or
    ``max_lookup_tokens``), an offload's by its page ids. So the array stays within twice
    the longest key the store could hold (8 bytes a token), whatever a caller asks."""
    global _positions
    have = _positions  # one read: another engine's store thread may swap it meanwhile
    if num_tokens > len(have):
        have = np.arange(max(num_tokens, 2 * len(have), 4096), dtype=np.int64)
        have.flags.writeable = False
        _positions = have
    return have[:num_tokens]


def close_args(drain: object, timeout: object) -> tuple[bool, float]:
    """``aclose``'s arguments: a bool and a number of seconds (:func:`seconds`; a close
    always ends: None or inf would let a stuck store hold it for ever)."""
    if not isinstance(drain, bool):
        raise InvalidRequest("drain", f"must be a bool, got {type(drain).__name__} "
                                      f"{reprlib.repr(drain)}")
    return drain, seconds("timeout", timeout, "a number of seconds")


def wait_timeout(timeout: object) -> float | None:
    """A blocking wait's ``timeout``: None (no limit) or a number of seconds (:func:`seconds`)."""
    return None if timeout is None else seconds("timeout", timeout, "a number of seconds or None")


def seconds(field: str, value: object, wanted: str = "a number of seconds") -> float:
    """``value`` as seconds: a number >= 0 and at most threading.TIMEOUT_MAX (about 292
    years), the longest wait a lock or thread join takes (they raise OverflowError beyond,
    inside a waiting or closing thread); else InvalidRequest naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidRequest(field, f"must be {wanted}, got "
                                    f"{type(value).__name__} {reprlib.repr(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float: beyond the bound anyway
        number = float("inf")
    if not 0 <= number <= threading.TIMEOUT_MAX:
        raise InvalidRequest(field, f"must be a finite number of seconds >= 0, at most "
                                    f"{threading.TIMEOUT_MAX:g} (threading.TIMEOUT_MAX), "
                                    f"got {reprlib.repr(value)}")
    return number


def at_most(field: str, value: int, bound: int, what: str) -> None:
    """InvalidRequest naming ``field``, ``value`` and ``bound`` when ``value > bound``."""
    if value > bound:
        raise InvalidRequest(field, f"{value} is more than {what} ({bound})")


def offload_pages(num_tokens: int, pages: int, num_pages: int) -> None:
    """InvalidRequest unless an offload's ``pages`` full pages fit in the caches (more would
    name a page twice)."""
    if pages > num_pages:
        raise InvalidRequest(
            "num_tokens",
            f"{num_tokens} tokens are {pages} full pages, more than the caches' {num_pages}",
        )


def store_holds(num_tokens: int, pages: int, page_size: int, capacity: int | None) -> None:
    """InvalidRequest unless an offload's ``pages`` full pages fit in the store's tiers
    together, where it says how much they hold (``capacity``, tokens): such an offload
    could never be stored."""
    if capacity is not None and pages * page_size > capacity:
        raise InvalidRequest(
            "num_tokens",
            f"{num_tokens} tokens ({pages} full pages) are more than the store can ever hold "
            f"({capacity}: its tiers' blocks x page_size {page_size})",
        )
