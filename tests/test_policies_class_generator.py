"""The generator of tests/test_e2e_device_classes.py, held to scrubgate's parser without a cluster: each generated
class is read (policies/selectors.py) as it was built (tests/class_generator.py: the drivers and types its
top-level conjuncts restrict it to), and the e2e test's seeded set covers what issue 28 lists."""

from __future__ import annotations

import pytest
from class_generator import Generated, generate
from scrubgate.policies.selectors import class_verdict
from test_e2e_device_classes import COUNT, SEED

GPU_DRIVERS = ("gpu.nvidia.com",)


@pytest.mark.parametrize("seed", [SEED, 1, 2, 3])
def test_the_parser_reads_each_generated_class_as_it_was_built(seed):
    wrong = []
    for generated in generate(seed, 1000):
        verdict = class_verdict(generated.obj(), GPU_DRIVERS)
        if (verdict.gpu, verdict.gpu_memory) != generated.proves(GPU_DRIVERS) or "could not read" in verdict.why:
            wrong.append(f"{generated.name} {[s.text for s in generated.selectors]}: {verdict.why}")
    assert not wrong, "\n".join(wrong[:20])


def test_the_same_seed_gives_the_same_classes():
    assert [g.obj() for g in generate(SEED, 50)] == [g.obj() for g in generate(SEED, 50)]
    assert [g.obj() for g in generate(SEED, 50)] != [g.obj() for g in generate(SEED + 1, 50)]


def _texts(classes: list[Generated]) -> str:
    return "\n".join(s.text for g in classes for s in g.selectors)


@pytest.mark.parametrize(
    "spelling",
    [
        "device.driver == ",
        "== device.driver",
        "device.driver in [",
        "has(device.attributes[",
        "device.attributes[device.driver]",
        "device.capacity[",
        "device.attributes.exists(d, ",
        "device.attributes.exists(d, v, ",
        "].exists(k, ",
        ".startsWith(",
        ".lowerAscii()",
        ".matches(",
        ".?",
        ".orValue(",
        "[?",
        "cel.bind(",
        "allowMultipleAllocations",
        "resource.kubernetes.io",
        "pcieRoot",
        "semver(",
        "quantity(",
        " || ",
        " ? ",
        "!(",
        "// ",
        "\\x",
        "\\u",
        "\\U",
        '"""',
        "'''",
        'r"',
    ],
)
def test_the_seeded_set_covers_the_grammar(spelling):
    assert spelling in _texts(generate(SEED, COUNT))


def test_the_seeded_set_has_every_kind_of_class():
    classes = generate(SEED, COUNT)
    kinds = {(g.plan, g.proves(GPU_DRIVERS)) for g in classes}
    assert {("vendor", (False, False)), ("vendor", (True, True)), ("typed", (True, False))} <= kinds
    assert ("free", (True, True)) in kinds
    excluded = [g.proves(GPU_DRIVERS)[1] for g in classes if g.excluded]
    assert excluded.count(False) > excluded.count(True) > 0  # most excluded classes prove it; a few do not
    assert any(g.extended_resource for g in classes)
    assert {g.version for g in classes} == {"v1", "v1beta2", "v1beta1"}
