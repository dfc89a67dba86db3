"""bench/apiserver_cpu.py's reading of kube-apiserver's CPU profile: pprof's profile.proto decoded without Go or a
protobuf package, each sample's CPU time split by what its stack was doing; and the profile of a real
kube-apiserver read the same way."""

from __future__ import annotations

import gzip
import threading
import urllib.request
from collections import Counter

import pytest
from k8s_support import api_server

from bench.apiserver_cpu import CATEGORIES, CLAIMS_CREATED, OTHER, WANTED, table
from bench.pprof import ProfileError, read
from devcluster.load import counters


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _packed(number: int, values: list[int]) -> bytes:
    return _field(number, b"".join(_varint(v) for v in values))


def profile_bytes(*, cpu_type: str = "cpu") -> bytes:
    """A CPU profile as Go writes one: two sample values (count, cpu nanoseconds), three functions, a location
    holding two of them (one inlined into the other), two samples."""
    strings = ["", "samples", "count", cpu_type, "nanoseconds", "main.handler", "main.inlined", "main.gc"]
    out = b"".join(_field(6, s.encode()) for s in strings)
    out += _field(1, _field(1, 1) + _field(2, 2)) + _field(1, _field(1, 3) + _field(2, 4))
    for fid, name in ((1, 5), (2, 6), (3, 7)):
        out += _field(5, _field(1, fid) + _field(2, name))
    # location 10: main.inlined, inlined into main.handler (innermost first); location 11: main.gc
    out += _field(4, _field(1, 10) + _field(4, _field(1, 2)) + _field(4, _field(1, 1)))
    out += _field(4, _field(1, 11) + _field(4, _field(1, 3)))
    out += _field(2, _packed(1, [10]) + _packed(2, [3, 30_000_000]))
    out += _field(2, _packed(1, [11]) + _packed(2, [1, 10_000_000]))
    out += _field(10, 15_000_000_000)
    return out


def test_a_profile_is_read_into_stacks_of_function_names_with_their_cpu_time() -> None:
    for data in (profile_bytes(), gzip.compress(profile_bytes())):
        profile = read(data)
        assert profile.stacks == {("main.inlined", "main.handler"): 0.03, ("main.gc",): 0.01}
        assert profile.duration_s == 15.0
        assert profile.cpu_s == pytest.approx(0.04)


def test_each_sample_counts_once_in_the_first_category_that_matches() -> None:
    profile = read(profile_bytes())
    split = profile.split([("inlined work", ("inlined",)), ("handlers", ("handler",))], "rest")
    assert split == Counter({"inlined work": 0.03, "rest": 0.01})


def test_what_is_not_a_cpu_profile_is_refused_with_what_it_is() -> None:
    with pytest.raises(ProfileError, match="samples/count, heap/nanoseconds"):
        read(profile_bytes(cpu_type="heap"))
    with pytest.raises(ProfileError, match=r"past the end|truncated"):
        read(profile_bytes()[:-3])


def test_the_table_gives_each_categorys_share_of_the_difference() -> None:
    mine = Counter({CATEGORIES[0][0]: 3.0, OTHER: 10.0})
    bare = Counter({OTHER: 9.0})
    lines = table(mine, bare).splitlines()
    assert f"| {CATEGORIES[0][0]} | 3.0 ms | 0.0 ms | +3.0 ms | 75% |" in lines
    assert "| other | 10.0 ms | 9.0 ms | +1.0 ms | 25% |" in lines
    assert lines[-1] == "| in all | 13.0 ms | 9.0 ms | +4.0 ms (1.44x) | 100% |"


def test_a_real_kube_apiservers_profile_is_read(tmp_path) -> None:
    """kube-apiserver started with profiling serves /debug/pprof/profile; requests made meanwhile show in it as
    kube-apiserver's own functions, and its metrics count the claims created in the window."""
    with api_server(tmp_path, profiling=True) as plane:
        stop = threading.Event()

        def busy() -> None:
            while not stop.is_set():
                with urllib.request.urlopen(f"{plane.url}/api/v1/namespaces", context=plane.ssl_context()) as resp:
                    resp.read()

        worker = threading.Thread(target=busy)
        worker.start()
        try:
            profile = read(plane.cpu_profile(2))
        finally:
            stop.set()
            worker.join()
        assert profile.duration_s == pytest.approx(2.0, abs=0.5)
        assert any(name.startswith("k8s.io/apiserver/") for stack in profile.stacks for name in stack)
        assert sum(profile.split(CATEGORIES, OTHER).values()) == pytest.approx(profile.cpu_s)
        assert counters(plane.apiserver_metrics(), WANTED)[CLAIMS_CREATED] == 0
