"""The CEL parser SG009's proofs rest on (policies/cel.py): the structure it reads must be cel-go's, for every
form valid CEL can take (github.com/google/cel-spec doc/langdef.md), and anything it does not read is refused."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scrubgate.policies.cel import (
    MAX_DEPTH,
    Binary,
    Call,
    CelError,
    Cond,
    Ident,
    Index,
    ListLit,
    Lit,
    MapLit,
    Select,
    Struct,
    Unary,
    conjuncts,
    parse,
)

DRIVER = Select(Ident("device"), "driver")


def lit(value):
    return Lit(value, "string")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("'a'", "a"),
        ('"a"', "a"),
        ("'''a'b'''", "a'b"),
        ('"""a\nb"""', "a\nb"),
        (r"'\x67pu'", "gpu"),
        (r"'\u0067pu'", "gpu"),
        (r"'\U00000067pu'", "gpu"),
        (r"'\147pu'", "gpu"),
        (r"'a\'b'", "a'b"),
        (r"'\\'", "\\"),
        (r"'\`\?'", "`?"),
        (r"r'\x67'", r"\x67"),
        (r"R'\n'", r"\n"),
        ("'é'", "é"),
    ],
)
def test_string_literals_decode_as_cel_does(text, value):
    assert parse(text) == lit(value)


def test_bytes_literals_are_not_strings():
    assert parse(r"b'\xff'") == Lit(b"\xff", "bytes")
    assert parse(r"rb'\x'") == Lit(b"\\x", "bytes")


@pytest.mark.parametrize(
    ("text", "value"),
    [("1", Lit(1, "int")), ("0x1F", Lit(31, "int")), ("1u", Lit(1, "uint")), ("1.5", Lit(1.5, "double"))],
)
def test_numbers(text, value):
    assert parse(text) == value
    assert parse("-" + text if value.kind != "uint" else text) == (
        Lit(-value.value, value.kind) if value.kind != "uint" else value
    )


def test_and_binds_tighter_than_or_and_ternary_is_loosest():
    tree = parse("a || b && c ? d : e")
    assert isinstance(tree, Cond)
    assert tree.test == Binary("||", Ident("a"), Binary("&&", Ident("b"), Ident("c")))


def test_relations_are_left_associative_and_below_arithmetic():
    assert parse("a == b == c") == Binary("==", Binary("==", Ident("a"), Ident("b")), Ident("c"))
    assert parse("a + 1 == b") == Binary("==", Binary("+", Ident("a"), Lit(1, "int")), Ident("b"))
    assert parse("a in b") == Binary("in", Ident("a"), Ident("b"))


def test_conjuncts_flatten_the_top_level_and_chain_through_parentheses():
    tree = parse("(device.driver == 'x') && (a && (b || c)) && !d")
    assert conjuncts(tree) == [
        Binary("==", DRIVER, lit("x")),
        Ident("a"),
        Binary("||", Ident("b"), Ident("c")),
        Unary("!", Ident("d")),
    ]
    assert conjuncts(parse("a || b && c")) == [parse("a || b && c")]


def test_member_forms():
    assert parse("device.attributes['d'].type") == Select(
        Index(Select(Ident("device"), "attributes"), lit("d")), "type"
    )
    assert parse("a.?b") == Select(Ident("a"), "b", optional=True)
    assert parse("a[?'b']") == Index(Ident("a"), lit("b"), optional=True)
    assert parse("a.f(1, b)") == Call(Ident("a"), "f", (Lit(1, "int"), Ident("b")))
    assert parse("has(a.b)") == Call(None, "has", (Select(Ident("a"), "b"),))
    assert parse(".device.driver") == Select(Ident("device", root=True), "driver")
    assert parse("a.`b-c`") == Select(Ident("a"), "b-c")


def test_aggregate_literals():
    assert parse("[1, ?a,]") == ListLit((Lit(1, "int"), Ident("a")), (False, True))
    assert parse("{'k': 1, ?'o': a}") == MapLit(((lit("k"), Lit(1, "int"), False), (lit("o"), Ident("a"), True)))
    assert parse("google.protobuf.Int64Value{value: 1}") == Struct(
        "google.protobuf.Int64Value", (("value", Lit(1, "int"), False),)
    )


def test_comments_and_whitespace():
    assert parse("a // && b\n && c") == Binary("&&", Ident("a"), Ident("c"))
    assert parse("a\t&&\r\n\fb") == Binary("&&", Ident("a"), Ident("b"))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "a &&",
        "'unterminated",
        "'new\nline'",
        r"'\q'",
        r"'\x6'",
        r"'\uD800'",
        r"b'\u0041'",
        "rr'a'",
        "a ? b",
        "(a",
        "a.",
        "if",
        "a\u00a0&& b",  # a no-break space: not CEL whitespace
        "1abc",
        "`a`",
        "9223372036854775809",
    ],
)
def test_what_it_does_not_read_is_refused(text):
    with pytest.raises(CelError):
        parse(text)


def test_depth_is_bounded():
    with pytest.raises(CelError):
        parse("(" * (MAX_DEPTH + 1) + "a" + ")" * (MAX_DEPTH + 1))
    with pytest.raises(CelError):
        parse("!" * (MAX_DEPTH + 1) + "a")


@given(st.text(max_size=60))
def test_any_text_parses_or_is_refused_with_celerror(text):
    with contextlib.suppress(CelError):
        parse(text)
