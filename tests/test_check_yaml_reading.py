"""Reading YAML for `scrubgate check` gives exactly what PyYAML's safe loader gives (the reader takes a faster
path for plain documents), and a value that cannot be read is an input error on its line, not a crash."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from scrubgate.sources import read_documents

REPO = Path(__file__).resolve().parents[1]


def objects_as_pyyaml_reads_them(text: str) -> list:
    """Documents that are objects, with `kind: List` items spread, as read_documents hands them out."""
    out = []
    for doc in yaml.load_all(text, Loader=yaml.CSafeLoader):
        if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            out += [item for item in doc["items"] if isinstance(item, dict)]
        elif isinstance(doc, dict):
            out.append(doc)
    return out


def read(text: str) -> list:
    documents, errors = read_documents("t.yaml", text)
    assert errors == []
    return [d.obj for d in documents]


def corpus_files() -> list[Path]:
    roots = [REPO / "manifests", REPO / "tests" / "data", REPO / "tests" / "realworld"]
    return sorted(p for root in roots if root.is_dir() for p in root.rglob("*") if p.suffix in (".yaml", ".yml"))


def test_every_manifest_we_have_reads_as_pyyaml_reads_it():
    files = [p for p in corpus_files() if p.name != "broken.yaml"]
    assert len(files) > 10
    for path in files:
        text = path.read_text()
        assert read(text) == objects_as_pyyaml_reads_them(text), path


@pytest.mark.parametrize(
    "text",
    [
        "base: &b {a: 1, b: [x]}\nmerged:\n  <<: *b\n  c: 2\n",  # merge key
        "a: &x [1, 2]\nb: *x\nc: *x\n",  # aliases share the object
        "1: int key\nnull: null key\ntrue: bool key\n3.5: float key\n",
        "? [a, b]\n: unhashable\n",
        "s: !!set {a, b}\no: !!omap [{a: 1}, {b: 2}]\np: !!pairs [{a: 1}]\n",
        "t: 2025-01-02\nts: 2025-01-02T03:04:05Z\nb: !!binary aGVsbG8=\n",
        "y: yes\nn: off\no: 0o17\nx: 0x1F\ns: 190:20:30\nu: 1_000\nf: .inf\nnan: .nan\ne: 1e3\nd: 1.5e3\n",
        "q: '2025-01-02'\nr: \"0x1F\"\nm: |\n  multi\n  line\n",
        "= : value key\n",
        "!!map {a: !!str 1, b: !!int '2', c: !!float '3'}\n",
    ],
)
def test_unusual_yaml_reads_as_pyyaml_reads_it(text):
    documents, errors = read_documents("t.yaml", "apiVersion: v1\nkind: X\nmetadata: {name: n}\n---\n" + text)
    try:
        expected = list(yaml.load_all(text, Loader=yaml.CSafeLoader))
    except yaml.YAMLError:
        assert errors and errors[0].line == 5
        return
    assert errors == [] or not isinstance(expected[0], dict)
    if isinstance(expected[0], dict):
        assert [d.obj for d in documents][1:] == expected


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.sampled_from(
        ["yes", "No", "on", "0x1f", "0o17", "012", "1_000", "190:20:30", "2025-01-02", "1e3", "~", "- a", "#"]
    ),
    st.dates(),
    st.datetimes(timezones=st.just(datetime.UTC)),
)
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(
    docs=st.lists(st.dictionaries(st.text(max_size=8), documents, min_size=1, max_size=5), min_size=1, max_size=4),
    flow=st.sampled_from([False, True, None]),
)
def test_random_documents_read_as_pyyaml_reads_them(docs, flow):
    text = yaml.dump_all(
        docs, Dumper=yaml.CSafeDumper, default_flow_style=flow, explicit_start=True, allow_unicode=True
    )
    assert read(text) == objects_as_pyyaml_reads_them(text)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("2025-02-30", "cannot read '2025-02-30' as timestamp"),
        ("2025-13-01T00:00:00Z", "cannot read '2025-13-01T00:00:00Z' as timestamp"),
        ("!!int abc", "cannot read 'abc' as int"),
        ("!!float abc", "cannot read 'abc' as float"),
        ("!!timestamp abc", "cannot read 'abc' as timestamp"),
        ("!!binary abcde", "failed to decode base64"),
        ("!!python/object:os.system x", "could not determine a constructor"),
    ],
)
def test_a_value_that_cannot_be_read_is_an_error_on_its_line(run_cli, tmp_path, value, problem):
    path = tmp_path / "bad.yaml"
    pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  resourceClaims: [{name: g, resourceClaimName: c}]\n"
    path.write_text(
        pod + "---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\ndata:\n  expires: " + value + "\n"
    )
    code, out, err = run_cli("check", "--format", "json", str(path))
    assert code == 2 and err == ""
    report = json.loads(out)
    [error] = report["errors"]
    assert error["line"] == 12 and problem in error["message"]
    assert [f["object"]["name"] for f in report["findings"]] == ["p", "p"]


def test_alias_to_a_timestamp_that_cannot_be_read(tmp_path):
    # The shortcut leaves documents with aliases to PyYAML's constructor; its errors are input errors too.
    documents, errors = read_documents("t.yaml", "c: &m {x: 1}\nd: *m\na: 2025-02-30\n")
    assert documents == [] and len(errors) == 1 and errors[0].line == 1
    assert "cannot read a value: day is out of range for month" in errors[0].message
