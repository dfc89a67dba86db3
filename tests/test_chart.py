"""The Helm chart in charts/scrubgate: lints, renders what the kustomize base renders (it reads the base's
own files), passes `scrubgate check` and strict schema validation, and turns each value into what it says.
helm is built from its Go module by tools/build-go-tool.sh (cached by version)."""

from __future__ import annotations

import base64
import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scrubgate.certs import generate as gen
from scrubgate.policies.attestation import load_private_key, public_key_pem
from scrubgate.policies.config import PolicyConfig, load_policy
from test_manifests import kustomize

from scrubgate import __version__
from scrubgate.check import run_check
from tools import chart_schema

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "scrubgate"
IMAGE = f"ghcr.io/scrubgate/scrubgate:{__version__}"
NAMESPACE = "scrubgate-system"
HELM_LABELS = {"app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "helm.sh/chart"}

# Building helm the first time takes minutes on two cores; later runs find it in the cache.
pytestmark = pytest.mark.timeout(1800)

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def helm() -> str:
    result = subprocess.run(
        [str(REPO / "tools" / "build-go-tool.sh"), "helm"], capture_output=True, text=True, timeout=1700, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def run_helm(helm: str, *args: str, chart: Path = CHART) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm, "template", "scrubgate", str(chart), "-n", NAMESPACE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def render(helm: str, *args: str, chart: Path = CHART) -> list[Doc]:
    result = run_helm(helm, *args, chart=chart)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def webhooks(docs: list[Doc]) -> list[Doc]:
    return [w for d in docs if d["kind"].endswith("WebhookConfiguration") for w in d["webhooks"]]


@pytest.fixture(scope="module")
def default(helm: str) -> list[Doc]:
    return render(helm, "--include-crds")


# --- lint, check, schema ---------------------------------------------------------------------------


def test_chart_lints(helm: str):
    result = subprocess.run(
        [helm, "lint", "--strict", str(CHART), "-n", NAMESPACE], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_render_passes_scrubgate_check(helm: str, tmp_path: Path):
    rendered = tmp_path / "chart.yaml"
    rendered.write_text(run_helm(helm, "--set", "metrics.enabled=true").stdout)
    result = run_check([str(rendered)], load_policy(None))
    assert result.errors == [] and result.objects
    assert [f for o in result.objects for f in o.findings] == []


@pytest.mark.parametrize("version", ["1.34", kubernetes_validate.utils.latest_version()])
def test_render_validates_strictly(default: list[Doc], version: str):
    for doc in default:
        kubernetes_validate.validate(doc, version, strict=True)


def test_values_schema_is_the_generated_one():
    assert (CHART / "values.schema.json").read_text() == chart_schema.render(), (
        "values.schema.json is stale: run .venv/bin/python tools/chart_schema.py"
    )


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("policy.rules.SG004.action=block", "/policy/rules/SG004/action"),
        ("policy.gpuDeviceClass=x", "gpuDeviceClass"),
        ("certs.source=vault", "/certs/source"),
        ("webhook.replica=3", "replica"),
        # what the webhook would refuse at start, with every GPU pod and claim write behind it
        ("policy.rules.SG011.action=deny", "SG011"),
        ("policy.excludeDeviceClasses[0]=compute-domain-*.nvidia.com", "/policy/excludeDeviceClasses/0"),
        ("policy.attestationKeys[0].kid=k1,policy.attestationKeys[0].publicKey=not-a-key", "publicKey"),
        ("policy.gracePeriod.minimumSeconds=7200", "minimumSeconds <= defaultSeconds <= maximumSeconds"),
    ],
)
def test_values_outside_the_schema_are_refused(helm: str, setting: str, complaint: str):
    result = run_helm(helm, "--set", setting)
    assert result.returncode != 0 and complaint in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        # `scrubgate reports` would list the whole cluster again and again, about 12 times a second.
        ({"reports": {"interval": "0"}}, "/reports/interval"),
        ({"reports": {"interval": "0s"}}, "/reports/interval"),
        ({"reports": {"interval": "0.0m"}}, "/reports/interval"),
        ({"reports": {"interval": 0}}, "/reports/interval"),
        ({"reports": {"interval": "-5m"}}, "/reports/interval"),
        # The simulated backend's agent exits at start without the directory of its GPUs' state.
        ({"agent": {"gpuBackend": "simulated"}}, "/agent/simulatedRoot"),
        ({"agent": {"gpuBackend": "simulated", "simulatedRoot": "sim"}}, "/agent/simulatedRoot"),
    ],
)
def test_values_that_render_a_failing_component_are_refused(helm: str, tmp_path: Path, values: Doc, complaint: str):
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    result = run_helm(helm, "-f", str(tmp_path / "values.yaml"))
    assert result.returncode != 0 and complaint in result.stderr, result.stderr


@pytest.mark.parametrize(("interval", "argument"), [("30s", "30s"), ("0.5s", "0.5s"), (90, "90"), ("1h", "1h")])
def test_a_reports_interval_above_zero_is_passed_on(helm: str, tmp_path: Path, interval: str | int, argument: str):
    (tmp_path / "values.yaml").write_text(yaml.safe_dump({"reports": {"interval": interval}}))
    docs = render(helm, "-f", str(tmp_path / "values.yaml"))
    args = one(docs, "Deployment", "scrubgate-reports")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--interval") + 1] == argument


def test_a_non_ed25519_public_key_is_refused(helm: str, tmp_path: Path):
    """An ECDSA key in PEM is a public key, but not one that verifies the agent's (Ed25519) attestations."""
    pem = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )

    def with_key(pem: bytes) -> subprocess.CompletedProcess[str]:
        (tmp_path / "key.pem").write_bytes(pem)
        key = f"policy.attestationKeys[0].publicKey={tmp_path / 'key.pem'}"
        return run_helm(helm, "--set", "policy.attestationKeys[0].kid=k1", "--set-file", key)

    result = with_key(pem)
    assert result.returncode != 0 and "publicKey" in result.stderr, result.stderr
    result = with_key(public_key_pem(Ed25519PrivateKey.generate()).encode())
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("namespace", [None, "default", "kube-system", "kube-public", "kube-node-lease"])
def test_a_shared_namespace_is_refused_unless_allowed(helm: str, namespace: str | None):
    """`helm install` without -n lands in `default`, which the webhooks then leave out: GPU claims there would go
    unguarded, and the agents' key would sit where many may read Secrets. Refused with why and what to do, as
    NVIDIA's DRA driver chart refuses `default` (its templates/validation.yaml); allowed when asked for."""
    argv = [helm, "template", "sg", str(CHART), *(["-n", namespace] if namespace else [])]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode != 0
    assert f'not installing into the namespace "{namespace or "default"}"' in refused.stderr, refused.stderr
    assert "unguarded" in refused.stderr and "-n scrubgate-system --create-namespace" in refused.stderr
    assert "namespace.allowShared=true" in refused.stderr
    allowed = subprocess.run(
        [*argv, "--set", "namespace.allowShared=true"], capture_output=True, text=True, timeout=120
    )
    assert allowed.returncode == 0, allowed.stderr


def test_any_namespace_names_itself_everywhere(helm: str, tmp_path: Path):
    """`helm template` without -n (the namespace `default`, allowed) and with another namespace: every reference
    the base makes to its namespace (the webhooks' Service, RBAC subjects, the agent's identity, the certificate's
    names, the namespace the webhooks leave out) is the release's, and the render passes scrubgate check."""
    for namespace in (None, "gpu-guard"):
        argv = [
            helm,
            "template",
            "sg",
            str(CHART),
            *(["-n", namespace] if namespace else ["--set", "namespace.allowShared=true"]),
        ]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stderr
        namespace = namespace or "default"
        assert NAMESPACE not in result.stdout
        docs = [d for d in yaml.safe_load_all(result.stdout) if d]
        for doc in docs:
            if doc["kind"] not in (
                "ClusterRole",
                "ClusterRoleBinding",
                "PriorityClass",
                "CustomResourceDefinition",
                "FlowSchema",
                "PriorityLevelConfiguration",
            ) and not doc["kind"].endswith("WebhookConfiguration"):
                assert doc["metadata"]["namespace"] == namespace, doc["metadata"]
        for hook in webhooks(docs):
            assert hook["clientConfig"]["service"]["namespace"] == namespace
            for expression in (hook.get("namespaceSelector") or {}).get("matchExpressions") or []:
                if expression["key"] == "kubernetes.io/metadata.name":
                    assert namespace in expression["values"]
        subjects = [s for d in docs if d["kind"].endswith("RoleBinding") for s in d["subjects"]]
        assert subjects and all(s["namespace"] == namespace for s in subjects if s["kind"] == "ServiceAccount")
        flows = [
            s["serviceAccount"]
            for d in docs
            if d["kind"] == "FlowSchema"
            for r in d["spec"]["rules"]
            for s in r["subjects"]
        ]
        assert flows and all(s["namespace"] == namespace for s in flows)
        policy = yaml.safe_load(one(docs, "ConfigMap", "scrubgate-policy")["data"]["policy.yaml"])
        assert policy["agent"]["identities"] == [f"system:serviceaccount:{namespace}:scrubgate-agent"]
        # The certificate is made in the cluster for the Service in this namespace (test_chart_lifecycle.py).
        args = one(docs, "Job", "sg-certs")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--namespace") + 1] == namespace
        rendered = tmp_path / f"{namespace}.yaml"
        rendered.write_text(result.stdout)
        checked = run_check([str(rendered)], load_policy())
        assert not checked.errors and [f for o in checked.objects for f in o.findings] == []


# --- one source of truth with the kustomize base ------------------------------------------------


def comparable(doc: Doc) -> Doc:
    """What the chart adds on purpose removed: its labels, the caBundle, the policy ConfigMap's name
    (kustomize hashes it, the chart rolls the pods with a checksum annotation instead)."""
    doc = copy.deepcopy(doc)
    labels = doc["metadata"].get("labels", {})
    for key in HELM_LABELS:
        labels.pop(key, None)
    for hook in doc.get("webhooks", []):
        hook["clientConfig"].pop("caBundle", None)
    pod = doc.get("spec", {}).get("template", {})
    pod.get("metadata", {}).get("annotations", {}).pop("checksum/policy", None)
    if pod.get("metadata", {}).get("annotations") == {}:
        del pod["metadata"]["annotations"]
    for volume in pod.get("spec", {}).get("volumes", []):
        if volume.get("configMap", {}).get("name", "").startswith("scrubgate-policy"):
            volume["configMap"]["name"] = "scrubgate-policy"
    if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].startswith("scrubgate-policy"):
        doc["metadata"]["name"] = "scrubgate-policy"
        doc["data"] = {"policy.yaml": PolicyConfig.model_validate(yaml.safe_load(doc["data"]["policy.yaml"]))}
    return doc


def test_the_render_is_the_kustomize_base(helm: str, tmp_path: Path):
    """With client authentication on, as the base has it (the base requires the ConfigMap the value renders)."""
    (tmp_path / "client-ca.crt").write_text(gen.generate_ca("client-ca").cert_pem.decode())
    rendered = render(helm, "--include-crds", "--set-file", f"webhook.clientCA={tmp_path / 'client-ca.crt'}")
    base = {(c["kind"], c["metadata"]["name"]): c for d in kustomize(REPO / "manifests") for c in [comparable(d)]}
    chart = {
        (d["kind"], d["metadata"]["name"]): comparable(d)
        for d in rendered
        if (d["kind"], d["metadata"]["name"]) != ("ConfigMap", "scrubgate-webhook-client-ca")
    }
    # The namespace comes from --create-namespace (namespace.create renders it); the chart adds the TLS
    # Secret it generates, the uninstall hook and, with reports.enabled, the reports Deployment, its RBAC and CRDs.
    assert set(base) - set(chart) == {("Namespace", NAMESPACE)}
    assert {kind for kind, _ in set(chart) - set(base)} <= {
        "Pod",  # helm test's
        "Secret",
        "Deployment",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Job",  # the pre-delete hook's, with its Role and RoleBinding
        "Role",
        "RoleBinding",
    }
    for key in sorted(set(base) & set(chart)):
        assert chart[key] == base[key], key


def test_the_chart_follows_the_base_and_refuses_what_it_cannot_render(helm: str, tmp_path: Path):
    chart = tmp_path / "scrubgate"
    shutil.copytree(CHART, chart, symlinks=False)  # the base's files, copied in
    base = chart / "files" / "manifests"
    (base / "extra.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: scrubgate-extra\ndata: {a: b}\n"
    )
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    kustomization["resources"].append("extra.yaml")
    (base / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    extra = one(render(helm, chart=chart), "ConfigMap", "scrubgate-extra")
    assert extra["metadata"]["namespace"] == NAMESPACE
    assert extra["metadata"]["labels"]["app.kubernetes.io/part-of"] == "scrubgate"
    kustomization["resources"].append("more/")
    (base / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    result = run_helm(helm, chart=chart)
    assert result.returncode != 0 and '"more/"' in result.stderr


def test_crds_only_when_asked_and_kept(helm: str, default: list[Doc]):
    """Kyverno (and other engines) own the wgpolicyk8s.io CRDs: a CRD this release created would stop theirs from
    installing, so the default render has none; asked for, they are the reports component's, kept on uninstall."""
    assert not [d for d in default if d["kind"] == "CustomResourceDefinition"]
    shipped = [d for d in yaml.safe_load_all((REPO / "manifests/components/reports/crds.yaml").read_text()) if d]
    asked = [d for d in render(helm, "--set", "reports.installCRDs=true") if d["kind"] == "CustomResourceDefinition"]
    assert [d["metadata"]["name"] for d in asked] == [d["metadata"]["name"] for d in shipped]
    assert all(d["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for d in asked)
    assert [d["spec"] for d in asked] == [d["spec"] for d in shipped]


def test_reports_can_write_openreports(helm: str):
    docs = render(helm, "--set", "reports.api=openreports.io")
    args = one(docs, "Deployment", "scrubgate-reports")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--api") + 1] == "openreports.io"
    rules = one(docs, "ClusterRole", "scrubgate-reports")["rules"]
    assert any("openreports.io" in r["apiGroups"] and "reports" in r["resources"] for r in rules)


def test_image_and_version(default: list[Doc]):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == __version__
    containers = [
        c for d in default for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
    ]
    # webhook, agent, controller, reports, the uninstall hook and the certificates' hook
    assert len(containers) == 6 and {c["image"] for c in containers} == {IMAGE}


# --- values ---------------------------------------------------------------------------------------


def test_self_generated_certificate_matches_every_ca_bundle(helm: str):
    self_generated = render(helm, "--set", "certs.source=self-generated")
    secret = one(self_generated, "Secret", "scrubgate-webhook-tls")
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    serving = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    serving.verify_directly_issued_by(ca)
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert sorted(sans) == sorted(gen.service_sans())
    bundles = {w["clientConfig"]["caBundle"] for w in webhooks(self_generated)}
    assert bundles == {secret["data"]["ca.crt"]}


def test_audit_checkpoints_are_signed_by_default(helm: str, default: list[Doc]):
    """The default install signs its audit checkpoints with a key the chart makes (an Ed25519 PEM the webhook
    loads): in the cluster, by the certificates' hook (test_chart_lifecycle.py), or at render time with
    self-generated certificates; a Secret of the operator's replaces it."""
    args = one(default, "Job", "scrubgate-certs")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--audit-key-secret") + 1] == "scrubgate-audit-signing-key"
    secret = one(render(helm, "--set", "certs.source=self-generated"), "Secret", "scrubgate-audit-signing-key")
    load_private_key(base64.b64decode(secret["data"]["ed25519.pem"]))
    pod = one(default, "Deployment", "scrubgate-webhook")["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--audit-signing-key") + 1] == "/etc/scrubgate/audit-key/ed25519.pem"
    volume = next(v for v in pod["volumes"] if v["name"] == "audit-key")
    assert volume["secret"]["secretName"] == "scrubgate-audit-signing-key"
    for source in ("in-cluster", "self-generated"):
        own = render(helm, "--set", f"webhook.audit.signingKeySecret=mine,certs.source={source}")
        assert not [d for d in own if d["kind"] == "Secret" and d["metadata"]["name"] == "scrubgate-audit-signing-key"]
        assert "--audit-key-secret" not in str([d for d in own if d["kind"] == "Job"])


def test_default_values_start_a_webhook_without_client_authentication(helm: str, default: list[Doc]):
    """Default values on kind or a managed cluster, where the API server presents no client certificate to
    webhooks: the webhook needs no client-CA ConfigMap to start (it would never start, and every GPU pod and
    claim write would be refused), and the NOTES say that client authentication is off and how to turn it on."""
    pod = one(default, "Deployment", "scrubgate-webhook")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "--client-ca" not in container["args"]
    assert "client-ca" not in {m["name"] for m in container["volumeMounts"]} | {v["name"] for v in pod["volumes"]}
    configmaps = {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    assert configmaps <= {d["metadata"]["name"] for d in default if d["kind"] == "ConfigMap"}
    notes = subprocess.run(
        [helm, "install", "--dry-run=client", "sg", str(CHART), "-n", "gpu-guard"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Client authentication is OFF" in notes.stdout and "webhook.clientCA" in notes.stdout
    on = subprocess.run(
        [helm, "install", "--dry-run=client", "sg", str(CHART), "-n", "gpu-guard", "--set", "webhook.clientCA=x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Client authentication is ON" in on.stdout


def test_the_webhooks_are_sent_the_extended_resources_the_policy_counts_as_gpus(helm: str):
    """A pod asking for another vendor's device never waits on scrubgate; one whose vendor the policy's
    gpuExtendedResources names does, with the chart's values as with the base's defaults."""
    docs = render(helm, "--set", "policy.gpuExtendedResources={nvidia.com/gpu,amd.com/gpu}")
    validating = [w for d in docs if d["kind"] == "ValidatingWebhookConfiguration" for w in d["webhooks"]]
    assert len(validating) == 3
    for hook in validating:
        (condition,) = [c for c in hook["matchConditions"] if c["name"] == "pod-spec-may-hold-a-gpu"]
        assert "['amd.com/', 'deviceclass.resource.kubernetes.io/', 'nvidia.com/']" in condition["expression"]


def test_the_knobs_platform_teams_expect(helm: str, default: list[Doc]):
    """Pod annotations, labels, pull secrets and priority class on every pod; the webhook's scheduling; the
    agent's nodeSelector replacing (not merging with) the GPU label; the kubelet's plugins path; monitoring
    labels and the dashboard's namespace; a NetworkPolicy; no PodDisruptionBudget for a single replica."""
    docs = render(
        helm,
        "--set",
        "podAnnotations.team=gpu,podLabels.tier=infra,imagePullSecrets[0].name=regcred,priorityClassName=system-node-critical,"
        "webhook.nodeSelector.pool=system,webhook.tolerations[0].key=dedicated,webhook.tolerations[0].operator=Exists,"
        "agent.nodeSelector.accelerator=h200,agent.kubeletPluginsPath=/data/kubelet/plugins,"
        "metrics.enabled=true,metrics.labels.release=kube-prometheus-stack,metrics.dashboardNamespace=grafana,"
        "networkPolicy.enabled=true,webhook.replicas=1,controller.replicas=3",
    )
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in docs if d["kind"] in ("Deployment", "DaemonSet")}
    assert set(pods) == {"scrubgate-webhook", "scrubgate-agent", "scrubgate-controller", "scrubgate-reports"}
    for template in pods.values():
        assert (
            template["metadata"]["annotations"]["team"] == "gpu" and template["metadata"]["labels"]["tier"] == "infra"
        )
        assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert template["spec"]["priorityClassName"] == "system-node-critical"
    for name in ("scrubgate-webhook", "scrubgate-controller"):
        assert pods[name]["spec"]["nodeSelector"] == {"pool": "system"} and pods[name]["spec"]["tolerations"] == [
            {"key": "dedicated", "operator": "Exists"}
        ]
    assert one(docs, "Deployment", "scrubgate-controller")["spec"]["replicas"] == 3
    agent = pods["scrubgate-agent"]["spec"]
    assert agent["nodeSelector"] == {"accelerator": "h200"}, "replaces the GPU label default"
    checkpoint = next(v for v in agent["volumes"] if v["name"] == "nvidia-checkpoint")
    assert checkpoint["hostPath"]["path"] == "/data/kubelet/plugins/gpu.nvidia.com"
    for kind in ("PodMonitor", "PrometheusRule"):
        assert all(d["metadata"]["labels"]["release"] == "kube-prometheus-stack" for d in docs if d["kind"] == kind)
    assert one(docs, "ConfigMap", "scrubgate-dashboard")["metadata"]["namespace"] == "grafana"
    policy = one(docs, "NetworkPolicy", "scrubgate")["spec"]
    assert [p["port"] for p in policy["ingress"][0]["ports"]] == [8443] and "from" not in policy["ingress"][0]
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget"], "a PDB of one replica blocks every drain"
    assert [d for d in default if d["kind"] == "PodDisruptionBudget"], "two replicas keep theirs"
    assert not [d for d in default if d["kind"] == "NetworkPolicy"]


def test_the_hook_and_the_test_pod_take_the_pod_values(helm: str, tmp_path: Path):
    """The uninstall hook's Job and the `helm test` Pod run once beside the webhook: they take what every pod of
    the chart takes (a mesh's opt-out annotation, labels, pull secrets, priority class) and where the webhook runs
    (its nodeSelector, tolerations and node affinity: tainted or dedicated nodes), but not the pod
    anti-affinity that spreads the webhook's replicas, which would keep them off the webhook's nodes."""
    values = tmp_path / "values.yaml"
    node_affinity = {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}]
        }
    }
    anti_affinity = {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {
                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "webhook"}},
                "topologyKey": "kubernetes.io/hostname",
            }
        ]
    }
    values.write_text(
        yaml.safe_dump(
            {
                "podAnnotations": {"sidecar.istio.io/inject": "false"},
                "podLabels": {"team": "gpu"},
                "imagePullSecrets": [{"name": "regcred"}],
                "priorityClassName": "system-cluster-critical",
                "webhook": {
                    "nodeSelector": {"pool": "system"},
                    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
                    "affinity": {"nodeAffinity": node_affinity, "podAntiAffinity": anti_affinity},
                },
            }
        )
    )
    docs = render(helm, "-f", str(values))
    job = one(docs, "Job", "scrubgate-uninstall")["spec"]["template"]
    (test,) = [d for d in docs if d["kind"] == "Pod"]
    for pod in (job, test):
        assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
        assert pod["metadata"]["labels"]["team"] == "gpu"
        assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "scrubgate", "its own labels stay"
        spec = pod["spec"]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        assert spec["priorityClassName"] == "system-cluster-critical"
        assert spec["nodeSelector"] == {"pool": "system"}
        assert spec["tolerations"] == [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]
        assert spec["affinity"] == {"nodeAffinity": node_affinity}
    kubernetes_validate.validate(test, kubernetes_validate.utils.latest_version(), strict=True)
    webhook = one(docs, "Deployment", "scrubgate-webhook")["spec"]["template"]["spec"]
    assert webhook["affinity"] == {"nodeAffinity": node_affinity, "podAntiAffinity": anti_affinity}
    plain = render(helm)
    for pod in (
        one(plain, "Job", "scrubgate-uninstall")["spec"]["template"],
        *[d for d in plain if d["kind"] == "Pod"],
    ):
        assert not {"nodeSelector", "tolerations", "affinity", "imagePullSecrets", "priorityClassName"} & set(
            pod["spec"]
        )
        assert "annotations" not in pod["metadata"] or "helm.sh/hook" in pod["metadata"]["annotations"]


def test_helm_test_asks_the_webhook_through_its_service(helm: str):
    docs = render(helm, "--namespace", "gpu-guard")
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert "https://{host}/readyz" in pod["spec"]["containers"][0]["args"][0]
    assert 'host = "scrubgate-webhook.gpu-guard.svc"' in pod["spec"]["containers"][0]["args"][0]
    kubernetes_validate.validate(pod, kubernetes_validate.utils.latest_version(), strict=True)
    elsewhere = render(helm, "--set", "webhook.deploy=false,certs.source=provided,certs.provided.caBundle=PEM")
    assert not [d for d in elsewhere if d["kind"] == "Pod"]


def test_cert_manager_source(helm: str):
    docs = render(helm, "--set", "certs.source=cert-manager")
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == ["scrubgate-audit-signing-key"]
    assert {d["kind"] for d in docs if d["apiVersion"].startswith("cert-manager.io/")} == {"Issuer", "Certificate"}
    for doc in docs:
        if doc["kind"].endswith("WebhookConfiguration"):
            assert (
                doc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/scrubgate-webhook-tls"
            )
            assert all("caBundle" not in w["clientConfig"] for w in doc["webhooks"])


@pytest.mark.parametrize("values", [[], ["--set", "metrics.enabled=true,reports.installCRDs=true", "--include-crds"]])
def test_the_default_render_is_stable(helm: str, values: list[str]):
    """Argo CD renders with `helm template` at every refresh: with default values two renders are the same bytes
    (a CA or key generated at render time would show as drift forever, and be rotated at each sync). The
    certificates and the audit key are made in the cluster by the certificates' hook, as Kyverno and Gatekeeper
    make theirs: the render holds no Secret and no caBundle."""
    first, second = run_helm(helm, *values), run_helm(helm, *values)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    docs = [d for d in yaml.safe_load_all(first.stdout) if d]
    assert not [d for d in docs if d["kind"] == "Secret"]
    assert all("caBundle" not in w["clientConfig"] for w in webhooks(docs))
    job = one(docs, "Job", "scrubgate-certs")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade,post-install,post-upgrade"
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["certs", "ensure"]


def test_the_rendered_manifests_recipe(helm: str):
    """docs/install.md, "Rendered manifests": pipelines that apply `helm template`'s output run no hooks, so they
    render with --no-hooks (else the pre-delete Job, applied as a plain Job, runs at once and removes the guard)
    and take the certificate and the audit key from elsewhere: no hook in the render, nothing generated, the same
    bytes every time."""
    recipe = (REPO / "docs" / "install.md").read_text()
    args = [
        "--no-hooks",
        "--set",
        "certs.source=cert-manager",
        "--set",
        "webhook.audit.signingKeySecret=scrubgate-audit-signing-key",
    ]
    assert "--no-hooks \\\n  --set certs.source=cert-manager \\\n  --set webhook.audit.signingKeySecret=" in recipe
    first, second = run_helm(helm, *args), run_helm(helm, *args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    docs = [d for d in yaml.safe_load_all(first.stdout) if d]
    assert not [d for d in docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]
    assert not [d for d in docs if d["kind"] in ("Job", "Pod", "Secret")]
    with_hooks = render(helm, "--set", "certs.source=cert-manager")
    assert one(with_hooks, "Job", "scrubgate-uninstall")["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"


def test_in_cluster_certificates_need_the_webhook_in_the_cluster(helm: str):
    result = run_helm(helm, "--set", "webhook.deploy=false")
    assert result.returncode != 0 and "certs.source=provided" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "values",
    [
        ["--set", "certs.source=cert-manager"],
        [
            "--set",
            "certs.source=cert-manager,certs.certManager.issuerRef.name=corp-ca,certs.certManager.issuerRef.kind=ClusterIssuer",
        ],
        ["--set", "certs.source=provided,certs.provided.caBundle=PEM"],
    ],
    ids=["cert-manager", "cert-manager-own-issuer", "existing-secret"],
)
def test_gitops_renders_are_equal(helm: str, values: list[str]):
    """Argo CD renders with `helm template` (no lookup): with certificates from cert-manager or an existing
    Secret, and an existing audit key Secret, nothing is generated and two renders are the same bytes."""
    argv = [*values, "--set", "webhook.audit.signingKeySecret=audit-key"]
    first, second = run_helm(helm, *argv), run_helm(helm, *argv)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    docs = [d for d in yaml.safe_load_all(first.stdout) if d]
    assert not [d for d in docs if d["kind"] == "Secret"]


def test_cert_manager_with_an_existing_issuer(helm: str):
    docs = render(helm, "--set", "certs.source=cert-manager,certs.certManager.issuerRef.name=corp-ca")
    certificates = [d for d in docs if d["apiVersion"].startswith("cert-manager.io/")]
    assert [(d["kind"], d["metadata"]["name"]) for d in certificates] == [("Certificate", "scrubgate-webhook-tls")]
    assert certificates[0]["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "Issuer", "group": "cert-manager.io"}


def test_provided_source_needs_the_ca(helm: str, tmp_path: Path):
    result = run_helm(helm, "--set", "certs.source=provided")
    assert result.returncode != 0 and "certs.provided.caBundle" in result.stderr
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    docs = render(helm, "--set", "certs.source=provided", "--set-file", f"certs.provided.caBundle={ca}")
    assert {w["clientConfig"]["caBundle"] for w in webhooks(docs)} == {base64.b64encode(ca.read_bytes()).decode()}
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == ["scrubgate-audit-signing-key"]


def test_policy_values_merge_over_the_default(helm: str, tmp_path: Path):
    values = tmp_path / "values.yaml"
    key = public_key_pem(Ed25519PrivateKey.generate())
    values.write_text(
        yaml.safe_dump(
            {
                "policy": {
                    "gpuDeviceClasses": ["gpu.example.com"],
                    "tenancy": {"label": "example.com/tenancy", "trustedValue": "single"},
                    "rules": {"SG004": {"action": "deny"}},
                    "adminGroups": ["gpu-admins"],
                    "attestationKeys": [{"kid": "agent-1", "publicKey": key}],
                }
            }
        )
    )
    docs = render(helm, "-f", str(values))
    text = one(docs, "ConfigMap", "scrubgate-policy")["data"]["policy.yaml"]
    policy = PolicyConfig.model_validate(yaml.safe_load(text))
    default = load_policy(None)
    assert policy.gpu_device_classes == ("gpu.example.com",)  # lists replace
    assert policy.admin_groups == ("gpu-admins",) and [k.kid for k in policy.attestation_keys] == ["agent-1"]
    assert policy.action("SG004") == "deny" and policy.action("SG001") == default.action("SG001")
    assert policy.grace_period == default.grace_period  # untouched maps keep the default
    # The tenancy split follows the label.
    selectors = [e for w in webhooks(docs) for e in w.get("namespaceSelector", {}).get("matchExpressions", [])]
    assert {(e["key"], tuple(e["values"])) for e in selectors if "tenancy" in e["key"]} == {
        ("example.com/tenancy", ("single",))
    }
    # A new policy rolls the webhook pods.
    old = one(render(helm), "Deployment", "scrubgate-webhook")["spec"]["template"]["metadata"]["annotations"]
    new = one(docs, "Deployment", "scrubgate-webhook")["spec"]["template"]["metadata"]["annotations"]
    assert old["checksum/policy"] != new["checksum/policy"]


def test_webhook_values(helm: str, tmp_path: Path):
    client_ca = tmp_path / "client-ca.crt"
    client_ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    assert not [d for d in render(helm) if d["metadata"]["name"] == "scrubgate-webhook-client-ca"]
    docs = render(
        helm,
        "--set-file",
        f"webhook.clientCA={client_ca}",
        "--set",
        "webhook.replicas=3,webhook.resources.limits.memory=1Gi,webhook.audit.signingKeySecret=audit-key,"
        "webhook.audit.checkpointIntervalSeconds=30,webhook.audit.maxBytes=4096,webhook.audit.backups=3",
    )
    deployment = one(docs, "Deployment", "scrubgate-webhook")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert deployment["spec"]["replicas"] == 3 and container["resources"]["limits"] == {"memory": "1Gi"}
    args = container["args"]

    def arg(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert arg("--audit-signing-key") == "/etc/scrubgate/audit-key/ed25519.pem"
    assert (arg("--audit-checkpoint-interval"), arg("--audit-max-bytes"), arg("--audit-backups")) == ("30", "4096", "3")
    assert one(docs, "ConfigMap", "scrubgate-webhook-client-ca")["data"] == {"ca.crt": client_ca.read_text()}
    client_volume = next(v for v in pod["volumes"] if v["name"] == "client-ca")
    assert client_volume["configMap"]["name"] == "scrubgate-webhook-client-ca"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "audit-key")
    assert "/etc/scrubgate/audit-key/ed25519.pem".startswith(mount["mountPath"])
    assert next(v for v in pod["volumes"] if v["name"] == "audit-key")["secret"]["secretName"] == "audit-key"
    assert args.count("--audit-log") == 1


def test_agent_values(helm: str):
    docs = render(
        helm,
        "--set",
        "agent.runtimeClassName=,agent.gpuBackend=simulated,agent.simulatedRoot=/var/lib/sim-gpus,"
        "agent.signingKeySecret=other-key,"
        "agent.nodeSelector.gpu=yes,agent.extraTolerations[0].key=dedicated,agent.extraTolerations[0].operator=Exists",
    )
    base_pod = one(render(helm), "DaemonSet", "scrubgate-agent")["spec"]["template"]["spec"]
    pod = one(docs, "DaemonSet", "scrubgate-agent")["spec"]["template"]["spec"]
    assert "runtimeClassName" not in pod and base_pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"gpu": "yes"}  # replaces the GPU label, not merged with it
    assert pod["tolerations"] == [*base_pod["tolerations"], {"key": "dedicated", "operator": "Exists"}]
    container = pod["containers"][0]
    assert container["args"][container["args"].index("--gpu-backend") + 1] == "simulated"
    # The simulated GPUs' state is the node's: the agent reads it where it is.
    assert container["args"][container["args"].index("--simulated-root") + 1] == "/var/lib/sim-gpus"
    assert {"name": "simulated-gpus", "mountPath": "/var/lib/sim-gpus"} in container["volumeMounts"]
    assert {"name": "simulated-gpus", "hostPath": {"path": "/var/lib/sim-gpus", "type": "Directory"}} in pod["volumes"]
    assert "--simulated-root" not in base_pod["containers"][0]["args"]
    assert {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v} == {"other-key"}
    key_id = next(e for e in container["env"] if e["name"] == "KEY_ID")
    assert key_id["valueFrom"]["secretKeyRef"]["name"] == "other-key"


def test_reports_and_metrics_toggles(helm: str, default: list[Doc]):
    reports = one(default, "Deployment", "scrubgate-reports")
    args = reports["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:1] == ["reports"] and args[args.index("--interval") + 1] == "5m"
    docs = render(helm, "--set", "reports.enabled=false,metrics.enabled=true")
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", "scrubgate-reports") not in names and ("ClusterRole", "scrubgate-reports") not in names
    assert {
        ("PodMonitor", "scrubgate-agent"),
        ("PodMonitor", "scrubgate-webhook"),
        ("PrometheusRule", "scrubgate"),
    } <= names
    dashboard = one(docs, "ConfigMap", "scrubgate-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["scrubgate.json"] == (REPO / "dashboards" / "scrubgate.json").read_text()


def test_local_values_call_a_host_process(helm: str, tmp_path: Path):
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    docs = render(
        helm,
        "-f",
        str(CHART / "values-local.yaml"),
        "--set",
        "webhook.url=https://10.0.0.1:9443/",
        "--set-file",
        f"certs.provided.caBundle={ca}",
    )
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"Deployment", "DaemonSet", "Service", "PodDisruptionBudget", "Secret"}
    urls = {w["clientConfig"]["url"] for w in webhooks(docs)}
    assert urls == {
        "https://10.0.0.1:9443/validate",
        "https://10.0.0.1:9443/validate/trusted",
        "https://10.0.0.1:9443/mutate",
    }
    assert all("service" not in w["clientConfig"] for w in webhooks(docs))


# --- tools/build-go-tool.sh -------------------------------------------------------------------------


def helm_version() -> str:
    gomod = (REPO / "tools" / "helm" / "go.mod").read_text()
    return next(line.split()[1] for line in gomod.splitlines() if line.strip().startswith("helm.sh/helm/v4 "))


def test_build_helm_reuses_its_cache(tmp_path: Path):
    cached = tmp_path / "helm" / helm_version() / "helm"
    cached.parent.mkdir(parents=True)
    cached.write_text("#!/bin/sh\n")
    cached.chmod(0o755)
    result = subprocess.run(
        [str(REPO / "tools" / "build-go-tool.sh"), "helm"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin", "SCRUBGATE_CACHE": str(tmp_path)},  # no Go: nothing may be built
    )
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, str(cached), "")


def test_build_helm_without_go_says_what_to_do(tmp_path: Path):
    result = subprocess.run(
        [str(REPO / "tools" / "build-go-tool.sh"), "helm"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin", "SCRUBGATE_CACHE": str(tmp_path)},
    )
    assert result.returncode == 1 and result.stdout == ""
    assert "'go' is not on PATH" in result.stderr and "https://go.dev/doc/install" in result.stderr


def test_the_packaged_chart_renders_the_same(helm: str, default: list[Doc], tmp_path: Path):
    """`helm package` copies what the links under files/ point at: the archive needs no checkout."""
    result = subprocess.run(
        [helm, "package", str(CHART), "-d", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    archive = tmp_path / f"scrubgate-{__version__}.tgz"
    packaged = render(helm, "--include-crds", chart=archive)

    def without_certificate(docs: list[Doc]) -> list[Doc]:
        return [comparable(d) for d in docs if d["kind"] != "Secret"]

    assert without_certificate(packaged) == without_certificate(default)


def test_helm_uninstall_first_runs_scrubgate_uninstall_with_the_rights_it_uses(helm: str, default: list[Doc]):
    """The pre-delete hook: its Job runs `scrubgate uninstall` in the release's namespace within the hook's
    deadline; its identity and rights are hooks made before it; they allow every call the command makes (run
    against the stand-in API server of test_uninstall.py), and no more kinds than those."""
    from test_uninstall import FakeApi, claim, webhook

    from scrubgate.uninstall import uninstall

    docs = render(helm, "-n", "gpu-guard")
    job = one(docs, "Job", "scrubgate-uninstall")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["scrubgate"]
    assert container["args"] == ["uninstall", "--namespace", "gpu-guard", "--timeout", "240"]
    assert job["spec"]["activeDeadlineSeconds"] > 240 and job["spec"]["backoffLimit"] == 0
    hooks = [d for d in docs if (d["metadata"].get("annotations") or {}).get("helm.sh/hook") == "pre-delete"]
    for doc in hooks:
        if doc["kind"] != "Job":
            assert int(doc["metadata"]["annotations"]["helm.sh/hook-weight"]) < 0, doc["kind"]

    cluster_rules = one(docs, "ClusterRole", "scrubgate-uninstall")["rules"]
    namespace_rules = one(docs, "Role", "scrubgate-uninstall")["rules"]
    api = FakeApi()
    webhook(api)
    api.objects["/api/v1/pods"]["p"] = {"metadata": {"uid": "p"}, "status": {"phase": "Running"}}
    api.objects["/apis/resource.k8s.io/v1/resourceclaims"]["busy"] = claim("busy", reserved=("p",), held=True)
    assert uninstall(api, "scrubgate-system", 5, sleep=lambda _: None) == 0
    assert ("PUT", "/apis/resource.k8s.io/v1/namespaces/team/resourceclaims/busy/status") in api.calls
    for method, path in set(api.calls):
        parts = path.strip("/").split("/")
        if len(parts) <= 2:
            continue  # API discovery: every authenticated user may read it
        group = "" if parts[0] == "api" else parts[1]
        rest = parts[2:] if parts[0] == "api" else parts[3:]
        namespaced = rest[0] == "namespaces"
        rest = rest[2:] if namespaced else rest
        resource, name = rest[0], rest[1] if len(rest) > 1 else None
        if len(rest) > 2:
            resource = f"{resource}/{rest[2]}"  # a subresource: the agent's hold is in the claim's status
        verb = {"GET": "get" if name else "list", "PUT": "update", "DELETE": "delete"}[method]
        rules = [*cluster_rules, *(namespace_rules if namespaced else [])]
        assert any(
            group in r["apiGroups"]
            and resource in r["resources"]
            and verb in r["verbs"]
            and (name is None or name in r.get("resourceNames", [name]))
            for r in rules
        ), f"{method} {path}: no rule allows {verb} {group}/{resource}"
    manual = render(helm, "--set", "uninstall.waitForTeardowns=false")
    assert not [d for d in manual if d["metadata"]["name"] == "scrubgate-uninstall"], "the manual order (operations.md)"


def test_the_webhooks_skip_only_the_claims_of_the_policys_excluded_classes(helm: str):
    """A claim naming only classes the policy leaves out (and asking for no admin access or toleration) never
    waits on scrubgate; every other claim does, whatever its class is called. The policy's excludeDeviceClasses
    reach every webhook's claim condition, the mutating one's too; the agent's identity is the release's."""
    docs = render(helm, "--set", "policy.excludeDeviceClasses={nic.example.com,imex.nvidia.com}", "-n", "gpu-guard")
    hooks = webhooks(docs)
    assert len(hooks) == 4
    for hook in hooks:
        (condition,) = [c for c in hook["matchConditions"] if c["name"] == "claim-may-hold-a-gpu-or-asks-for-access"]
        assert condition["expression"].count("['nic.example.com', 'imex.nvidia.com']") == 3, hook["name"]
        for other in hook["matchConditions"]:
            assert "scrubgate-system" not in other["expression"], (hook["name"], other["name"])


def test_the_agents_the_webhook_and_the_controller_have_their_priority_level(default: list[Doc]):
    """API Priority and Fairness: the base's FlowSchema and PriorityLevelConfiguration (manifests/flowcontrol.yaml,
    tests/test_flowcontrol.py) are cluster-scoped objects of the chart, naming the release's ServiceAccounts."""
    schema = one(default, "FlowSchema", "scrubgate")
    level = one(default, "PriorityLevelConfiguration", schema["spec"]["priorityLevelConfiguration"]["name"])
    assert "namespace" not in schema["metadata"] and "namespace" not in level["metadata"]
    accounts = {s["serviceAccount"]["name"] for r in schema["spec"]["rules"] for s in r["subjects"]}
    agent = one(default, "DaemonSet", "scrubgate-agent")["spec"]["template"]["spec"]["serviceAccountName"]
    webhook = one(default, "Deployment", "scrubgate-webhook")["spec"]["template"]["spec"]["serviceAccountName"]
    controller = one(default, "Deployment", "scrubgate-controller")["spec"]["template"]["spec"]["serviceAccountName"]
    assert accounts == {agent, webhook, controller}
