"""The rapidyaml path of `scrubgate check` (scrubgate/fastyaml.py) gives what PyYAML's safe loader gives, data,
spans and the line of every path, and leaves to PyYAML every text where YAML 1.1 and rapidyaml could differ."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from scrubgate import fastyaml
from scrubgate.sources import Document, Span, _parse_chunk, read_documents

REPO = Path(__file__).resolve().parents[1]


def pointers(obj: object, prefix: str = ""):
    """Every path in `obj`, and one missing below each mapping (reported on the mapping's line)."""
    yield prefix
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from pointers(value, f"{prefix}/{str(key).replace('~', '~0').replace('/', '~1')}")
        yield prefix + "/absent"
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            yield from pointers(value, f"{prefix}/{index}")


def assert_read_as_pyyaml_reads(text: str) -> None:
    fast = fastyaml.parse(text)
    slow = list(_parse_chunk(text, 0, 0))
    assert len(fast) == len(slow)
    for index, ((data, span, located), (want, want_span, node)) in enumerate(zip(fast, slow, strict=True)):
        assert data == want and type(data) is type(want), index
        if want is None:
            continue
        start, end, line = span
        assert (start, line) == (want_span.start, want_span.line), index
        assert text[start:end].startswith(text[want_span.start : want_span.end].rstrip()), index
        ours = Document("t.yaml", index, data, Span(*span), (), text, located)
        theirs = Document("t.yaml", index, want, want_span, (), text, node)
        again = Document("t.yaml", index, want, Span(*span), (), text)  # a line asked for later parses again
        for pointer in pointers(want):
            expected = theirs.line_of(pointer)
            assert ours.line_of(pointer) == expected, (index, pointer)
            assert again.line_of(pointer) == expected, (index, pointer)


def manifests() -> list[Path]:
    roots = [REPO / "manifests", REPO / "tests" / "data", REPO / "tests" / "realworld"]
    return sorted(p for root in roots if root.is_dir() for p in root.rglob("*") if p.suffix in (".yaml", ".yml"))


def test_every_manifest_we_have_reads_and_places_as_pyyaml_does():
    taken = 0
    for path in manifests():
        text = path.read_text()
        try:
            assert_read_as_pyyaml_reads(text)
            taken += 1
        except fastyaml.Unsupported:
            pass
        except AssertionError as exc:
            raise AssertionError(f"{path}: {exc}") from exc
    assert taken >= 0.8 * len(manifests()), "most real manifests should take the fast path"


@pytest.mark.parametrize(
    "text",
    [
        "a: 1\r\nb:\r\n  c: [x, y]\r\n",  # CRLF
        "# header\n\n---\n# c\napiVersion: v1\nkind: ConfigMap\ndata: {k: v}\n---\n---\nkind: X\nx: y\n",
        "name: café\nlabels:\n  é: ü\n---\nnext: 文字\nlist:\n- 1\n- ü\n",  # non-ASCII: str offsets, not bytes
        '{\n  "apiVersion": "v1",\n  "kind": "Pod",\n  "spec": {"containers": [{"name": "c"}]}\n}\n',
        "--- {a: 1, b: [2, 3]}\n--- {c: {d: e}}\n",
        'env:\n- name: A\n  value: \'0\'\n- name: B\n  value: "true"\n- value: ""\n- value: null\n- value:\n',
        "seq:\n- |\n  literal\n- >-\n  folded\n-\n  after: a break\n- - nested\n  - seq\n- [flow, seq]\n- {flow: map}\n",
        "a: 'multi\n  line'\nb: \"dq\n\n  x\"\nc: plain\n  continued\nd: |+\n  kept\n\ne: x\n",
        "'quoted key': 1\n\"dq key\": 2\n  # a comment line with `code` & [brackets\nk: v # a comment\n",
        "a: 1\na: 2\nb: {x: 1, x: 2}\n",  # duplicate keys: the last value, the first key's line
        "big: 123456789012345678901234567890\nneg: -5\nzero: 0\nboolean: false\nnothing: ~x\n",
        "s: 'it''s'\nt: \"\\u00e9\\x41\\t\\\\\"\nu: C:\\path\nv: a\"b\n",
    ],
)
def test_text_the_fast_path_takes_reads_and_places_as_pyyaml_does(text):
    assert_read_as_pyyaml_reads(text)


@pytest.mark.parametrize(
    "text",
    [
        "a: !!str 1\n",  # a tag
        "a: b\tc\n",  # a tab
        "a: b\x85c\n",  # NEL: a line break for YAML 1.1
        "a: b\u2028c\n",
        "a: b\rc: d\n",  # a lone CR
        "a: \x07\n",  # not printable: PyYAML's error is reported
        "a: yes\n",
        "a: 012\n",
        "a: 1_000\n",
        "a: 0x1F\n",
        "a: 2025-01-02\n",
        "a: '2025-01-02'\n",  # quoted or not: the JSON cannot tell
        "a: ~\n",
        "a: 1.5\n",  # any float
        "a: 1e3\n",
        "a: +1\n",
        "1: int key\n",
        "'1': quoted int key\n",
        "true: bool key\n",
        "a: &x [1]\nb: *x\n",  # an alias
        "b: *x\n",  # an alias to no anchor: PyYAML's error
        "base: &b {a: 1}\nm:\n  <<: *b\n",  # a merge key
        "- a\n- b\n",  # a document that is a list
        "just a string\n",
        "{}\n",
        "a: [b\n",  # a syntax error
    ],
)
def test_text_where_yaml_1_1_may_differ_is_left_to_pyyaml(text):
    with pytest.raises(fastyaml.Unsupported):
        fastyaml.parse(text)


@pytest.mark.parametrize(
    "text",
    [
        "%YAML 2.0\n---\na: b\n",  # PyYAML refuses the version
        "a:\n- @x\n",  # reserved indicators
        "a: `x`\n",
        "kind: ]X\n",
        "a: :x\n",
        "spec:\n   & devices: 1\n",  # an anchor without a name
        "resources:\n  &claims:\n  - name: mig\n",  # libyaml: anchor `claims`, then an empty key
        "a: [?4, 5]\n",  # in flow, `?` is always a key indicator for YAML 1.1
        "a: [4, 7ices:]\n",
        "a: {name: :gpu}\n",
        "a: {name:? a}\n",
        "verbs: [create,% delete]\n",
        "metadata: {name\n  space: t}\n",  # a flow collection over lines
        'args:\n- "8"            - --report-bindings\n',
        "a" * 1025 + ": b\n",  # PyYAML refuses a key over 1,024 characters
        '{"' + "k" * 1100 + '": 1}\n',  # also in JSON
        '{"a"\n: 1}\n',
        '{\n  "a": 1.5\n}\n',  # a float in JSON too
        'a: "\\ud83d\\ude00"\n',  # an escaped surrogate (pair)
        "data:\n  run.sh: |\n    echo hi",  # a block scalar ending the text without a line break
        "k: |1\n  \nz: 1\n",  # an indentation indicator
        'a: "x\\\n\n  y"\n',  # an escaped line break
        "apiVersion: v1\nkind: A\n...\nkind: B\n",  # content after `...`
        "spec:\n  args:\n  - --foo  # a flag\n    image: nginx\n",  # over-indented after a comment
        "? &x k\n? *x\n",  # an explicit key
        'labels:\n  "app #": &n web\nselector:\n  "app #": *n\n',  # ` #` inside a quoted key
        'a: {"k":&x v, "j":*x}\n',
        "metadata: {namespa #ct, name: a}\n",  # a comment inside a flow collection
    ],
)
def test_text_rapidyaml_reads_more_leniently_than_yaml_is_left_to_pyyaml(text):
    # Found by fuzzing manifests and by review: rapidyaml reads on where PyYAML (libyaml) refuses or reads
    # otherwise.
    with pytest.raises(fastyaml.Unsupported):
        fastyaml.parse(text)


def test_mutated_manifests_are_read_as_pyyaml_reads_them_or_left_to_it():
    """Real manifests with characters inserted, removed and copied at random (seeded): where the fast path
    reads one, PyYAML reads the same documents, and never refuses it."""
    rng = random.Random(13)
    texts = [path.read_text() for path in manifests()]
    pieces = [*" :-[]{}'\"#|>\n,?&*%@`", "  ", "\n  ", ": ", "- ", "---\n", "..."]
    taken = 0
    for _ in range(1500):
        text = rng.choice(texts)
        for _ in range(rng.randint(1, 3)):
            at, roll = rng.randrange(len(text) + 1), rng.random()
            if roll < 0.5:
                text = text[:at] + rng.choice(pieces) + text[at:]
            elif roll < 0.8:
                text = text[:at] + text[at + rng.randint(1, 3) :]
            else:
                start = rng.randrange(len(text) + 1)
                text = text[:at] + text[start : start + 5] + text[at:]
        try:
            fast = [data for data, _, _ in fastyaml.parse(text)]
        except fastyaml.Unsupported:
            continue
        taken += 1
        try:
            slow = [data for data, _, _ in _parse_chunk(text, 0, 0)]
        except (yaml.YAMLError, RecursionError) as exc:
            raise AssertionError(f"PyYAML refuses what the fast path read: {exc}\n{text}") from None
        assert fast == slow, text
    assert taken > 300


def test_valid_json_takes_the_fast_path_though_its_lines_start_with_brackets():
    text = '{\n  "kind": "Pod",\n  "spec": {\n    "containers": [\n      {"name": "c"}\n    ]\n  }\n}\n'
    assert_read_as_pyyaml_reads(text)
    assert fastyaml.parse(text)[0][0]["spec"]["containers"] == [{"name": "c"}]


def test_an_empty_scalar_on_the_path_leaves_the_file_to_pyyaml():
    # Where rapidyaml gives no place for a node, the file is read again by PyYAML, also while it is settled.
    text = "apiVersion: v1\nkind: Pod\nspec:\n  items:\n  -\n  - x\n"
    located = []

    def settle(document: Document) -> None:
        located.append(type(document.node))
        document.locate(["/spec/items/0"])

    documents, errors = read_documents("t.yaml", text, settle)
    assert errors == [] and located == [fastyaml.Located, yaml.MappingNode]
    assert documents[0].lines == {"/spec/items/0": 5}


def test_a_file_rapidyaml_cannot_parse_prints_nothing_and_reports_pyyamls_error(capfd):
    documents, errors = read_documents("bad.yaml", "apiVersion: v1\nkind: A\n---\nkind: [unterminated\n")
    assert [d.obj["kind"] for d in documents] == ["A"]
    assert [(e.line, e.message.split(":")[0]) for e in errors] == [(5, "invalid YAML")]
    assert capfd.readouterr().err == ""


def test_a_plain_manifest_takes_the_fast_path():
    path = REPO / "manifests" / "examples" / "good" / "mig-deployment.yaml"
    seen = []
    read_documents(str(path), path.read_text(), lambda d: seen.append(type(d.node)))
    assert seen and set(seen) == {fastyaml.Located}


# Text as manifests hold it (no tags, tabs or control characters, which send the file to PyYAML whole), with
# the scalars where YAML 1.1 and rapidyaml part ways mixed in.
characters = st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="!\x85\u2028\u2029\ufeff")
keys = st.text(alphabet=characters, min_size=1, max_size=8)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.text(alphabet=characters, max_size=12),
    st.sampled_from(["0", "-3", "true", "null", "", "yes", "*x", "- a", "#", "a: b", "[x]", "{y}", "é", "a\nb", " x"]),
)
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(
    docs=st.lists(st.dictionaries(keys, documents, min_size=1, max_size=5), min_size=1, max_size=4),
    flow=st.sampled_from([False, True, None]),
    width=st.sampled_from([20, 80]),
)
def test_random_documents_read_and_place_as_pyyaml_does(docs, flow, width):
    text = yaml.dump_all(
        docs, Dumper=yaml.CSafeDumper, default_flow_style=flow, explicit_start=True, allow_unicode=True, width=width
    )
    with contextlib.suppress(fastyaml.Unsupported):  # the cases left to PyYAML are tested above
        assert_read_as_pyyaml_reads(text)
