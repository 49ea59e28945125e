"""A small, deterministic binary encoding for the protocol's messages (no pickle).

Big-endian fixed-width integers, length-prefixed byte strings and counted lists; a reader
checks every count against a bound before it allocates, and that nothing is left over.
"""

from __future__ import annotations

import struct

from fedgpu.core.secagg.errors import SecAggError

MAGIC = b"FSA"
VERSION = 1


class Writer:
    def __init__(self, kind: int) -> None:
        self._parts: list[bytes] = [MAGIC, bytes([VERSION, kind])]

    def u8(self, v: int) -> Writer:
        self._parts.append(struct.pack(">B", v))
        return self

    def u32(self, v: int) -> Writer:
        self._parts.append(struct.pack(">I", v))
        return self

    def u64(self, v: int) -> Writer:
        self._parts.append(struct.pack(">Q", v))
        return self

    def f64(self, v: float) -> Writer:
        self._parts.append(struct.pack(">d", v))
        return self

    def raw(self, data: bytes) -> Writer:
        """Bytes whose length the reader knows (keys, shares, fixed-size fields)."""
        self._parts.append(bytes(data))
        return self

    def done(self) -> bytes:
        return b"".join(self._parts)


class Reader:
    def __init__(self, data: bytes | memoryview, kind: int, name: str) -> None:
        self._view = memoryview(data)
        self._pos = 0
        self._name = name
        head = self.take(len(MAGIC) + 2)
        if head[:3] != MAGIC or head[3] != VERSION or head[4] != kind:
            raise SecAggError(f"not a secure-aggregation {name} message (version {VERSION})")

    def take(self, n: int) -> memoryview:
        if n < 0 or self._pos + n > len(self._view):
            raise SecAggError(f"{self._name} message is truncated")
        part = self._view[self._pos:self._pos + n]
        self._pos += n
        return part

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return int(struct.unpack(">I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack(">Q", self.take(8))[0])

    def f64(self) -> float:
        return float(struct.unpack(">d", self.take(8))[0])

    def raw(self, n: int) -> bytes:
        return bytes(self.take(n))

    def count(self, bound: int, what: str) -> int:
        n = self.u32()
        if n > bound:
            raise SecAggError(f"{self._name} message lists {n} {what}, at most {bound}")
        return n

    def end(self) -> None:
        if self._pos != len(self._view):
            raise SecAggError(f"{self._name} message has {len(self._view) - self._pos} "
                              "unexpected trailing bytes")
