"""No input crashes `scrubgate check`: binary junk, truncated YAML, a 50 MB file, deep nesting, wrong types in
every field, odd encodings. Unreadable input is exit 2 with file and line; the rest is still checked."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import yaml

from scrubgate.check import check_documents, run_check
from scrubgate.report import build_report, render_json, render_junit, render_sarif, render_text
from scrubgate.sources import read_documents

DATA = Path(__file__).parent / "data" / "check"
POD = (
    "apiVersion: v1\nkind: Pod\nmetadata:\n  namespace: team-a\n  name: {name}\nspec:\n"
    "  terminationGracePeriodSeconds: 30\n  resourceClaims:\n  - name: gpu\n    resourceClaimName: shared\n"
)  # SG002 on its last line (line 10 of the document)


def report_of(run_cli, *paths: str) -> tuple[int, dict, str]:
    code, out, err = run_cli("check", "--format", "json", *paths)
    return code, json.loads(out), err


def render_all(result) -> None:
    report = build_report(result)
    json.loads(render_json(report))
    json.loads(render_sarif(report))
    render_text(report, color=True)
    render_junit(result, report)


def test_binary_junk_is_an_input_error_and_other_files_are_checked(run_cli, tmp_path):
    junk = tmp_path / "junk.yaml"
    junk.write_bytes(random.Random(7).randbytes(4096))
    good = tmp_path / "pod.yaml"
    good.write_text(POD.format(name="p"))
    code, report, _ = report_of(run_cli, str(junk), str(good))
    assert code == 2
    [error] = report["errors"]
    assert error["file"] == str(junk) and "not UTF-8" in error["message"]
    assert [(f["rule"]["id"], f["location"]["line"]) for f in report["findings"]] == [("SG002", 10)]


@pytest.mark.parametrize(
    "text",
    [
        "\x00\x01\x02 binary-ish",
        "key: \x07bell\n",
        "\ufeff\x1b[2J",
        "a: b: c\n",
        "- [\n",
        "{{{{",
        "!!python/object:os.system x",
    ],
)
def test_utf8_junk_is_an_input_error_with_a_line(run_cli, tmp_path, text):
    path = tmp_path / "junk.yaml"
    path.write_text(text, encoding="utf-8")
    code, report, _ = report_of(run_cli, str(path))
    assert code == 2
    assert [e["file"] for e in report["errors"]] == [str(path)]
    assert isinstance(report["errors"][0]["line"], int)


def test_control_character_is_reported_on_its_line(run_cli, tmp_path):
    path = tmp_path / "bell.yaml"
    path.write_text(POD.format(name="p") + "---\napiVersion: v1\nkind: ConfigMap\ndata:\n  key: \x07bell\n")
    code, report, _ = report_of(run_cli, str(path))
    assert code == 2
    assert [(e["line"], e["message"]) for e in report["errors"]] == [
        (15, "invalid YAML: unacceptable character #x0007: control characters are not allowed")
    ]
    assert [f["object"]["name"] for f in report["findings"]] == ["p"]


def test_truncated_yaml_anywhere_never_crashes(policy):
    text = (DATA / "lines.yaml").read_text()
    for cut in range(0, len(text), 3):
        lines = text[:cut].count("\n") + 1
        documents, errors = read_documents("cut.yaml", text[:cut])
        # libyaml may place an error at the end of the input, one line past a line cut short.
        assert all(e.file == "cut.yaml" and e.line is not None and 1 <= e.line <= lines + 1 for e in errors), cut
        for checked in check_documents(documents, policy):
            assert all(1 <= checked.document.line_of(f.path) <= lines for f in checked.findings), cut


def test_truncated_file_reports_the_documents_it_can(run_cli, tmp_path):
    text = (DATA / "lines.yaml").read_text()
    path = tmp_path / "cut.yaml"
    path.write_text(text[: text.index("      - name: main")])  # inside the Deployment
    code, report, _ = report_of(run_cli, str(path))
    assert code == 1  # a truncated block mapping is still valid YAML: what is there gets checked
    assert sorted(f["rule"]["id"] for f in report["findings"]) == ["SG001", "SG003"]
    path.write_text(text[: text.index("one-for-all") - 2] + ' "unterminated\n---\n' + POD.format(name="after"))
    code, report, _ = report_of(run_cli, str(path))
    assert code == 2
    assert [e["line"] for e in report["errors"]] == [52]
    names = sorted(f["object"]["name"] for f in report["findings"])
    assert names == ["after", "keep-gpu", "no-grace"]


@pytest.mark.timeout(60)
def test_a_50_megabyte_file(run_cli, tmp_path):
    rng = random.Random(1)
    line = "    " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(95)) + "\n"
    blob = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: blob-{i}\ndata:\n  model.bin.b64: |\n" + line * 10_000
    parts = []
    for i in range(50):
        parts += [blob.format(i=i), POD.format(name=f"p{i}")]
    text = "---\n".join(parts)
    assert len(text) > 50_000_000
    path = tmp_path / "big.yaml"
    path.write_text(text)
    code, report, _ = report_of(run_cli, str(path))
    assert code == 1
    assert report["summary"]["documents"] == 100
    last = report["findings"][-1]
    assert last["object"]["name"] == "p49"
    assert last["location"]["line"] == text.count("\n")  # the pod's resourceClaimName line, the file's last
    assert last["location"]["document"] == 99


@pytest.mark.parametrize(
    "nested",
    [
        "a: " + "[" * 5000 + "]" * 5000 + "\n",
        "a: " + "{b: " * 5000 + "c" + "}" * 5000 + "\n",
        "".join("  " * i + f"k{i}:\n" for i in range(5000)) + "  " * 5000 + "v\n",
        "".join("  " * i + "-\n" for i in range(5000)) + "  " * 5000 + "x\n",
    ],
    ids=["flow-sequences", "flow-mappings", "block-mappings", "block-sequences"],
)
def test_deeply_nested_document_is_an_error_and_the_next_document_is_checked(run_cli, tmp_path, nested):
    path = tmp_path / "deep.yaml"
    path.write_text(nested + "---\n" + POD.format(name="after"))
    code, report, _ = report_of(run_cli, str(path))
    assert code == 2
    assert [e["file"] for e in report["errors"]] == [str(path)]
    assert [(f["object"]["name"], f["location"]["line"], f["location"]["document"]) for f in report["findings"]] == [
        ("after", nested.count("\n") + 1 + 10, 1)
    ]


def test_deeply_nested_json(run_cli, tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"a": ' + "[" * 5000 + "]" * 5000 + "}")
    code, report, _ = report_of(run_cli, str(path))
    assert code == 2 and len(report["errors"]) == 1


@pytest.mark.parametrize("depth", [200, 480, 900])
def test_nesting_below_the_parser_limit_never_crashes(run_cli, tmp_path, depth):
    path = tmp_path / "deep.yaml"
    pod = yaml.safe_load(POD.format(name="p"))
    node = pod["metadata"]
    for _ in range(depth):
        node["x"] = {}
        node = node["x"]
    path.write_text(json.dumps(pod))
    code, report, _ = report_of(run_cli, str(path))
    assert code in (1, 2)
    assert report["findings"] or report["errors"]


def _seeds() -> list[dict]:
    examples = sorted((Path(__file__).parents[1] / "manifests" / "examples").rglob("*.yaml"))
    docs = [d for p in examples for d in yaml.safe_load_all(p.read_text())]
    docs += [d for d in yaml.safe_load_all((DATA / "lines.yaml").read_text())]
    return [d for d in docs if isinstance(d, dict)]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _paths(value, (*prefix, index))


def test_wrong_types_in_every_field_of_every_example(run_cli, tmp_path, policy):
    """Every field of every example replaced by each of a few wrongly typed values: one document each."""
    replacements = [None, 0, -1, True, "x", 1.5, [], {}, ["x"], {"x": "y"}]
    documents = []
    for seed in _seeds():
        for path in _paths(seed):
            if not path:
                continue
            for value in replacements:
                if path == ("apiVersion",) and value is None:
                    continue  # a kind without apiVersion is an input error (test_check_api_version)
                doc = copy.deepcopy(seed)
                node = doc
                for part in path[:-1]:
                    node = node[part]
                node[path[-1]] = value
                documents.append(doc)
    assert len(documents) > 4000
    path = tmp_path / "wrong.yaml"
    # JSON is YAML, and much faster to write than PyYAML's pure-Python emitter.
    text = "---\n".join(json.dumps(doc, indent=1) + "\n" for doc in documents)
    path.write_text(text)
    code, report, err = report_of(run_cli, str(path))
    assert code == 1 and err == ""
    assert report["errors"] == [] and report["summary"]["documents"] == len(documents)
    lines = text.count("\n")
    assert all(1 <= finding["location"]["line"] <= lines for finding in report["findings"])
    render_all(run_check([str(path)], policy))


def test_documents_that_are_not_objects(run_cli, tmp_path):
    """A scalar document is an error; a list of things that are no Kubernetes objects is no manifest (a
    list-shaped config file) and is left alone."""
    path = tmp_path / "odd.yaml"
    path.write_text(
        "just a string\n---\n- a\n- list\n---\n42\n---\n---\n# only a comment\n---\n"
        "apiVersion: v1\nkind: List\nitems:\n- 1\n- apiVersion: v1\n  kind: ConfigMap\n  metadata: {name: ok}\n---\n"
        + POD.format(name="last")
    )
    code, report, _ = report_of(run_cli, str(path))
    assert code == 2
    assert [(e["line"], e["message"]) for e in report["errors"]] == [
        (1, "document 0 is a str, not a Kubernetes object"),
        (6, "document 2 is a int, not a Kubernetes object"),
        (11, "document 5: items[0] is not an object"),
    ]
    assert [(f["object"]["name"], f["location"]["document"]) for f in report["findings"]] == [("last", 6)]
    assert report["summary"]["documents"] == 2


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing here\n", "---\n", "---\n...\n"])
def test_empty_inputs_pass(run_cli, tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    code, report, _ = report_of(run_cli, str(path))
    assert (code, report["errors"], report["summary"]["documents"]) == (0, [], 0)


def test_alias_bomb_is_read_without_blowing_up(run_cli, tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: bomb}\ndata:\n" + "".join(f"  {x}\n" for x in lines)
    )
    code, report, _ = report_of(run_cli, str(path))
    assert code == 0 and report["summary"]["documents"] == 1


def test_line_numbers_survive_crlf_bom_and_non_ascii(run_cli, tmp_path):
    text = "# ünïcödé 😀 comment\n---\n" + POD.format(name="p😀") + "---\n" + POD.format(name="q")
    for variant, data in {
        "crlf": text.replace("\n", "\r\n").encode(),
        "bom": b"\xef\xbb\xbf" + text.encode(),
        "plain": text.encode(),
    }.items():
        path = tmp_path / f"{variant}.yaml"
        path.write_bytes(data)
        code, report, _ = report_of(run_cli, str(path))
        assert code == 1, variant
        assert [(f["object"]["name"], f["location"]["line"]) for f in report["findings"]] == [("p😀", 12), ("q", 23)]


def test_document_on_the_marker_line(run_cli, tmp_path):
    path = tmp_path / "inline.yaml"
    path.write_text(
        "--- {apiVersion: v1, kind: Pod, metadata: {name: a}, spec: {resourceClaims: [{name: g, resourceClaimName: c}],\n"
        "  terminationGracePeriodSeconds: 30}}\n--- !!map\n" + POD.format(name="b")
    )
    code, report, _ = report_of(run_cli, str(path))
    assert code == 1
    assert [(f["object"]["name"], f["location"]["line"]) for f in report["findings"]] == [("a", 1), ("b", 13)]
