"""The chart as `helm install`, `upgrade`, `rollback` and `uninstall` meet it on a real kube-apiserver (v1.37.2,
with etcd and no controllers: objects are stored, no pod or Job ever runs): one release per cluster, refused at
render time; and a failed pre-delete hook recovered by what its texts (the NOTES, `scrubgate uninstall`'s
message) say. helm is built from its Go module by tools/build-go-tool.sh, as in test_chart.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from k8s_support import api_server

from devcluster.controlplane import binaries

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "scrubgate"
NAMESPACE = "gpu-guard"

pytestmark = pytest.mark.timeout(600)

Helm = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def helm_binary() -> str:
    result = subprocess.run(
        [str(REPO / "tools" / "build-go-tool.sh"), "helm"], capture_output=True, text=True, timeout=1700, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Path]:
    """A bare kube-apiserver; its admin kubeconfig."""
    with api_server(tmp_path) as plane:
        yield plane.credentials["admin"].kubeconfig


@pytest.fixture
def helm(helm_binary: str, cluster: Path) -> Helm:
    """helm as the cluster's admin, in NAMESPACE unless `namespace` says otherwise."""

    def run(*args: str, namespace: str = NAMESPACE) -> subprocess.CompletedProcess[str]:
        argv = [helm_binary, *args, "--kubeconfig", str(cluster), "--namespace", namespace]
        return subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)

    return run


def status(helm: Helm, release: str) -> str:
    result = helm("status", release, "-o", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["info"]["status"]


def test_one_release_per_cluster(helm: Helm, cluster: Path):
    """The webhooks and agents act on every namespace and node, and the objects carry the base's fixed names: a
    second release, under another name or in another namespace, is refused at render time with what to do, not
    with Helm's ownership error; the release itself upgrades. So is a release beside a kustomize install."""
    installed = helm("install", "sg", str(CHART), "--create-namespace")
    assert installed.returncode == 0, installed.stderr
    for release, namespace in (("other", "team-x"), ("sg", "team-x"), ("other", NAMESPACE)):
        second = helm("install", release, str(CHART), "--create-namespace", "--dry-run=server", namespace=namespace)
        assert second.returncode != 0
        assert 'already installed in this cluster by the release "sg" in the namespace "gpu-guard"' in second.stderr
        assert f"helm upgrade sg charts/scrubgate -n {NAMESPACE}" in second.stderr
    upgraded = helm("upgrade", "sg", str(CHART), "--dry-run=server")
    assert upgraded.returncode == 0, upgraded.stderr

    # kubectl apply -k manifests/ leaves no Helm release on the objects.
    assert helm("uninstall", "sg", "--no-hooks").returncode == 0
    kubectl = [binaries()["kubectl"], "--kubeconfig", str(cluster)]
    created = subprocess.run(
        [*kubectl, "create", "-f", "-"],
        input=json.dumps(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingWebhookConfiguration",
                "metadata": {"name": "scrubgate-validating"},
            }
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert created.returncode == 0, created.stderr
    beside = helm("install", "sg", str(CHART), "--dry-run=server")
    assert beside.returncode != 0 and "already installed in this cluster, not by Helm" in beside.stderr


def test_a_failed_uninstall_hook_is_recovered_as_its_text_says(helm: Helm, cluster: Path):
    """A pre-delete hook that does not succeed (here it never runs: no Job controller; on a cluster, a teardown
    still pending) fails `helm uninstall` and leaves the release `uninstalling`, where `helm upgrade` fails: the
    NOTES and `scrubgate uninstall` say `helm rollback` to that revision, which deploys it again with its values;
    and `--no-hooks` once `scrubgate uninstall` has removed the guard."""
    installed = helm("install", "sg", str(CHART), "--create-namespace", "--set", "webhook.replicas=3")
    assert installed.returncode == 0, installed.stderr
    upgraded = helm("upgrade", "sg", str(CHART), "--reuse-values", "--set", "webhook.replicas=4")
    assert upgraded.returncode == 0, upgraded.stderr
    notes = upgraded.stdout

    failed = helm("uninstall", "sg", "--timeout", "5s")
    assert failed.returncode != 0 and "sg-uninstall" in failed.stderr, failed.stderr
    assert status(helm, "sg") == "uninstalling"
    stuck = helm("upgrade", "sg", str(CHART), "--reuse-values")
    assert stuck.returncode != 0 and '"sg" has no deployed releases' in stuck.stderr, stuck.stderr

    # What the NOTES say to do.
    assert 'where\n`helm upgrade` fails ("has no deployed releases")' in notes
    assert (
        f"helm -n {NAMESPACE} rollback sg REVISION   # REVISION: the one `helm -n {NAMESPACE} history sg` shows"
        in notes
    )
    history = json.loads(helm("history", "sg", "-o", "json").stdout)
    (revision,) = [entry["revision"] for entry in history if entry["status"] == "uninstalling"]
    rolled_back = helm("rollback", "sg", str(revision))
    assert rolled_back.returncode == 0, rolled_back.stderr
    assert status(helm, "sg") == "deployed"
    values = json.loads(helm("get", "values", "sg", "-o", "json").stdout)
    assert values == {"webhook": {"replicas": 4}}, "the values of the revision that was being uninstalled"
    assert helm("upgrade", "sg", str(CHART), "--reuse-values").returncode == 0, "upgradable again"

    # --no-hooks once the guard is gone: `scrubgate uninstall` by hand (no agent pod here to wait for).
    assert "`--no-hooks` skips the wait: use it only once\n`scrubgate uninstall -n gpu-guard` has succeeded" in notes
    by_hand = subprocess.run(
        [sys.executable, "-m", "scrubgate.cli", "uninstall", "--namespace", NAMESPACE, "--kubeconfig", str(cluster)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert by_hand.returncode == 0, by_hand.stdout + by_hand.stderr
    assert "deleted validatingwebhookconfigurations scrubgate-validating" in by_hand.stdout
    removed = helm("uninstall", "sg", "--no-hooks")
    assert removed.returncode == 0, removed.stderr
    assert helm("status", "sg").returncode != 0
