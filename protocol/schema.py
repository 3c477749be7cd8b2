"""Turn dataclasses into msgpack-ready values and back, checking every field's type.

The schema is the dataclasses' own type hints, read once per class. Supported annotations:
`int`, `float`, `str`, `bool`, `list[X]`, `dict[str, X]`, `X | None`, `Any` (JSON-like values
only), a nested dataclass, and `Tensor` (moved to a raw frame by the codec). Anything a peer
sends that does not fit raises `ProtocolError` naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

from protocol.errors import ProtocolError

MAX_INT = 2**63 - 1
MIN_INT = -(2**63)
MAX_ANY_DEPTH = 6


class TensorField:
    """Stands for `torch.Tensor` in type hints, so the schema never imports torch."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Size caps a decoder enforces; a client socket uses smaller ones than a ring socket."""

    max_header_bytes: int = 64 << 20
    max_frame_bytes: int = 1 << 30
    max_message_bytes: int = 2 << 30
    max_tensors: int = 8
    max_tensor_ndim: int = 8
    max_list_len: int = 1 << 20
    max_str_len: int = 1 << 22
    max_bundle: int = 32  # messages in one ZeroMQ message (a ring link's step bundle)


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved type hint of each init field of a message dataclass."""
    hints = typing.get_type_hints(cls, localns={"Tensor": TensorField, "Any": Any})
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


@functools.cache
def tensor_fields(cls: type) -> tuple[str, ...]:
    return tuple(name for name, tp in field_types(cls).items() if tp is TensorField)


_SCALARS = (int, float, str, bool, type(None))


def to_wire(value: Any) -> Any:
    """A dataclass (possibly nested) as plain dicts and lists, without copying tensors."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, list) and all(isinstance(v, _SCALARS) for v in value):
        return value  # token ids, logprobs: msgpack takes the list as it is
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


def from_wire(
    cls: type,
    fields: dict[str, Any],
    limits: Limits,
    path: str = "",
    tensors: dict[str, Any] | None = None,
) -> Any:
    """Build `cls` from a decoded map (which must name exactly its non-tensor fields) and the
    already-decoded tensors."""
    wire_names, wire_fields = _wire_fields(cls)
    if fields.keys() != wire_names:
        unknown = set(fields) - wire_names
        if unknown:
            raise ProtocolError(f"{path or cls.__name__} has unknown field {sorted(unknown)[0]!r}")
        missing = wire_names - set(fields)
        raise ProtocolError(f"{path or cls.__name__} is missing field {sorted(missing)[0]!r}")
    kwargs = tensors.copy() if tensors else {}
    for name, tp, as_is in wire_fields:
        value = fields[name]
        # The common cases without a call: ints, None where allowed and short strings, most of
        # a ring header and of a step's deltas.
        if type(value) in as_is:
            kwargs[name] = value
        elif tp is str and type(value) is str and len(value) <= limits.max_str_len:
            kwargs[name] = value
        else:
            kwargs[name] = _check(value, tp, f"{path}{name}", limits)
    return _construct(cls, kwargs)


@functools.cache
def _wire_fields(
    cls: type,
) -> tuple[frozenset[str], tuple[tuple[str, Any, tuple[type, ...]], ...]]:
    """The fields that travel in the header: their names, and (name, type, the value types
    _check would return unchanged without looking further) triples."""
    triples = tuple(
        (n, tp, _as_is(tp)) for n, tp in field_types(cls).items() if tp is not TensorField
    )
    return frozenset(n for n, _, _ in triples), triples


def _as_is(tp: Any) -> tuple[type, ...]:
    """Exact value types that `_check(value, tp)` returns as they are: int for int, float for
    float (an int there becomes a float: not as is), None where `tp` allows it, and the same
    for the type inside an `X | None`. bool is never int here (type(True) is bool)."""
    scalars = {int: (int,), float: (float,)}
    origin, args = _shape(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = [t for t in args if t is not type(None)]
        return (type(None), *(scalars.get(inner[0], ()) if len(inner) == 1 else ()))
    return scalars.get(tp, ())


def _construct(cls: type, kwargs: dict[str, Any]) -> Any:
    try:
        return cls(**kwargs)
    except ProtocolError:
        raise
    except (TypeError, ValueError) as exc:  # a __post_init__ that is not ours to word
        raise ProtocolError(f"invalid {cls.__name__}: {exc}") from None


@functools.cache
def _shape(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    return typing.get_origin(tp), typing.get_args(tp)


# For a list of these, one pass of `type(v) is T` accepts the common case without per-item
# calls (bool is not int here, as everywhere in the schema).
_FAST_ITEM_TYPES = {int: (int,), float: (float, int), str: (str,)}


def _check(value: Any, tp: Any, path: str, limits: Limits) -> Any:
    origin, args = _shape(tp)
    if origin is list and isinstance(value, list) and len(value) <= limits.max_list_len:
        fast = _FAST_ITEM_TYPES.get(args[0])
        if fast is not None and all(type(v) in fast for v in value):
            if args[0] is float:
                return [float(v) for v in value]
            if args[0] is not str or all(len(v) <= limits.max_str_len for v in value):
                return value
    if origin in (typing.Union, types.UnionType):
        options = args
        if value is None and type(None) in options:
            return None
        (inner,) = [t for t in options if t is not type(None)]
        return _check(value, inner, path, limits)
    if tp is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"field {path} must be a bool")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"field {path} must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"field {path} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(f"field {path} must be a string")
        if len(value) > limits.max_str_len:
            raise ProtocolError(f"field {path} is longer than {limits.max_str_len} characters")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"field {path} must be a list")
        if len(value) > limits.max_list_len:
            raise ProtocolError(f"field {path} has more than {limits.max_list_len} entries")
        (item_tp,) = args
        if dataclasses.is_dataclass(item_tp):  # a step's deltas: each map to _map, not down _check
            return [_map(v, item_tp, f"{path}[{i}]", limits) for i, v in enumerate(value)]
        return [_check(v, item_tp, f"{path}[{i}]", limits) for i, v in enumerate(value)]
    if origin is dict:
        _, value_tp = args
        if not isinstance(value, dict):
            raise ProtocolError(f"field {path} must be a map")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError(f"field {path} must have string keys")
            out[k] = _check(v, value_tp, f"{path}.{k}", limits)
        return out
    if tp is Any:
        _check_json_like(value, path, limits, depth=0)
        return value
    if dataclasses.is_dataclass(tp):
        return _map(value, tp, path, limits)
    raise ProtocolError(f"field {path} has a type the protocol cannot carry")  # our bug, not theirs


def _map(value: Any, cls: type, path: str, limits: Limits) -> Any:
    """A dataclass field (or list item): a map, built by from_wire."""
    if not isinstance(value, dict):
        raise ProtocolError(f"field {path} must be a map")
    return from_wire(cls, value, limits, path=f"{path}.")


def _check_json_like(value: Any, path: str, limits: Limits, depth: int) -> None:
    """`Any` fields (a node's ring flags): nested maps/lists of scalars, bounded in depth."""
    if depth > MAX_ANY_DEPTH:
        raise ProtocolError(f"field {path} is nested deeper than {MAX_ANY_DEPTH}")
    if value is None or isinstance(value, (bool, int, float)):
        return
    if isinstance(value, str):
        if len(value) > limits.max_str_len:
            raise ProtocolError(f"field {path} is longer than {limits.max_str_len} characters")
        return
    if isinstance(value, list):
        if len(value) > limits.max_list_len:
            raise ProtocolError(f"field {path} has more than {limits.max_list_len} entries")
        for i, v in enumerate(value):
            _check_json_like(v, f"{path}[{i}]", limits, depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError(f"field {path} must have string keys")
            _check_json_like(v, f"{path}.{k}", limits, depth + 1)
        return
    raise ProtocolError(f"field {path} holds a {type(value).__name__}, which is not JSON-like")
