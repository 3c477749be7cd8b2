"""The codec: one message = one ZeroMQ multipart message, no pickle.

Frame 0 is a msgpack map: `v` (protocol version), `kind` (and `op`, for a control message), the
message's non-tensor fields, and `tensors`, a list of `{name, dtype, shape}`. Then one raw frame
per tensor, in that order.

Encoding copies nothing it need not: a tensor frame is a memoryview over the tensor's own
storage (the channel hands it to ZeroMQ with `copy=False`, which keeps a reference until sent).
Decoding builds tensors over the received frames (`torch.frombuffer`), so a proxy of any size
costs no copy on either side beyond what the transport does.

torch is imported lazily, on the first tensor, so `protocol` imports fast for the scheduler and
the client, which never see one.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import msgpack

from protocol.dtypes import WIRE_DTYPES
from protocol.errors import ProtocolError
from protocol.messages import message_class
from protocol.schema import Limits, TensorField, field_types, from_wire, tensor_fields, to_wire

# ZeroMQ's frames are read-only memoryviews and torch says so once per process; a stage only
# reads its inputs (tests/stages/test_runner.py checks). Filtered once here: a
# catch_warnings() block per tensor cost more than the rest of decoding it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

PROTOCOL_VERSION = 3  # 3: the frontend bundles a client's answers (channels.py send_many)
DEFAULT_LIMITS = Limits()

# The dtypes a tensor may travel in: name on the wire (torch's spelling) -> its protocol/dtypes.py
# row, which holds the bytes per element.
DTYPES = WIRE_DTYPES
RESERVED_KEYS = ("v", "kind", "op", "tensors")

Frame = Any  # bytes, memoryview, or zmq.Frame


def encode(msg: Any) -> list[Any]:
    """Frames for one message: [header, tensor frames...]. Tensor frames are zero-copy views."""
    kind, op = getattr(type(msg), "kind", None), getattr(type(msg), "op", None)
    if message_class(kind, op) is not type(msg):
        raise ProtocolError(f"cannot encode a {type(msg).__name__}: it is not a message kind")
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": kind}
    if op is not None:
        header["op"] = op
    names = tensor_fields(type(msg))
    tensor_meta = []
    frames: list[Any] = [None]
    for name, tp in field_types(type(msg)).items():
        value = getattr(msg, name)
        if tp is TensorField:
            continue
        header[name] = to_wire(value)
    for name in names:
        meta, frame = _tensor_to_frame(name, getattr(msg, name))
        tensor_meta.append(meta)
        frames.append(frame)
    header["tensors"] = tensor_meta
    try:
        frames[0] = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {kind}: {exc}") from None
    return frames


def decode(frames: list[Frame], limits: Limits = DEFAULT_LIMITS) -> Any:
    """One message from its frames, validated; any failure raises ProtocolError only."""
    msgs = decode_many(frames, limits, max_messages=1)
    return msgs[0]


def decode_many(
    frames: list[Frame], limits: Limits = DEFAULT_LIMITS, max_messages: int = 0
) -> list[Any]:
    """The messages of one ZeroMQ message that carries several back to back: each one's header,
    then its tensor frames (a ring link sends one such bundle per step, `encode_many`).
    `max_messages` caps them (0: `limits.max_bundle`). Raises ProtocolError only."""
    try:
        return _decode_many(frames, limits, max_messages or limits.max_bundle)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - the contract: nothing but ProtocolError escapes
        raise ProtocolError(f"undecodable message: {type(exc).__name__}: {exc}") from None


def encode_many(msgs: list[Any]) -> list[Any]:
    """Frames for several messages sent as one ZeroMQ message; `decode_many` splits them."""
    return [frame for msg in msgs for frame in encode(msg)]


def _decode_many(frames: list[Frame], limits: Limits, max_messages: int) -> list[Any]:
    if not frames:
        raise ProtocolError("empty message: no frames")
    buffers = [_buffer(f) for f in frames]
    total = sum(len(b) for b in buffers)
    if total > limits.max_message_bytes:
        raise ProtocolError(f"message of {total} bytes exceeds the {limits.max_message_bytes} cap")
    msgs = []
    start = 0
    while start < len(buffers):
        if len(msgs) == max_messages == 1:
            raise ProtocolError(f"{msgs[0].kind} needs {start} frames, got {len(buffers)}")
        if len(msgs) == max_messages:
            raise ProtocolError(f"more than {max_messages} messages in one bundle")
        msg, start = _decode_one(frames, buffers, start, limits)
        msgs.append(msg)
    return msgs


def _decode_one(
    frames: list[Frame], buffers: list[memoryview], start: int, limits: Limits
) -> tuple[Any, int]:
    """The message whose header is frame `start`; returns it and the index after its frames."""
    if len(buffers[start]) > limits.max_header_bytes:
        raise ProtocolError(f"header of {len(buffers[start])} bytes exceeds the cap")
    try:
        header = msgpack.unpackb(buffers[start], raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types on bad bytes
        raise ProtocolError(f"header is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a msgpack map")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r} is not {PROTOCOL_VERSION}")
    kind = header.get("kind")
    cls = message_class(kind, header.get("op"))
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r} (op {header.get('op')!r})")
    if "op" in header and not hasattr(cls, "op"):
        raise ProtocolError(f"{kind} has unknown field 'op'")
    tensors_meta = header.get("tensors")
    if not isinstance(tensors_meta, list):
        raise ProtocolError("header field 'tensors' must be a list")
    expected = tensor_fields(cls)
    if len(tensors_meta) != len(expected) or len(tensors_meta) > limits.max_tensors:
        raise ProtocolError(
            f"{kind} carries {len(expected)} tensors, header lists {len(tensors_meta)}"
        )
    end = start + 1 + len(tensors_meta)
    if end > len(buffers):
        raise ProtocolError(f"{kind} needs {end - start} frames, got {len(buffers) - start}")
    tensors = {}
    for i, (name, meta) in enumerate(zip(expected, tensors_meta), start=start + 1):
        tensors[name] = _frame_to_tensor(name, meta, buffers[i], limits)
    fields = {k: v for k, v in header.items() if k not in RESERVED_KEYS}
    return from_wire(cls, fields, limits, tensors=tensors), end


def _buffer(frame: Frame) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    buffer = getattr(frame, "buffer", None)  # zmq.Frame
    if buffer is None:
        raise ProtocolError(f"a frame must be bytes, got {type(frame).__name__}")
    return buffer


def _tensor_to_frame(name: str, tensor: Any) -> tuple[dict[str, Any], Any]:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ProtocolError(f"field {name} must be a torch.Tensor, got {type(tensor).__name__}")
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    if dtype_name not in DTYPES:
        raise ProtocolError(f"tensor {name} has dtype {dtype_name}, not one of {list(DTYPES)}")
    meta = {"name": name, "dtype": dtype_name, "shape": list(tensor.shape)}
    if tensor.numel() == 0:
        return meta, b""
    # Each call is skipped when it has nothing to do: every torch call costs microseconds.
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)  # numpy has no bfloat16; the bytes are what travel
    return meta, memoryview(flat.numpy()).cast("B")


_META_KEYS = frozenset({"name", "dtype", "shape"})
_torch: Any = None  # imported on the first tensor (see the module docstring)


def _frame_to_tensor(name: str, meta: Any, buffer: memoryview, limits: Limits) -> Any:
    if not isinstance(meta, dict) or meta.keys() != _META_KEYS:
        raise ProtocolError(f"tensor entry for {name} must have exactly name, dtype, shape")
    if meta["name"] != name:
        raise ProtocolError(f"expected tensor {name!r}, header names {meta['name']!r}")
    dtype_name, shape = meta["dtype"], meta["shape"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise ProtocolError(f"tensor {name} has dtype {dtype_name!r}, not one of {list(DTYPES)}")
    if (
        type(shape) is not list
        or len(shape) > limits.max_tensor_ndim
        or not all(type(n) is int and n >= 0 for n in shape)
    ):
        raise ProtocolError(f"tensor {name} shape must be a list of at most 8 non-negative ints")
    nbytes = len(buffer)
    if nbytes > limits.max_frame_bytes:
        raise ProtocolError(f"tensor {name} frame of {nbytes} bytes exceeds the cap")
    # Python ints do not overflow, so a huge declared shape is caught here before any allocation.
    expected = math.prod(shape) * DTYPES[dtype_name].num_bytes
    if expected != nbytes:
        raise ProtocolError(f"tensor {name} declares {expected} bytes, its frame has {nbytes}")

    global _torch
    if _torch is None:
        import torch

        _torch = torch
    dtype = getattr(_torch, dtype_name)
    if expected == 0:
        return _torch.empty(shape, dtype=dtype)
    tensor = _torch.frombuffer(buffer, dtype=dtype)
    if shape and len(shape) != 1:
        tensor = tensor.view(*shape)  # unpacked ints: the fastest form torch takes (~3 us)
    elif not shape:
        tensor = tensor.view(())
    if tensor.data_ptr() % tensor.element_size():
        tensor = tensor.clone()  # an unaligned frame: rare, and kernels want aligned data
    return tensor
