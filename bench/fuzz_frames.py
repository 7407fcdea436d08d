"""FrameMaker: hostile data-plane frames for `kvdepot bench fuzz`, built from the protocol itself.

Role: every message type of the protocol's `Request` union is read once through msgspec's type
information (fields, their types, their Meta bounds), so a field added to the protocol is fuzzed
without a change here. A few fields are known by name and get values that make sense to the
sidecar (engine ids, oids and request ids seen in replies, token bytes cut at the chunk size, KV
planes inside the fuzzer's own shared-memory region), because random values there only ever hit
the first check.

State (`Harvest`): ids learnt from replies (engine ids, oids), bounded; the generator's RNG.
Touched by the fuzzer's main thread only.

Primitives in call order: `FrameMaker(rng, region, chunk_size, max_frame_bytes)`,
`learn(reply)` for each reply, `frames() -> (kind, [frame, ...])` for each message to send.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import msgspec.inspect as mi

from kvdepot_connector import protocol as p

#: how a message is spoilt, with its weight
KINDS = {
    "valid": 40, "boundary": 14, "out_of_range": 8, "wrong_type": 6, "unknown_field": 4,
    "missing_field": 3, "unknown_op": 2, "truncated": 6, "extra_frames": 3, "zero_length": 2,
    "random_bytes": 8, "kv_planes": 4,
}  # fmt: skip
#: the share of hostile lists that are as long as the bounds allow
BIG_LIST_SHARE = 0.01
#: lists longer than this reuse one cached item (a frame stays cheap to build)
_BIG_LIST = 256
_TYPES: list[mi.StructType] = [t for t in mi.type_info(p.Request).types if isinstance(t, mi.StructType)]  # type: ignore[attr-defined]
_WEIRD_STR = ["", "\x00", "é" * 40, "../../etc/passwd", "%s%n", "\ud7ff", " "]
_DTYPES = ["uint8", "float16", "bfloat16", "float32", "int64", "bool", "", "x" * 32]


@dataclass
class Harvest:
    """Ids the sidecar handed out (to anyone): what a hostile client would reuse."""

    engine_ids: deque[int] = field(default_factory=lambda: deque(maxlen=64))
    oids: deque[int] = field(default_factory=lambda: deque(maxlen=4096))
    layouts: dict[int, int] = field(default_factory=dict)  # engine id -> chunk bytes


@dataclass(frozen=True)
class Region:
    """The fuzzer's own shared-memory region: the only memory named in KV-plane handles."""

    name: str
    size: int


class FrameMaker:
    def __init__(self, rng: random.Random, region: Region, chunk_size: int, max_frame_bytes: int) -> None:
        self.rng = rng
        self.region = region
        self.chunk_size = chunk_size
        self.max_frame_bytes = max_frame_bytes
        self.harvest = Harvest()
        self.request_ids = [f"fuzz-{i}" for i in range(32)]
        # A few token sequences, so stores, lookups and retrieves of different frames meet.
        self.token_pool = [
            p.encode_tokens([rng.randrange(1 << 32) for _ in range(chunk_size * rng.randint(1, 8))])
            for _ in range(16)
        ]
        self.layout = p.Layout(
            dtype="float16", num_layers=1, num_kv_heads=1, head_dim=8, block_size=chunk_size,
            kind="fuzz", chunk_size=chunk_size,
        )  # fmt: skip
        self._kinds = list(KINDS)
        self._weights = list(KINDS.values())
        self._big_lists: dict[int, list[Any]] = {}

    # --- feedback ------------------------------------------------------------------------------

    def learn(self, reply: p.Reply) -> None:
        if isinstance(reply, p.RegisterReply):
            self.harvest.engine_ids.append(reply.engine_id)
            self.harvest.layouts[reply.engine_id] = reply.chunk_bytes
        elif isinstance(reply, p.StoreReply):
            self.harvest.oids.extend(s.oid for s in reply.slots if s.oid)

    # --- frames --------------------------------------------------------------------------------

    def frames(self) -> tuple[str, list[bytes]]:
        kind = self.rng.choices(self._kinds, self._weights)[0]
        return kind, getattr(self, "_" + kind)()

    def sane_register(self) -> bytes:
        """A REGISTER that succeeds: the engine ids it yields feed later frames."""
        layout = msgspec.structs.asdict(self.layout)
        return _encode({"op": "register", "id": self._id(), "model": "fuzz-model", "layout": layout})

    def _valid(self) -> list[bytes]:
        return [_encode(self._message(self.rng.choice(_TYPES), boundary=False))]

    def _boundary(self) -> list[bytes]:
        return [_encode(self._message(self.rng.choice(_TYPES), boundary=True))]

    def _spoil(self, how: str) -> list[bytes]:
        t = self.rng.choice(_TYPES)
        msg = self._message(t, boundary=True)
        fields = [f for f in t.fields if f.name in msg]
        f = self.rng.choice(fields)
        if how == "out_of_range":
            msg[f.encode_name] = self._out_of_range_value(f.type)
        elif how == "wrong_type":
            msg[f.encode_name] = self.rng.choice(
                [None, "x", -1, 1.5, [1], {"a": 1}, b"\x00", True, (1 << 64) - 1]
            )
        elif how == "missing_field":
            del msg[f.encode_name]
        return [_encode(msg)]

    def _out_of_range(self) -> list[bytes]:
        return self._spoil("out_of_range")

    def _wrong_type(self) -> list[bytes]:
        return self._spoil("wrong_type")

    def _missing_field(self) -> list[bytes]:
        return self._spoil("missing_field")

    def _unknown_field(self) -> list[bytes]:
        msg = self._message(self.rng.choice(_TYPES), boundary=False)
        msg[self.rng.choice(["extra", "op2", "__class__", "x" * 300])] = self.rng.choice([1, "v", None])
        return [_encode(msg)]

    def _unknown_op(self) -> list[bytes]:
        op = self.rng.choice(["", "HELLO", "pong", "error", "x" * 1000, "lookup\x00", 7])
        return [_encode({"op": op, "id": self._id()})]

    def _truncated(self) -> list[bytes]:
        frame = self._valid()[0]
        return [frame[: self.rng.randrange(max(1, len(frame)))]]

    def _extra_frames(self) -> list[bytes]:
        frame = self._valid()[0]
        extra = [b"", frame, self.rng.randbytes(self.rng.randrange(64))]
        return [frame, *self.rng.sample(extra, self.rng.randint(1, 3))]

    def _zero_length(self) -> list[bytes]:
        return [b""]

    def _random_bytes(self) -> list[bytes]:
        n = self.rng.choice([1, 2, 8, 64, 1024, self.rng.randrange(1, 4096)])
        data = self.rng.randbytes(n)
        if self.rng.random() < 0.5:  # a msgpack map header first: random bytes that look like a message
            data = bytes([0x80 | self.rng.randrange(16)]) + data
        return [data]

    def oversize(self) -> list[bytes]:
        """A frame just over the sidecar's limit (the transport drops the connection that sent it)."""
        return [b"\x81" + bytes(self.max_frame_bytes)]

    def _kv_planes(self) -> list[bytes]:
        """A REGISTER_KV_CACHE whose planes lie in the fuzzer's region and add up to the fuzz layout,
        or one that almost does: so LOAD_BLOCKS / SAVE_BLOCKS get as far as copying."""
        chunk_bytes = self.layout.chunk_bytes
        planes = self.rng.choice([1, 2, 4, 64, 1024])
        if chunk_bytes % planes:
            planes = 1
        width = chunk_bytes // planes
        blocks = max(1, self.region.size // chunk_bytes)
        skew = self.rng.choice([0, 0, 0, 1, -1, blocks])
        layers = [
            {
                "kind": "cpu-shm", "dtype": "uint8", "name": self.region.name,
                "shape": [blocks + skew, width], "stride": [chunk_bytes, 1],
                "offset": i * width + (skew if i == planes - 1 else 0),
            }
            for i in range(planes)
        ]  # fmt: skip
        return [_encode({"op": "register_kv_cache", "id": self._id(), "engine_id": self._engine_id(),
                         "layers": layers})]  # fmt: skip

    # --- values --------------------------------------------------------------------------------

    def _message(self, t: mi.StructType, *, boundary: bool) -> dict[str, Any]:
        cfg = t.cls.__struct_config__
        msg: dict[str, Any] = {str(cfg.tag_field): cfg.tag}
        for f in t.fields:
            if not f.required and self.rng.random() < 0.3:
                continue
            msg[f.encode_name] = self._value(f.name, f.type, boundary)
        return msg

    def _value(self, name: str, t: Any, boundary: bool) -> Any:
        rng = self.rng
        named = self._named(name, t, boundary)
        if named is not _NONE:
            return named
        if isinstance(t, mi.IntType):
            lo, hi = _int_bounds(t)
            if boundary:
                return rng.choice([lo, lo + 1, hi - 1, hi, max(lo, 0), min(hi, 1)])
            return rng.randint(lo, min(hi, lo + 1000))
        if isinstance(t, mi.StrType):
            top = t.max_length if t.max_length is not None else 1024
            low = t.min_length or 0
            if boundary:
                return rng.choice(["x" * low, "y" * top, rng.choice(_WEIRD_STR)[:top].ljust(low, "z")])
            return "".join(rng.choices("abcdef0123", k=rng.randint(low, min(top, low + 12))))
        if isinstance(t, mi.BytesType):
            top = t.max_length if t.max_length is not None else 4096
            return rng.randbytes(
                rng.choice([0, 1, min(top, 16), top] if boundary else [rng.randrange(min(top, 64) + 1)])
            )
        if isinstance(t, mi.BoolType):
            return rng.random() < 0.5
        if isinstance(t, mi.FloatType):
            return rng.choice([0.0, -1.0, 1e300, float("inf"), float("nan"), rng.random()])
        if isinstance(t, mi.NoneType):
            return None
        if isinstance(t, mi.UnionType):
            return self._value(name, rng.choice(t.types), boundary)
        if isinstance(t, mi.ListType):
            return self._list(name, t, boundary)
        if isinstance(t, mi.StructType):
            return {f.encode_name: self._value(f.name, f.type, boundary) for f in t.fields}
        if isinstance(t, mi.EnumType | mi.LiteralType):
            values = [e.value for e in t.cls] if isinstance(t, mi.EnumType) else list(t.values)
            return rng.choice(values)
        return None

    def _list(self, name: str, t: mi.ListType, boundary: bool) -> list[Any]:
        rng = self.rng
        top = t.max_length if t.max_length is not None else 1024
        low = t.min_length or 0
        if boundary:  # the longest list the bounds allow is costly for the sidecar: now and then
            n = (
                top
                if rng.random() < BIG_LIST_SHARE
                else rng.choice([low, low + 1, min(top, 8), min(top, 300)])
            )
        else:
            n = rng.randint(low, min(top, low + 8))
        if n <= _BIG_LIST:
            return [self._value(name + "[]", t.item_type, boundary) for _ in range(n)]
        if n not in self._big_lists:  # built once: the biggest frames cost the sidecar, not the fuzzer
            item = self._value(name + "[]", t.item_type, boundary)
            self._big_lists[n] = [item] * n
        return self._big_lists[n]

    def _named(self, name: str, t: Any, boundary: bool) -> Any:
        """Fields whose meaning the sidecar checks first: values that get past that check."""
        rng = self.rng
        if name == "engine_id" and rng.random() < 0.8:
            return self._engine_id()
        if name == "oids[]" and self.harvest.oids and rng.random() < 0.8:
            return rng.choice(self.harvest.oids)
        if name == "oids" and rng.random() < 0.01:
            return list(range(1, min(t.max_length or 1 << 16, 1 << 16)))  # every low id at once
        if name == "request_id" and rng.random() < 0.8:
            return rng.choice(self.request_ids)
        if name == "tokens" and rng.random() < 0.9:
            return self._tokens(boundary)
        if name == "version" and rng.random() < 0.7:
            return rng.choice([p.PROTOCOL_VERSION, p.PROTOCOL_VERSION, 0, p.PROTOCOL_VERSION + 1])
        if name == "layout" and rng.random() < 0.5:
            return msgspec.structs.asdict(self.layout)
        if name == "model" and rng.random() < 0.9:
            return rng.choice(["fuzz-model", "fuzz-other", ""])
        if name == "name":  # a shared-memory name: only ours, or names that cannot exist
            return rng.choice(
                [self.region.name, "", ".hidden", "a/b", f"kvdepot-fuzz-absent-{rng.getrandbits(64):x}"]
            )
        if name == "kind" and rng.random() < 0.7:
            return rng.choice(["cpu-shm", "cuda-ipc", "fuzz"])
        if name == "dtype":
            return rng.choice(_DTYPES)
        if name == "cache_salt" and rng.random() < 0.8:
            return rng.choice(["", "tenant-a", "tenant-b", None])
        return _NONE

    def _tokens(self, boundary: bool) -> bytes:
        rng = self.rng
        tokens = rng.choice(self.token_pool)
        if not boundary:
            return tokens
        return rng.choice([
            b"", tokens[:-1], tokens + b"\x00", tokens[: 4 * (self.chunk_size - 1)],
            tokens * rng.choice([2, 64]), bytes(4 * self.chunk_size), b"\xff" * (4 * self.chunk_size),
        ])  # fmt: skip

    def _engine_id(self) -> int:
        if self.harvest.engine_ids and self.rng.random() < 0.8:
            return self.rng.choice(self.harvest.engine_ids)
        return self.rng.choice([1, 2, (1 << 31) - 1, self.rng.randrange(1, 1 << 31)])

    def _id(self) -> int:
        return self.rng.randrange(1 << 40)

    def _out_of_range_value(self, t: Any) -> Any:
        if isinstance(t, mi.IntType):
            lo, hi = _int_bounds(t)
            value = self.rng.choice([lo - 1, hi + 1, -(1 << 63), (1 << 64) - 1])
            return min(max(value, -(1 << 63)), (1 << 64) - 1)  # what msgpack can carry
        if isinstance(t, mi.StrType | mi.BytesType):
            over = (t.max_length if t.max_length is not None else 1 << 16) + 1
            return "s" * over if isinstance(t, mi.StrType) else b"b" * over
        if isinstance(t, mi.ListType):
            over = (t.max_length if t.max_length is not None else 1 << 16) + 1
            return [0] * min(over, self.max_frame_bytes // 2)
        return self.rng.choice([[], {}, -1])


def _int_bounds(t: mi.IntType) -> tuple[int, int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(1 << 63))
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else (1 << 63) - 1)
    return lo, hi


def _encode(msg: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode(msg)


_NONE = object()
