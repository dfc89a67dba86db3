"""`pip install scrubgate` as a pipeline or pre-commit does it: the runtime dependencies alone, no extra. The
checker must work there (DeviceClasses included) as it does in the test environment, which has every extra;
what needs the `server` extra must say so rather than crash.

The environment is built from a wheelhouse under ~/.cache/scrubgate (pip fills it on the first run, from the
index; later runs install from it alone, offline, in seconds)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import yaml

from scrubgate import cli

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
WHEELS = Path.home() / ".cache" / "scrubgate" / f"wheels-py{sys.version_info.major}{sys.version_info.minor}"
# The server stack, by its import names: none of it may be in the runtime install.
SERVER_MODULES = sorted(module for module, extra in cli.EXTRA_OF_MODULE.items() if extra == "server")


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "--no-input", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def _source(into: Path) -> Path:
    """The files a wheel is built from (pyproject's packages), away from the worktree's build leftovers."""
    into.mkdir()
    shutil.copy2(REPO / "pyproject.toml", into)
    shutil.copy2(REPO / "README.md", into)
    for directory in set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(REPO / directory, into / directory, ignore=shutil.ignore_patterns("__pycache__"))
    return into


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> Path:
    """The bin directory of a virtualenv holding `pip install SOURCE` (no extra)."""
    root = tmp_path_factory.mktemp("runtime")
    source = _source(root / "src")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    offline = ("install", "--no-index", "--find-links", str(WHEELS), str(source))
    done = _pip(python, *offline)
    if done.returncode != 0:  # a dependency not in the wheelhouse yet: fetch the wheels once
        WHEELS.mkdir(parents=True, exist_ok=True)
        for fetch in (
            ("wheel", "--wheel-dir", str(WHEELS), str(source)),
            ("download", "-d", str(WHEELS), "setuptools>=69", "wheel"),
        ):
            fetched = _pip(python, *fetch)
            assert fetched.returncode == 0, f"pip {' '.join(fetch)}: {fetched.stderr[-3000:]}"
        for built in WHEELS.glob("scrubgate-*.whl"):  # this checkout's own wheel is built afresh each time
            built.unlink()
        done = _pip(python, *offline)
    assert done.returncode == 0, done.stderr[-3000:]
    return python.parent


def run(binary: Path, *args: str, stdin: str = "", cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{binary}:/usr/bin:/bin", "HOME": str(binary.parent.parent), "NO_COLOR": "1"}
    return subprocess.run(
        [str(binary / "scrubgate"), *args], input=stdin, capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def test_the_runtime_install_has_no_server_stack(runtime):
    probe = "import importlib.util, sys; print([m for m in sys.argv[1:] if importlib.util.find_spec(m)])"
    done = subprocess.run(
        [str(runtime / "python"), "-I", "-c", probe, *SERVER_MODULES], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize(
    "paths",
    [
        ["manifests/examples/good"],  # NVIDIA's gpu.nvidia.com DeviceClass among them
        ["manifests/examples/bad"],  # a DeviceClass SG009 refuses among them
        ["tests/realworld/nvidia-dra-driver-gpu"],  # NVIDIA's demo specs, DeviceClasses included
    ],
    ids=["good", "bad", "nvidia"],
)
def test_check_runs_without_extras_as_with_them(runtime, run_cli, monkeypatch, paths):
    """Behaviour, not modules: the same report and exit code as in the full environment, and no traceback."""
    monkeypatch.chdir(REPO)
    expected_code, expected, _ = run_cli("check", "--format", "json", *paths)
    done = run(runtime, "check", "--format", "json", *paths)
    assert "Traceback" not in done.stderr, done.stderr
    assert (done.returncode, json.loads(done.stdout)) == (expected_code, json.loads(expected))
    assert expected_code in (0, 1)


def test_the_pre_commit_hook_runs_without_extras(runtime, tmp_path):
    """pre-commit installs the repository without extras and runs the hook's entry on the changed files."""
    [hook] = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    assert hook["language"] == "python" and "additional_dependencies" not in hook
    command, *args = hook["entry"].split()
    assert command == "scrubgate"
    bad = sorted(str(p.relative_to(REPO)) for p in (REPO / "manifests" / "examples" / "bad").glob("*.yaml"))
    done = run(runtime, *args, *bad)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "SG009" in done.stdout and "SG001" in done.stdout
    done = run(runtime, *args, "manifests/examples/good/full-gpu-pod.yaml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_check_imports_only_what_it_needs(tmp_path):
    """Even where every extra is installed (the image), `check` loads no server code, nor what only --fix
    needs: a pipeline's start-up is the checker's."""
    probe = (
        "import sys; from scrubgate.cli import main; code = main(sys.argv[1:]); "
        "print(sorted({m.partition('.')[0] for m in sys.modules} | {m for m in sys.modules if m.startswith('scrubgate.')}))"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", probe, "check", "--format", "sarif", str(REPO / "manifests" / "examples" / "bad")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    loaded = set(json.loads(done.stdout.splitlines()[-1].replace("'", '"')))
    assert "scrubgate.policies.engine" in loaded  # the probe saw the check run
    unwanted = {*SERVER_MODULES, "ruamel", "jsonpatch", "scrubgate.cluster", "scrubgate.policyreport"}
    unwanted |= {
        m for m in loaded if m.startswith(("scrubgate.webhook", "scrubgate.sanitizer_agent", "scrubgate.certs"))
    }
    assert not loaded & unwanted, loaded & unwanted


def test_certs_and_audit_need_no_extra(runtime, tmp_path):
    done = run(runtime, "certs", "generate", "--out", str(tmp_path / "certs"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "certs" / "tls.crt").is_file()
    (tmp_path / "audit.log").write_text("")
    done = run(runtime, "audit", "verify", str(tmp_path / "audit.log"))
    assert done.returncode == 0 and "intact" in done.stdout, done.stderr


def test_every_command_shows_its_help_without_extras(runtime):
    assert run(runtime, "--help").returncode == 0
    for command in ("check", *(c[0] for c in cli.COMPONENTS)):
        done = run(runtime, command, "--help")
        assert done.returncode == 0 and "usage: scrubgate " + command in done.stdout, command + done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["webhook", "--tls-cert", "CERTS/tls.crt", "--tls-key", "CERTS/tls.key", "--port", "0"],
        ["agent", "--node", "gpu-node-1", "--gpu-backend", "simulated", "--simulated-root", "CERTS"],
        ["reports", "--once"],
        ["uninstall"],
        ["check", "--cluster"],
    ],
    ids=lambda args: " ".join(args[:2]) if args[0] == "check" else args[0],
)
def test_a_command_that_needs_the_server_extra_says_which_to_install(runtime, tmp_path, args):
    certs = tmp_path / "certs"
    assert run(runtime, "certs", "generate", "--out", str(certs)).returncode == 0
    env_args = [a.replace("CERTS", str(certs)) for a in args]
    done = subprocess.run(
        [str(runtime / "scrubgate"), *env_args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "no-kubeconfig")},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    command = " ".join(args[:2]) if args[0] == "check" else args[0]
    assert done.stderr.startswith(f"scrubgate {command}: needs the `server` extra"), done.stderr
    assert "pip install 'scrubgate[server]'" in done.stderr


# --- the table of extras -------------------------------------------------------------------------------------


def test_the_extras_table_names_every_optional_distribution_of_pyproject():
    """Each distribution of the server and gpu extras brings a module the table maps to its extra, and no
    module of a runtime dependency is blamed on an extra. Read from the test environment, which has the server
    extra whole and of the gpu extra what the tests use (the GPU tests fake pynvml)."""
    modules_of: dict[str, set[str]] = {}
    for module, distributions in packages_distributions().items():
        for distribution in distributions:
            modules_of.setdefault(_canonical(distribution), set()).add(module)
    optional = PYPROJECT["project"]["optional-dependencies"]
    checked = []
    for extra in ("server", "gpu"):
        for requirement in optional[extra]:
            name = _canonical(_name(requirement))
            if extra == "gpu" and name not in modules_of:
                continue
            assert modules_of.get(name), f"{name} of [{extra}] is not installed in the test environment"
            assert any(cli.EXTRA_OF_MODULE.get(m) == extra for m in modules_of[name]), (name, modules_of[name])
            checked.append(name)
    assert len(checked) >= len(optional["server"]) + 1
    for requirement in PYPROJECT["project"]["dependencies"]:
        assert not modules_of[_canonical(_name(requirement))] & set(cli.EXTRA_OF_MODULE), requirement


def _name(requirement: str) -> str:
    return requirement.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].split("!")[0].strip()


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def test_a_missing_gpu_binding_names_the_gpu_extra(run_cli, monkeypatch):
    def needs_cuda(args):
        raise ModuleNotFoundError("No module named 'cuda'", name="cuda.bindings")

    monkeypatch.setattr(cli, "run_check_command", needs_cuda)
    code, _, err = run_cli("check")
    assert code == 2 and "needs the `gpu` extra" in err and "pip install 'scrubgate[gpu]'" in err


def test_a_missing_runtime_dependency_is_no_extra_and_is_not_hidden(run_cli, monkeypatch):
    """A broken install (a runtime dependency gone) is a bug to see whole, not an extra to install."""

    def broken(args):
        raise ModuleNotFoundError("No module named 'yaml'", name="yaml")

    monkeypatch.setattr(cli, "run_check_command", broken)
    with pytest.raises(ModuleNotFoundError):
        run_cli("check")


def test_the_image_installs_the_server_extra():
    script = (REPO / "tools" / "install-image.sh").read_text()
    assert '"$source_dir[server,gpu]"' in script
    assert os.access(REPO / "tools" / "install-image.sh", os.X_OK)
