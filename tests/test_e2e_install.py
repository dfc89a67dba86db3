"""scrubgate installed as a platform team installs it, on the real control plane: `helm install` of
charts/scrubgate (values for host processes) into a namespace of its choosing, then a GPU Job's whole lifecycle; and the reports of what was
already there: objects created while no scrubgate webhook existed, found by `scrubgate check --cluster` and
written as wgpolicyk8s.io PolicyReports by `scrubgate reports --once` (the CRDs come with the chart)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import e2e_support
import pytest
import yaml
from e2e_support import (
    allocated_device,
    assert_invariant,
    create_template,
    running_claim,
    tenant_job,
    tenant_namespace,
    verified_attestation,
    wait_gone,
    wait_phase,
)
from kubernetes.client.exceptions import ApiException
from scrubgate.policies import names

from devcluster import workloads
from devcluster.harness import REPO_ROOT, Cluster, wait_for
from devcluster.processes import HarnessError

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

cluster_factory_fixture = e2e_support.cluster_factory_fixture

CANARY = "HELM-INSTALLED-CANARY-3391"
RETAIN = {names.ANNOTATION_DEALLOCATION_POLICY: names.DEALLOCATION_RETAIN}


def scrubgate(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    """The scrubgate CLI as an operator runs it against the cluster (the admin's kubeconfig)."""
    kubeconfig = str(cluster.control_plane.credentials["admin"].kubeconfig)
    return subprocess.run(
        [sys.executable, "-m", "scrubgate.cli", *args, "--kubeconfig", kubeconfig],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO_ROOT,
    )


def test_helm_install_then_a_gpu_job_and_reports_of_what_was_there(cluster_factory, tmp_path: Path) -> None:
    # In a namespace of another name than the base's: the chart names it wherever the base names its own, so
    # the agent's ServiceAccount, its RBAC and the policy's agent identity all meet there.
    cluster = cluster_factory(gpus=1, installer="helm", namespace="gpu-guard")
    assert "scrubgate" in cluster.helm("list", "--short")
    assert cluster.users["agent"].name == "system:serviceaccount:gpu-guard:scrubgate-agent"
    assert cluster.request("GET", "/api/v1/namespaces/gpu-guard/serviceaccounts/scrubgate-agent")

    # One GPU Job's lifecycle through the Helm-installed webhooks: finalizer, fence, scrub, attestation.
    ns = tenant_namespace(cluster, "helm")
    create_template(cluster, "alice", ns, "one-gpu")
    pod = tenant_job(cluster, "alice", ns, template="one-gpu", canary=CANARY, run_seconds=2)
    claim = running_claim(cluster, ns, pod)
    assert names.FINALIZER in claim["metadata"]["finalizers"], "the chart's mutating webhook added no finalizer"
    uuid = cluster.device_uuid(allocated_device(claim)[2])
    wait_phase(cluster, ns, pod, "Succeeded")
    wait_gone(cluster, ns, claim["metadata"]["name"])
    verified_attestation(cluster, claim["metadata"]["uid"])
    assert CANARY.encode() not in cluster.gpu_memory(uuid)

    # Before scrubgate: no webhook configuration, and a tenant leaves what it would have refused.
    for plural in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
        path = f"/apis/admissionregistration.k8s.io/v1/{plural}"
        for doc in cluster.request("GET", path)["items"]:
            if doc["metadata"]["name"].startswith("scrubgate"):
                cluster.request("DELETE", f"{path}/{doc['metadata']['name']}")
    old = tenant_namespace(cluster, "before")

    def refused_while_unguarded() -> bool:
        try:
            create_template(cluster, "alice", old, "keep", claim_annotations=RETAIN)
        except Exception:
            return False
        return True

    wait_for(refused_while_unguarded, 30, "the webhook configurations gone from the API server's view")
    shared = workloads.pod("shares", claim="team-claim")
    cluster.request(
        "POST", cluster.resource_path("resourceclaims", old), workloads.resource_claim("team-claim"), user="alice"
    )
    cluster.core("alice").create_namespaced_pod(old, shared)

    # scrubgate comes back (helm upgrade restores its webhooks); what predates it is reported, not refused.
    cluster.helm("upgrade", "scrubgate", str(REPO_ROOT / "charts" / "scrubgate"), "--reuse-values")
    found = scrubgate(cluster, "check", "--cluster", "--format", "json")
    assert found.returncode == 1, found.stdout + found.stderr  # deny findings
    findings = json.loads(found.stdout)["findings"]
    in_old = {
        (f["rule"]["id"], f["object"]["kind"], f["object"]["name"])
        for f in findings
        if f["object"].get("namespace") == old
    }
    assert ("SG001", "ResourceClaimTemplate", "keep") in in_old, in_old
    assert ("SG002", "Pod", "shares") in in_old, in_old
    # The claim created without the finalizer got it from the agent once its pod ran (and the agent's
    # annotations, which are not a finding on a stored claim).
    assert not [f for f in in_old if f[2] == "team-claim"], in_old

    written = scrubgate(cluster, "reports", "--once")
    assert written.returncode == 0, written.stdout + written.stderr
    reports = cluster.request("GET", f"/apis/wgpolicyk8s.io/v1alpha2/namespaces/{old}/policyreports")["items"]
    assert reports, f"no PolicyReport in {old}"
    results = [r for report in reports for r in report.get("results") or []]
    assert {(r["rule"], r["resources"][0]["name"]) for r in results} >= {
        ("SG001", "keep"),
        ("SG002", "shares"),
    }, results
    assert all(r["source"] == "scrubgate" and r["result"] in ("fail", "warn") for r in results), results
    assert_invariant(cluster)
    # This release owns the report CRDs (reports.installCRDs, for a cluster with no policy engine): Kyverno's
    # would not install beside them. The default leaves them to Kyverno (the test below).
    with pytest.raises(HarnessError, match="cannot be imported into the current release"):
        cluster.helm("install", "kyverno", str(kyverno_like_chart(tmp_path)))


def kyverno_like_chart(root: Path) -> Path:
    """A chart that installs the wgpolicyk8s.io CRDs as templates, owned by its release, as Kyverno's `crds`
    subchart does."""
    chart = root / "kyverno-crds"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: kyverno-crds\nversion: 3.5.0\n")
    crds = [d for d in yaml.safe_load_all((REPO_ROOT / "manifests/components/reports/crds.yaml").read_text()) if d]
    for crd in crds:
        crd["metadata"]["labels"] = {"app.kubernetes.io/name": "kyverno"}
    (chart / "templates" / "crds.yaml").write_text(yaml.safe_dump_all(crds))
    return chart


def test_kyverno_installs_its_report_crds_after_the_default_chart(cluster_factory, tmp_path: Path) -> None:
    """The chart's defaults own no CRD of another project: Kyverno's chart, installed after it, creates the
    wgpolicyk8s.io CRDs as its own; `scrubgate reports` then writes into them."""
    cluster = cluster_factory(gpus=1, installer="helm", helm_set=("reports.installCRDs=false",))
    crd_path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/policyreports.wgpolicyk8s.io"
    with pytest.raises(ApiException) as missing:
        cluster.request("GET", crd_path)
    assert missing.value.status == 404, "the default install created a CRD"
    cluster.helm("install", "kyverno", str(kyverno_like_chart(tmp_path)))
    crd = cluster.request("GET", crd_path)
    assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == "kyverno"
    written = scrubgate(cluster, "reports", "--once")
    assert written.returncode == 0, written.stdout + written.stderr
