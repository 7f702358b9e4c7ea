"""Random and mutated requests for the RPC fuzz test (test_fuzz.py), from the generated descriptors.

Four kinds, chosen per message: random bytes (which must not parse into anything harmful), a
random message of the request type (every field set with probability 1/2 to a value from its
type's edge cases: 0, -1, the extremes of its width, NaN and infinities, empty, huge and odd
strings, unknown enum values, long lists, nested messages), a valid sample request with one or
two of its fields (nested ones too) set to such values, and a valid sample request mutated at the
byte level (flips, truncations, duplicated spans, appended garbage). A `RequestMeta` gets
a fresh request id (mostly) and the service's run, none, or an unknown one. Seeded: one seed
gives one sequence. Hypothesis has no protobuf strategy and its test-case model does not fit a
bounded stream of calls against a live server; this is the small generator the test needs.
"""

from __future__ import annotations

import math
import random
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

F = FieldDescriptor
INTS = {F.CPPTYPE_INT32: (-2**31, 2**31 - 1), F.CPPTYPE_INT64: (-2**63, 2**63 - 1),
        F.CPPTYPE_UINT32: (0, 2**32 - 1), F.CPPTYPE_UINT64: (0, 2**64 - 1)}
FLOATS = (0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 3.4e38)
STRINGS = ("", "a", "x" * 65_536, "../../../../etc/passwd", "/", "w-a", "short", "tp1", "1", "-1",
           "\u202eevil\u0000", "😀" * 100, "http://127.0.0.1:1", "http://[::1]:99999", " spaced id ", "%s%n{}")


class Generator:
    def __init__(self, seed: int, run_id: str):
        self.random = random.Random(seed)
        self.run_id = run_id

    # -- values ----------------------------------------------------------------------------------
    def _int(self, cpp_type: int) -> int:
        low, high = INTS[cpp_type]
        return self.random.choice((0, 1, 2, low, high, high // 2 + 1, max(low, -1), self.random.randint(low, high)))

    def _string(self) -> str:
        if self.random.random() < 0.3:
            alphabet = "abcdefghijklmnopqrstuvwxyz0123456789-_./: \t\n\u00e9\u4e2d"
            return "".join(self.random.choice(alphabet) for _ in range(self.random.randint(1, 40)))
        return self.random.choice(STRINGS)

    def _scalar(self, field: FieldDescriptor) -> Any:
        cpp = field.cpp_type
        if cpp in INTS:
            return self._int(cpp)
        if cpp in (F.CPPTYPE_DOUBLE, F.CPPTYPE_FLOAT):
            value = self.random.choice(FLOATS + (self.random.uniform(-1e6, 1e6),))
            return value if cpp == F.CPPTYPE_DOUBLE or not math.isfinite(value) or abs(value) < 3.4e38 else math.inf
        if cpp == F.CPPTYPE_BOOL:
            return self.random.random() < 0.5
        if cpp == F.CPPTYPE_ENUM:
            known = [v.number for v in field.enum_type.values]
            return self.random.choice(known + [max(known) + 1, 99, -1, 2**31 - 1])
        if field.type == F.TYPE_BYTES:
            return self.random.randbytes(self.random.choice((0, 1, 16, 4096)))
        return self._string()

    def _count(self) -> int:
        return self.random.choices((0, 1, 2, 5, 200, 5000), weights=(30, 30, 15, 15, 7, 3))[0]

    # -- messages --------------------------------------------------------------------------------
    def message(self, descriptor: Descriptor, cls: type, depth: int = 0) -> Message:
        message = cls()
        self.fill(message, depth)
        return message

    def fill(self, message: Message, depth: int = 0) -> None:
        for field in message.DESCRIPTOR.fields:
            if field.message_type is not None and field.message_type.name == "RequestMeta":
                self.meta(getattr(message, field.name))
                continue
            if self.random.random() < 0.5:
                continue
            try:
                self._set(message, field, depth)
            except (ValueError, TypeError, OverflowError):
                pass  # a value the type cannot hold: leave the field unset

    def _set(self, message: Message, field: FieldDescriptor, depth: int) -> None:
        container = getattr(message, field.name)
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
            for _ in range(min(self._count(), 50)):
                key = self._scalar(key_field)
                if value_field.message_type is not None:
                    if depth < 3:
                        self.fill(container[key], depth + 1)
                else:
                    container[key] = self._scalar(value_field)
            return
        if field.is_repeated:
            count = self._count()
            if entry is not None:
                for _ in range(min(count, 50) if depth < 2 else 0):
                    self.fill(container.add(), depth + 1)
            else:
                value = self._scalar(field)
                container.extend(value if self.random.random() < 0.5 else self._scalar(field) for _ in range(count))
            return
        if entry is not None:
            if depth < 3:
                self.fill(container, depth + 1)
                if not container.ListFields():
                    container.SetInParent()
            return
        setattr(message, field.name, self._scalar(field))

    def meta(self, meta: Message) -> None:
        meta.request_id = "" if self.random.random() < 0.05 else f"fuzz-{self.random.getrandbits(64):016x}"
        meta.run_id = self.random.choices(("", self.run_id, "another-run", "x" * 1000), weights=(70, 15, 10, 5))[0]

    def tweak(self, cls: type, data: bytes) -> Message:
        """A valid request with one or two fields (at any depth) set to edge values, and a new meta."""
        message = cls.FromString(data)
        for _ in range(self.random.randint(1, 2)):
            target = message
            while True:
                field = self.random.choice(target.DESCRIPTOR.fields)
                nested = field.message_type is not None and not field.is_repeated
                if nested and field.message_type.name != "RequestMeta" and self.random.random() < 0.6:
                    target = getattr(target, field.name)
                    continue
                break
            try:
                target.ClearField(field.name)
                self._set(target, field, 1)
            except (ValueError, TypeError, OverflowError):
                pass
        for field in message.DESCRIPTOR.fields:
            if field.message_type is not None and field.message_type.name == "RequestMeta":
                self.meta(getattr(message, field.name))
        return message

    # -- bytes -----------------------------------------------------------------------------------
    def noise(self) -> bytes:
        return self.random.randbytes(self.random.choice((1, 3, 17, 200, 4096)))

    def mutate(self, data: bytes) -> bytes:
        data = bytearray(data or b"\x00")
        for _ in range(self.random.randint(1, 4)):
            where = self.random.randrange(len(data))
            kind = self.random.randrange(5)
            if kind == 0:
                data[where] ^= 1 << self.random.randrange(8)
            elif kind == 1:
                data[where] = self.random.choice((0x00, 0x7F, 0x80, 0xFF))
            elif kind == 2:
                del data[where:]
            elif kind == 3:
                span = data[where:where + self.random.randint(1, 16)]
                data[where:where] = span * self.random.randint(1, 8)
            else:
                data += self.noise()[:16]
            if not data:
                data = bytearray(b"\x08")
        return bytes(data)
