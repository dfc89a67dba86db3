"""A parser for the Common Expression Language, enough to read a DeviceClass selector's structure exactly.

scrubgate never evaluates a selector: it reads the top-level conjuncts of the parsed expression to prove what a
class cannot select (policies/selectors.py). A proof is only as sound as the parse, so this follows the CEL
grammar (github.com/google/cel-spec, doc/langdef.md, "Syntax" and "Lexical Structure") in full: operator
precedence and associativity, every literal form with its escapes, comments, optional syntax (`.?f`, `[?i]`,
`[?x]`, `{?k: v}`), message construction, escaped field names. Anything it does not recognise raises CelError,
and the caller then proves nothing (fail closed). The API server has already compiled the expression (a
DeviceClass with a selector that does not compile is refused before any webhook runs), so a lenient reading of
what cel-go would reject cannot let anything in; only a different reading of valid CEL could, and that is what
the grammar here must match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Nesting beyond this is refused (fail closed): no real selector comes near it, and each level takes a few Python
# frames, which must stay well within the interpreter's recursion limit.
MAX_DEPTH = 80
MAX_LENGTH = 100_000


class CelError(ValueError):
    """An expression this parser does not read; the message says where."""


# ---------------------------------------------------------------- syntax tree


@dataclass(frozen=True, slots=True)
class Lit:
    value: Any  # str, bytes, int, float, bool or None
    kind: str  # "string", "bytes", "int", "uint", "double", "bool", "null"


@dataclass(frozen=True, slots=True)
class Ident:
    name: str
    root: bool = False  # a leading dot: `.device`, the root scope


@dataclass(frozen=True, slots=True)
class Select:
    operand: Node
    field: str
    optional: bool = False  # `a.?b`


@dataclass(frozen=True, slots=True)
class Index:
    operand: Node
    index: Node
    optional: bool = False  # `a[?b]`


@dataclass(frozen=True, slots=True)
class Call:
    target: Node | None  # the receiver of a method call (`a.f(x)`), None for a global function
    function: str
    args: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class ListLit:
    items: tuple[Node, ...]
    optional: tuple[bool, ...]  # per item: `[?x]`


@dataclass(frozen=True, slots=True)
class MapLit:
    entries: tuple[tuple[Node, Node, bool], ...]  # key, value, optional (`{?k: v}`)


@dataclass(frozen=True, slots=True)
class Struct:
    type_name: str
    fields: tuple[tuple[str, Node, bool], ...]


@dataclass(frozen=True, slots=True)
class Unary:
    op: str  # "!" or "-"
    operand: Node


@dataclass(frozen=True, slots=True)
class Binary:
    op: str  # "||", "&&", "==", "!=", "<", "<=", ">", ">=", "in", "+", "-", "*", "/", "%"
    left: Node
    right: Node


@dataclass(frozen=True, slots=True)
class Cond:
    test: Node
    then: Node
    otherwise: Node


Node = Lit | Ident | Select | Index | Call | ListLit | MapLit | Struct | Unary | Binary | Cond


# ---------------------------------------------------------------- lexer


@dataclass(frozen=True, slots=True)
class Token:
    kind: str  # "op", "ident", "quoted" (a back-quoted field name), "lit", "end"
    text: str
    at: int
    value: Lit | None = None


_WHITESPACE = " \t\r\n\f"
_OPERATORS = ("==", "!=", "<=", ">=", "&&", "||", "<", ">", "!", "-", "+", "*", "/", "%", "?", ":", ".", ",")
_OPERATORS += ("(", ")", "[", "]", "{", "}")
_IDENT = re.compile(r"[_a-zA-Z][_a-zA-Z0-9]*")
# A float needs digits after its dot (`1.` is the int 1 and a dot) or an exponent.
_FLOAT = re.compile(r"(?:[0-9]*\.[0-9]+(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+)")
_HEX = re.compile(r"0[xX][0-9a-fA-F]+([uU]?)")
_DECIMAL = re.compile(r"[0-9]+([uU]?)")
_QUOTED_FIELD = re.compile(r"`([a-zA-Z0-9_.\-/ ]+)`")
_STRING_START = re.compile(r"([rRbB]{0,2})('''|\"\"\"|'|\")")
# Words CEL reserves: none may name a variable, a function or a field (langdef.md, "Lexical Structure").
_RESERVED = frozenset(
    {
        "as", "break", "const", "continue", "else", "for", "function", "if", "import", "let", "loop",
        "package", "namespace", "return", "var", "void", "while",
    }
)  # fmt: skip
_SIMPLE_ESCAPES = {
    "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
    "\\": "\\", "?": "?", '"': '"', "'": "'", "`": "`",
}  # fmt: skip
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _unescape(body: str, at: int, as_bytes: bool) -> str | bytes:
    """A quoted literal's text with its escapes decoded as CEL does (langdef.md, "String and Bytes Values")."""
    out: list[int] = []  # code points for strings, octets for bytes
    i = 0
    while i < len(body):
        char = body[i]
        if char != "\\":
            out.extend(char.encode() if as_bytes else [ord(char)])
            i += 1
            continue
        kind = body[i + 1 : i + 2]
        if kind in _SIMPLE_ESCAPES:
            out.append(ord(_SIMPLE_ESCAPES[kind]))
            i += 2
            continue
        width = {"x": 2, "X": 2, "u": 4, "U": 8}.get(kind)
        if width is not None:
            digits = body[i + 2 : i + 2 + width]
            if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise CelError(f"bad \\{kind} escape at offset {at + i}")
            if kind in "uU" and as_bytes:
                raise CelError(f"\\{kind} escape in a bytes literal at offset {at + i}")
            code = int(digits, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise CelError(f"escape of an invalid code point at offset {at + i}")
            out.append(code)
            i += 2 + width
            continue
        digits = body[i + 1 : i + 4]
        if len(digits) == 3 and all(c in "01234567" for c in digits) and digits[0] in "0123":
            out.append(int(digits, 8))
            i += 4
            continue
        raise CelError(f"unknown escape \\{kind} at offset {at + i}")
    if as_bytes:
        return bytes(out)
    return "".join(map(chr, out))


def _string(text: str, at: int) -> tuple[Lit, int]:
    match = _STRING_START.match(text, at)
    assert match is not None
    prefix, quote = match.group(1).lower(), match.group(2)
    if len(prefix) != len(set(prefix)):
        raise CelError(f"bad string prefix {match.group(1)!r} at offset {at}")
    start = match.end()
    i = start
    while True:
        if i >= len(text):
            raise CelError(f"unterminated string starting at offset {at}")
        if text.startswith(quote, i):
            break
        if len(quote) == 1 and text[i] in "\r\n":
            raise CelError(f"newline in a single-quoted string starting at offset {at}")
        i += 2 if text[i] == "\\" and "r" not in prefix else 1
    body = text[start:i]
    as_bytes = "b" in prefix
    if "r" in prefix:
        value: str | bytes = body.encode() if as_bytes else body
    else:
        value = _unescape(body, start, as_bytes)
    return Lit(value, "bytes" if as_bytes else "string"), i + len(quote)


def tokenize(text: str) -> list[Token]:
    if len(text) > MAX_LENGTH:
        raise CelError(f"expression longer than {MAX_LENGTH} characters")
    tokens: list[Token] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char in _WHITESPACE:
            i += 1
            continue
        if text.startswith("//", i):
            end = text.find("\n", i)
            i = len(text) if end < 0 else end + 1
            continue
        string = _STRING_START.match(text, i)
        if string is not None:
            lit, end = _string(text, i)
            tokens.append(Token("lit", text[i:end], i, lit))
            i = end
            continue
        if char.isdigit() or (char == "." and text[i + 1 : i + 2].isdigit()):
            i = _number(text, i, tokens)
            continue
        ident = _IDENT.match(text, i)
        if ident is not None:
            word = ident.group()
            if word in ("true", "false"):
                tokens.append(Token("lit", word, i, Lit(word == "true", "bool")))
            elif word == "null":
                tokens.append(Token("lit", word, i, Lit(None, "null")))
            elif word == "in":
                tokens.append(Token("op", word, i))
            elif word in _RESERVED:
                raise CelError(f"reserved word {word!r} at offset {i}")
            else:
                tokens.append(Token("ident", word, i))
            i = ident.end()
            continue
        quoted = _QUOTED_FIELD.match(text, i)
        if quoted is not None:
            tokens.append(Token("quoted", quoted.group(1), i))
            i = quoted.end()
            continue
        operator = next((op for op in _OPERATORS if text.startswith(op, i)), None)
        if operator is None:
            raise CelError(f"unexpected character {char!r} at offset {i}")
        tokens.append(Token("op", operator, i))
        i += len(operator)
    tokens.append(Token("end", "", len(text)))
    return tokens


def _number(text: str, i: int, tokens: list[Token]) -> int:
    for pattern in (_HEX, _FLOAT, _DECIMAL):
        match = pattern.match(text, i)
        if match is None:
            continue
        if pattern is _FLOAT:
            lit = Lit(float(match.group()), "double")
        else:
            unsigned = bool(match.group(1))
            digits = match.group()[: len(match.group()) - unsigned]
            value = int(digits, 16 if pattern is _HEX else 10)
            if value > (1 << 64) - 1 or (not unsigned and value > _INT64[1] + 1):
                raise CelError(f"integer literal out of range at offset {i}")
            lit = Lit(value, "uint" if unsigned else "int")
        end = match.end()
        if end < len(text) and (text[end].isalnum() or text[end] == "_"):
            raise CelError(f"malformed number at offset {i}")
        tokens.append(Token("lit", match.group(), i, lit))
        return end
    raise CelError(f"malformed number at offset {i}")


# ---------------------------------------------------------------- parser

_RELATIONS = frozenset({"==", "!=", "<", "<=", ">", ">=", "in"})


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = tokenize(text)
        self.i = 0
        self.depth = 0

    @property
    def peek(self) -> Token:
        return self.tokens[self.i]

    def _next(self) -> Token:
        token = self.tokens[self.i]
        self.i += 1
        return token

    def _is(self, text: str) -> bool:
        return self.peek.kind == "op" and self.peek.text == text

    def _take(self, text: str) -> bool:
        if self._is(text):
            self.i += 1
            return True
        return False

    def _expect(self, text: str) -> None:
        if not self._take(text):
            raise CelError(f"expected {text!r} at offset {self.peek.at}, found {self.peek.text or 'the end'!r}")

    def parse(self) -> Node:
        node = self.expr()
        if self.peek.kind != "end":
            raise CelError(f"unexpected {self.peek.text!r} at offset {self.peek.at}")
        return node

    def expr(self) -> Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CelError(f"expression nested deeper than {MAX_DEPTH}")
        try:
            test = self._or()
            if not self._take("?"):
                return test
            then = self._or()
            self._expect(":")
            return Cond(test, then, self.expr())
        finally:
            self.depth -= 1

    def _or(self) -> Node:
        node = self._and()
        while self._take("||"):
            node = Binary("||", node, self._and())
        return node

    def _and(self) -> Node:
        node = self._relation()
        while self._take("&&"):
            node = Binary("&&", node, self._relation())
        return node

    def _relation(self) -> Node:
        node = self._addition()
        while self.peek.kind == "op" and self.peek.text in _RELATIONS:
            op = self._next().text
            node = Binary(op, node, self._addition())
        return node

    def _addition(self) -> Node:
        node = self._multiplication()
        while self.peek.kind == "op" and self.peek.text in ("+", "-"):
            op = self._next().text
            node = Binary(op, node, self._multiplication())
        return node

    def _multiplication(self) -> Node:
        node = self._unary()
        while self.peek.kind == "op" and self.peek.text in ("*", "/", "%"):
            op = self._next().text
            node = Binary(op, node, self._unary())
        return node

    def _unary(self) -> Node:
        if self.peek.kind == "op" and self.peek.text in ("!", "-"):
            op = self._next().text
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise CelError(f"expression nested deeper than {MAX_DEPTH}")
            try:
                operand = self._unary()
            finally:
                self.depth -= 1
            # `-` directly before a number literal is part of it (langdef: a negative literal).
            if op == "-" and isinstance(operand, Lit) and operand.kind in ("int", "double"):
                return Lit(-operand.value, operand.kind)
            return Unary(op, operand)
        return self._member()

    def _member(self) -> Node:
        node = self._primary()
        while True:
            if self._take("."):
                optional = self._take("?")
                name = self._field_name()
                if not optional and self._take("("):
                    node = Call(node, name, self._arguments(")"))
                else:
                    node = Select(node, name, optional)
            elif self._take("["):
                optional = self._take("?")
                index = self.expr()
                self._expect("]")
                node = Index(node, index, optional)
            elif self._is("{") and _type_name(node) is not None:
                self.i += 1
                node = Struct(_type_name(node) or "", self._fields())
            else:
                return node

    def _field_name(self) -> str:
        token = self._next()
        if token.kind in ("ident", "quoted"):
            return token.text
        raise CelError(f"expected a field name at offset {token.at}")

    def _arguments(self, close: str) -> tuple[Node, ...]:
        args: list[Node] = []
        if self._take(close):
            return ()
        while True:
            args.append(self.expr())
            if self._take(close):
                return tuple(args)
            self._expect(",")

    def _fields(self) -> tuple[tuple[str, Node, bool], ...]:
        fields: list[tuple[str, Node, bool]] = []
        while not self._take("}"):
            optional = self._take("?")
            name = self._field_name()
            self._expect(":")
            fields.append((name, self.expr(), optional))
            if not self._take(","):
                self._expect("}")
                break
        return tuple(fields)

    def _primary(self) -> Node:
        token = self._next()
        if token.kind == "lit":
            assert token.value is not None
            return token.value
        if token.kind == "op" and token.text == "(":
            node = self.expr()
            self._expect(")")
            return node
        if token.kind == "op" and token.text == "[":
            items: list[Node] = []
            optional: list[bool] = []
            while not self._take("]"):
                optional.append(self._take("?"))
                items.append(self.expr())
                if not self._take(","):
                    self._expect("]")
                    break
            return ListLit(tuple(items), tuple(optional))
        if token.kind == "op" and token.text == "{":
            entries: list[tuple[Node, Node, bool]] = []
            while not self._take("}"):
                opt = self._take("?")
                key = self.expr()
                self._expect(":")
                entries.append((key, self.expr(), opt))
                if not self._take(","):
                    self._expect("}")
                    break
            return MapLit(tuple(entries))
        root = token.kind == "op" and token.text == "."
        if root:
            token = self._next()
        if token.kind == "ident":
            if self._take("("):
                return Call(None, ("." if root else "") + token.text, self._arguments(")"))
            return Ident(token.text, root)
        raise CelError(f"unexpected {token.text or 'end of expression'!r} at offset {token.at}")


def _type_name(node: Node) -> str | None:
    """The dotted name a message construction (`a.b.T{...}`) starts with, if `node` can be one."""
    if isinstance(node, Ident):
        return ("." if node.root else "") + node.name
    if isinstance(node, Select) and not node.optional:
        prefix = _type_name(node.operand)
        return None if prefix is None else f"{prefix}.{node.field}"
    return None


def parse(expression: str) -> Node:
    """The syntax tree of a CEL expression; CelError when it is not one this parser reads."""
    try:
        return _Parser(expression).parse()
    except RecursionError:
        raise CelError("expression nested too deeply") from None


def conjuncts(node: Node) -> list[Node]:
    """The operands of the top-level `&&` chain (one node when there is none): each must be true for the
    expression to be. CEL's `&&` is commutative as to errors (a false operand makes it false whatever the other
    gives), so a conjunct that is false for a device keeps the device out, whatever the rest does."""
    if isinstance(node, Binary) and node.op == "&&":
        return conjuncts(node.left) + conjuncts(node.right)
    return [node]
