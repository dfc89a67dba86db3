"""A small subset of CEL (the Common Expression Language) for ``matchConditions`` and DRA selectors.

Supported: literals (int, double, string, bool, null, lists, maps), variables, field selection
(``a.b``), indexing (``a["b"]``, ``a[0]``), ``!``, unary ``-``, ``&&``/``||`` (with CEL's
commutative error absorption: ``false && <error>`` is ``false``), ``== != < <= > >=``, ``in``,
``+ - * / %``, ``? :``, the ``has()`` macro, ``exists``/``all``/``exists_one``/``map``/``filter``
macros, ``size()``, ``startsWith``/``endsWith``/``contains``/``matches``/``lowerAscii``/
``upperAscii``, ``int()``/``string()``. Selecting a missing field is an error, as in CEL; what the
caller does with an error (``failurePolicy`` for webhooks, "no match" for device selectors) is its
business. Anything outside the subset fails to compile with ``CelError`` rather than guessing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache


class CelError(Exception):
    pass


@dataclass(frozen=True)
class _Tok:
    kind: str  # "num", "str", "ident", "op", "end"
    value: object
    pos: int


_TOKEN = re.compile(
    r"""
    (?P<ws>\s+|//[^\n]*)
  | (?P<num>0x[0-9a-fA-F]+u?|\d+\.\d*(?:[eE][+-]?\d+)?|\d+(?:[eE][+-]?\d+)|\d+u?)
  | (?P<str>[rR]?(?:"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'))
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>==|!=|<=|>=|&&|\|\||[<>!+\-*/%?:.,()\[\]{}])
    """,
    re.VERBOSE,
)

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "0": "\0"}


def _unquote(text: str) -> str:
    raw = text[0] in "rR"
    body = text[2:-1] if raw else text[1:-1]
    if raw:
        return body
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), body)


def _tokenize(source: str) -> list[_Tok]:
    tokens, pos = [], 0
    while pos < len(source):
        m = _TOKEN.match(source, pos)
        if not m:
            raise CelError(f"unexpected character {source[pos]!r} at {pos} in {source!r}")
        kind = m.lastgroup or ""
        text = m.group()
        if kind == "num":
            text = text.rstrip("u")
            value: object = (
                int(text, 16)
                if text.startswith("0x")
                else (float(text) if any(c in text for c in ".eE") else int(text))
            )
            tokens.append(_Tok("num", value, pos))
        elif kind == "str":
            tokens.append(_Tok("str", _unquote(text), pos))
        elif kind in ("ident", "op"):
            tokens.append(_Tok(kind, text, pos))
        pos = m.end()
    tokens.append(_Tok("end", None, pos))
    return tokens


_MACROS = {"exists", "all", "exists_one", "map", "filter"}
_RELATIONS = {"==", "!=", "<", "<=", ">", ">=", "in"}


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source
        self.tokens = _tokenize(source)
        self.i = 0

    def peek(self, value: str | None = None) -> bool:
        tok = self.tokens[self.i]
        return tok.kind in ("op", "ident") and tok.value == value if value else False

    def take(self) -> _Tok:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def expect(self, value: str) -> None:
        tok = self.take()
        if tok.value != value:
            raise CelError(f"expected {value!r} at {tok.pos} in {self.source!r}, found {tok.value!r}")

    def parse(self) -> tuple:
        node = self.expr()
        if self.tokens[self.i].kind != "end":
            raise CelError(f"unexpected {self.tokens[self.i].value!r} at {self.tokens[self.i].pos} in {self.source!r}")
        return node

    def expr(self) -> tuple:
        cond = self.binary_or()
        if self.peek("?"):
            self.take()
            then = self.binary_or()
            self.expect(":")
            return ("cond", cond, then, self.expr())
        return cond

    def binary_or(self) -> tuple:
        node = self.binary_and()
        while self.peek("||"):
            self.take()
            node = ("or", node, self.binary_and())
        return node

    def binary_and(self) -> tuple:
        node = self.relation()
        while self.peek("&&"):
            self.take()
            node = ("and", node, self.relation())
        return node

    def relation(self) -> tuple:
        node = self.addition()
        while self.tokens[self.i].value in _RELATIONS and self.tokens[self.i].kind in ("op", "ident"):
            op = str(self.take().value)
            node = ("binary", op, node, self.addition())
        return node

    def addition(self) -> tuple:
        node = self.multiplication()
        while self.peek("+") or self.peek("-"):
            op = str(self.take().value)
            node = ("binary", op, node, self.multiplication())
        return node

    def multiplication(self) -> tuple:
        node = self.unary()
        while self.peek("*") or self.peek("/") or self.peek("%"):
            op = str(self.take().value)
            node = ("binary", op, node, self.unary())
        return node

    def unary(self) -> tuple:
        if self.peek("!") or self.peek("-"):
            op = str(self.take().value)
            return ("unary", op, self.unary())
        return self.member()

    def member(self) -> tuple:
        node = self.primary()
        while True:
            if self.peek("."):
                self.take()
                tok = self.take()
                if tok.kind != "ident":
                    raise CelError(f"expected a field name at {tok.pos} in {self.source!r}")
                name = str(tok.value)
                node = self.call(name, node) if self.peek("(") else ("select", node, name)
            elif self.peek("["):
                self.take()
                index = self.expr()
                self.expect("]")
                node = ("index", node, index)
            else:
                return node

    def args(self) -> list[tuple]:
        self.expect("(")
        items: list[tuple] = []
        while not self.peek(")"):
            items.append(self.expr())
            if not self.peek(")"):
                self.expect(",")
        self.take()
        return items

    def call(self, name: str, target: tuple | None) -> tuple:
        args = self.args()
        if target is not None and name in _MACROS:
            if len(args) != 2 or args[0][0] != "ident":
                raise CelError(f"{name}() takes a variable name and an expression in {self.source!r}")
            return ("macro", name, target, args[0][1], args[1])
        if target is None and name == "has":
            if len(args) != 1 or args[0][0] != "select":
                raise CelError(f"has() takes a field selection like has(a.b) in {self.source!r}")
            return ("has", args[0][1], args[0][2])
        return ("call", name, target, args)

    def primary(self) -> tuple:
        tok = self.take()
        if tok.kind in ("num", "str"):
            return ("lit", tok.value)
        if tok.kind == "ident":
            name = str(tok.value)
            if name in ("true", "false"):
                return ("lit", name == "true")
            if name == "null":
                return ("lit", None)
            if self.peek("("):
                return self.call(name, None)
            return ("ident", name)
        if tok.value == "(":
            node = self.expr()
            self.expect(")")
            return node
        if tok.value == "[":
            items: list[tuple] = []
            while not self.peek("]"):
                items.append(self.expr())
                if not self.peek("]"):
                    self.expect(",")
            self.take()
            return ("list", items)
        if tok.value == "{":
            pairs: list[tuple[tuple, tuple]] = []
            while not self.peek("}"):
                key = self.expr()
                self.expect(":")
                pairs.append((key, self.expr()))
                if not self.peek("}"):
                    self.expect(",")
            self.take()
            return ("map", pairs)
        raise CelError(f"unexpected {tok.value!r} at {tok.pos} in {self.source!r}")


@lru_cache(maxsize=512)
def compile_expression(source: str) -> tuple:
    """Parse once; raises CelError for syntax outside the subset."""
    return _Parser(source).parse()


def evaluate(source: str, variables: Mapping[str, object]) -> object:
    return _eval(compile_expression(source), variables)


def _category(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "list"
    if isinstance(value, Mapping):
        return "map"
    return type(value).__name__


def _equal(a: object, b: object) -> bool:
    if _category(a) != _category(b):
        return False
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise CelError(f"{what} needs a bool, got {_category(value)}")
    return value


def _select(value: object, field: str) -> object:
    if not isinstance(value, Mapping):
        raise CelError(f"cannot select field {field!r} from {_category(value)}")
    if field not in value:
        raise CelError(f"no such key: {field}")
    return value[field]


def _eval(node: tuple, env: Mapping[str, object]) -> object:
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "ident":
        if node[1] not in env:
            raise CelError(f"undeclared reference to {node[1]!r}")
        return env[node[1]]
    if kind == "select":
        return _select(_eval(node[1], env), node[2])
    if kind == "has":
        target = _eval(node[1], env)
        if not isinstance(target, Mapping):
            raise CelError(f"has() on {_category(target)}")
        return node[2] in target
    if kind == "index":
        target, index = _eval(node[1], env), _eval(node[2], env)
        if isinstance(target, Mapping):
            if index not in target:
                raise CelError(f"no such key: {index}")
            return target[index]
        if isinstance(target, list | tuple) and isinstance(index, int) and not isinstance(index, bool):
            if not 0 <= index < len(target):
                raise CelError(f"index out of range: {index}")
            return target[index]
        raise CelError(f"cannot index {_category(target)} with {_category(index)}")
    if kind == "list":
        return [_eval(item, env) for item in node[1]]
    if kind == "map":
        return {_eval(k, env): _eval(v, env) for k, v in node[1]}
    if kind == "unary":
        value = _eval(node[2], env)
        if node[1] == "!":
            return not _bool(value, "!")
        if _category(value) != "number":
            raise CelError(f"unary - on {_category(value)}")
        return -value  # type: ignore[operator]
    if kind in ("and", "or"):
        return _logical(kind, node[1], node[2], env)
    if kind == "cond":
        return _eval(node[2] if _bool(_eval(node[1], env), "?:") else node[3], env)
    if kind == "binary":
        return _binary(node[1], _eval(node[2], env), _eval(node[3], env))
    if kind == "macro":
        return _macro(node, env)
    if kind == "call":
        target = _eval(node[2], env) if node[2] is not None else None
        return _call(node[1], node[2] is not None, target, [_eval(a, env) for a in node[3]])
    raise CelError(f"unknown node {kind}")


def _logical(kind: str, left: tuple, right: tuple, env: Mapping[str, object]) -> bool:
    # CEL evaluates both sides; a decisive value on either side wins over an error on the other.
    decisive = kind == "or"
    results: list[bool | CelError] = []
    for side in (left, right):
        try:
            value = _bool(_eval(side, env), "&&" if kind == "and" else "||")
        except CelError as e:
            results.append(e)
            continue
        if value == decisive:
            return decisive
        results.append(value)
    for r in results:
        if isinstance(r, CelError):
            raise r
    return not decisive


def _binary(op: str, a: object, b: object) -> object:
    if op == "==":
        return _equal(a, b)
    if op == "!=":
        return not _equal(a, b)
    if op == "in":
        if isinstance(b, Mapping):
            return a in b
        if isinstance(b, list | tuple):
            return any(_equal(a, x) for x in b)
        raise CelError(f"'in' needs a list or map, got {_category(b)}")
    ca, cb = _category(a), _category(b)
    if ca != cb:
        raise CelError(f"no such overload: {ca} {op} {cb}")
    if op in ("<", "<=", ">", ">="):
        if ca not in ("number", "string"):
            raise CelError(f"no such overload: {ca} {op} {cb}")
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]  # type: ignore[operator]
    if op == "+" and ca in ("number", "string", "list"):
        return list(a) + list(b) if ca == "list" else a + b  # type: ignore[operator,arg-type]
    if ca == "number" and op in ("-", "*", "/", "%"):
        if op in ("/", "%") and b == 0:
            raise CelError("division by zero")
        if op == "/" and isinstance(a, int) and isinstance(b, int):
            return int(a / b)
        return {"-": a - b, "*": a * b, "/": a / b, "%": a % b}[op]  # type: ignore[operator]
    raise CelError(f"no such overload: {ca} {op} {cb}")


def _macro(node: tuple, env: Mapping[str, object]) -> object:
    _, name, target_node, var, body = node
    target = _eval(target_node, env)
    if isinstance(target, Mapping):
        items = list(target.keys())
    elif isinstance(target, list | tuple):
        items = list(target)
    else:
        raise CelError(f"{name}() on {_category(target)}")

    def run(item: object) -> object:
        return _eval(body, {**env, var: item})

    if name == "map":
        return [run(x) for x in items]
    if name == "filter":
        return [x for x in items if _bool(run(x), "filter()")]
    hits = [_bool(run(x), f"{name}()") for x in items]
    if name == "exists":
        return any(hits)
    if name == "all":
        return all(hits)
    return hits.count(True) == 1


def _call(name: str, is_method: bool, target: object, args: list[object]) -> object:
    if not is_method:
        if len(args) != 1:
            raise CelError(f"{name}() takes one argument")
        target, args = args[0], []
    if name == "size":
        if isinstance(target, str | list | tuple | Mapping):
            return len(target)
        raise CelError(f"size() on {_category(target)}")
    if name == "string":
        return target if isinstance(target, str) else str(target).lower() if isinstance(target, bool) else str(target)
    if name == "int":
        try:
            return int(target)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise CelError(f"int() of {target!r}") from e
    if isinstance(target, str):
        if name in ("lowerAscii", "upperAscii") and not args:
            return target.lower() if name == "lowerAscii" else target.upper()
        if len(args) == 1 and isinstance(args[0], str):
            arg = args[0]
            if name == "startsWith":
                return target.startswith(arg)
            if name == "endsWith":
                return target.endswith(arg)
            if name == "contains":
                return arg in target
            if name == "matches":
                return re.search(arg, target) is not None
    raise CelError(f"unsupported function {name}() on {_category(target)}")
