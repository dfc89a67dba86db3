"""A Go CPU profile (pprof's profile.proto, gzipped, as `/debug/pprof/profile` serves it) read into stacks of
function names with their CPU time, and CPU time split by where it was spent.

Only the fields a CPU profile needs are read (samples, locations, functions, the string table, the period), with a
protobuf wire-format reader of its own: no Go toolchain and no protobuf package at run time. Field numbers are
those of github.com/google/pprof/proto/profile.proto."""

from __future__ import annotations

import gzip
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# profile.proto field numbers
_PROFILE_SAMPLE_TYPE, _PROFILE_SAMPLE, _PROFILE_LOCATION, _PROFILE_FUNCTION, _PROFILE_STRINGS = 1, 2, 4, 5, 6
_PROFILE_DURATION = 10
_VALUE_TYPE_TYPE, _VALUE_TYPE_UNIT = 1, 2
_SAMPLE_LOCATIONS, _SAMPLE_VALUES = 1, 2
_LOCATION_ID, _LOCATION_LINE = 1, 4
_LINE_FUNCTION = 1
_FUNCTION_ID, _FUNCTION_NAME = 1, 2


class ProfileError(ValueError):
    """Not a CPU profile this reader understands (truncated, not protobuf, no cpu/nanoseconds sample value)."""


@dataclass(frozen=True)
class Profile:
    """Each sampled stack (function names, leaf first) with its CPU seconds; and the profile's duration."""

    stacks: dict[tuple[str, ...], float]
    duration_s: float

    @property
    def cpu_s(self) -> float:
        return sum(self.stacks.values())

    def split(self, categories: Sequence[tuple[str, Sequence[str]]], other: str = "other") -> Counter[str]:
        """CPU seconds per category: a stack goes to the first category (in order) one of whose substrings is in
        one of its function names, so that every sample counts once; the rest to `other`."""
        out: Counter[str] = Counter()
        for stack, cpu in self.stacks.items():
            frames = "\n".join(stack)
            name = next((label for label, parts in categories if any(p in frames for p in parts)), other)
            out[name] += cpu
        return out


def read(data: bytes) -> Profile:
    """A CPU profile from the bytes `/debug/pprof/profile` returned (gzipped or not)."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    strings: list[str] = []
    sample_types: list[tuple[int, int]] = []
    samples: list[tuple[list[int], list[int]]] = []
    locations: dict[int, list[int]] = {}
    functions: dict[int, int] = {}
    duration_ns = 0
    for field, value in _fields(data):
        if field == _PROFILE_STRINGS:
            strings.append(bytes(value).decode("utf-8", "replace"))
        elif field == _PROFILE_SAMPLE_TYPE:
            kv = dict(_fields(value))
            sample_types.append((int(kv.get(_VALUE_TYPE_TYPE, 0)), int(kv.get(_VALUE_TYPE_UNIT, 0))))
        elif field == _PROFILE_SAMPLE:
            ids: list[int] = []
            values: list[int] = []
            for f, v in _fields(value):
                target = ids if f == _SAMPLE_LOCATIONS else values if f == _SAMPLE_VALUES else None
                if target is not None:
                    target.extend(_packed(v) if isinstance(v, memoryview) else [v])
            samples.append((ids, values))
        elif field == _PROFILE_LOCATION:
            loc_id, funcs = 0, []
            for f, v in _fields(value):
                if f == _LOCATION_ID:
                    loc_id = int(v)
                elif f == _LOCATION_LINE:
                    funcs.append(int(dict(_fields(v)).get(_LINE_FUNCTION, 0)))
            # a location's lines are innermost first (inlined calls), as a stack is
            locations[loc_id] = funcs
        elif field == _PROFILE_FUNCTION:
            kv = dict(_fields(value))
            functions[int(kv.get(_FUNCTION_ID, 0))] = int(kv.get(_FUNCTION_NAME, 0))
        elif field == _PROFILE_DURATION:
            duration_ns = int(value)
    cpu_index = next(
        (i for i, (t, u) in enumerate(sample_types) if _at(strings, t) == "cpu" and _at(strings, u) == "nanoseconds"),
        None,
    )
    if cpu_index is None:
        raise ProfileError(f"no cpu/nanoseconds sample value (sample types: {_named(strings, sample_types)})")
    stacks: Counter[tuple[str, ...]] = Counter()
    for ids, values in samples:
        names = tuple(_at(strings, functions.get(fn, 0)) for loc in ids for fn in locations.get(loc, []))
        stacks[names] += values[cpu_index] / 1e9 if cpu_index < len(values) else 0.0
    return Profile(dict(stacks), duration_ns / 1e9)


def _fields(buf: bytes | memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) of each field of one message: an int for varint and fixed-width fields, the bytes of
    a length-delimited one."""
    view = memoryview(buf)
    i = 0
    while i < len(view):
        key, i = _varint(view, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(view, i)
            yield field, value
        elif wire == 2:
            size, i = _varint(view, i)
            if i + size > len(view):
                raise ProfileError(f"field {field}: {size} bytes past the end of the message")
            yield field, view[i : i + size]
            i += size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            yield field, int.from_bytes(view[i : i + width], "little")
            i += width
        else:
            raise ProfileError(f"field {field}: wire type {wire} is not one profile.proto uses")


def _packed(view: memoryview) -> list[int]:
    out, i = [], 0
    while i < len(view):
        value, i = _varint(view, i)
        out.append(value)
    return out


def _varint(view: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(view):
            raise ProfileError("truncated varint")
        byte = view[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _at(strings: list[str], index: int) -> str:
    return strings[index] if 0 <= index < len(strings) else ""


def _named(strings: list[str], types: list[tuple[int, int]]) -> str:
    return ", ".join(f"{_at(strings, t)}/{_at(strings, u)}" for t, u in types) or "none"
