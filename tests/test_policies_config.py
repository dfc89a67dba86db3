"""The policy file: the shipped default, and bad files refused with the field path and the reason."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scrubgate.policies import names
from scrubgate.policies.attestation import public_key_pem
from scrubgate.policies.config import DEFAULT_POLICY_PATH, PolicyError, load_policy, parse_policy
from scrubgate.policies.rules_meta import RULES
from scrubgate.policies.scope import Scope
from scrubgate.policies.selectors import DeviceClasses


def test_default_policy_loads_with_the_documented_values():
    policy = load_policy()
    assert policy == load_policy(DEFAULT_POLICY_PATH)
    assert policy.gpu_device_classes == ("gpu.nvidia.com", "mig.nvidia.com", "*.gpu.nvidia.com")
    assert policy.exclude_device_classes == (
        "compute-domain-daemon.nvidia.com",
        "compute-domain-default-channel.nvidia.com",
        "imex.nvidia.com",
        "vfio.gpu.nvidia.com",
    )
    assert policy.gpu_drivers == ("gpu.nvidia.com",)
    assert policy.gpu_extended_resources == ("nvidia.com/gpu", "nvidia.com/mig-*")
    assert (policy.grace_period.minimum_seconds, policy.grace_period.default_seconds) == (30, 60)
    assert policy.grace_period.maximum_seconds == 3600
    assert policy.tenancy.label == names.TENANCY_LABEL and policy.tenancy.trusted_value == names.TENANCY_TRUSTED
    assert {rule: policy.action(rule) for rule in RULES} == {
        "SG001": "deny",
        "SG002": "deny",
        "SG003": "deny",
        "SG004": "warn",
        "SG005": "deny",
        "SG006": "deny",
        "SG007": "deny",
        "SG008": "deny",
        "SG009": "deny",
        "SG010": "deny",
    }
    assert policy.agent.identities == ("system:serviceaccount:scrubgate-system:scrubgate-agent",)
    assert policy.admin_groups == ("system:masters",)
    assert policy.attestation_keys == () and policy.public_keys == {}
    assert policy.digest.startswith("sha256:") and len(policy.digest) == 7 + 64


def test_rule_table_matches_the_design():
    assert {rule.id: rule.name for rule in RULES.values()} == {
        "SG001": "retain-deallocation",
        "SG002": "shared-claim",
        "SG003": "grace-period",
        "SG004": "claim-finalizer",
        "SG005": "fence-toleration",
        "SG006": "admin-access",
        "SG007": "finalizer-guard",
        "SG008": "force-delete",
        "SG009": "gpu-class-coverage",
        "SG010": "tenancy-label",
    }
    assert all(rule.summary and rule.help for rule in RULES.values())


NVIDIA_CLASSES = [
    {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }
    for name, expression in [
        ("gpu.nvidia.com", "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"),
        ("mig.nvidia.com", "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"),
        (
            "vfio.gpu.nvidia.com",
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'vfio'",
        ),
        ("compute-domain-daemon.nvidia.com", "device.driver == 'compute-domain.nvidia.com'"),
        ("compute-domain-default-channel.nvidia.com", "device.driver == 'compute-domain.nvidia.com'"),
    ]
]


@pytest.mark.parametrize(
    ("device_class", "in_scope"),
    [
        ("gpu.nvidia.com", True),
        ("mig.nvidia.com", True),
        ("mig-1g-12gb.gpu.nvidia.com", True),  # not among the known classes: guarded
        ("compute-domain-default-channel.nvidia.com", False),
        ("compute-domain-daemon.nvidia.com", False),
        ("vfio.gpu.nvidia.com", False),
        ("h100-80gb", True),
    ],
)
def test_the_default_policy_leaves_out_only_what_no_agent_scrubs(device_class, in_scope):
    scope = Scope(load_policy(), DeviceClasses.of(NVIDIA_CLASSES, ["gpu.nvidia.com"]))
    assert scope.is_gpu_class(device_class) is in_scope


def test_an_excluded_class_is_left_out_only_when_its_selectors_agree():
    """An excluded name that is not known, or whose selectors do not prove it hands out no GPU memory, is guarded;
    gpuDeviceClasses can add to the guard, never take from it."""
    policy = parse_policy({"gpuDeviceClasses": ["*.nvidia.com"]})
    assert not Scope(policy).is_gpu_class("vfio.gpu.nvidia.com"), "no such class: nothing comes through it"
    known = DeviceClasses.of(NVIDIA_CLASSES, ["gpu.nvidia.com"])
    assert not Scope(policy, known).is_gpu_class("vfio.gpu.nvidia.com")
    assert Scope(parse_policy({"excludeDeviceClasses": []}), known).is_gpu_class("vfio.gpu.nvidia.com")
    wide = DeviceClasses.of([{**NVIDIA_CLASSES[0], "metadata": {"name": "vfio.gpu.nvidia.com"}}], ["gpu.nvidia.com"])
    assert Scope(policy, wide).is_gpu_class("vfio.gpu.nvidia.com")


@pytest.mark.parametrize(
    ("name", "gpu"),
    [
        ("nvidia.com/gpu", True),
        ("nvidia.com/mig-1g.10gb", True),
        ("deviceclass.resource.kubernetes.io/gpu.nvidia.com", True),
        ("deviceclass.resource.kubernetes.io/vfio.gpu.nvidia.com", False),
        ("deviceclass.resource.kubernetes.io/nic.example.com", True),  # unknown class
        ("example.com/fpga", False),
    ],
)
def test_gpu_extended_resources(name, gpu):
    scope = Scope(load_policy(), DeviceClasses.of(NVIDIA_CLASSES, ["gpu.nvidia.com"]))
    assert scope.is_gpu_extended_resource(name) is gpu


def test_a_known_gpu_classs_extended_resource_is_a_gpu_resource_under_any_name():
    h100 = {**NVIDIA_CLASSES[0], "metadata": {"name": "h100"}, "spec": {"extendedResourceName": "example.com/h100"}}
    scope = Scope(load_policy(), DeviceClasses.of([h100], ["gpu.nvidia.com"]))
    assert scope.is_gpu_extended_resource("example.com/h100")
    assert not Scope(load_policy()).is_gpu_extended_resource("example.com/h100")


def test_empty_policy_is_the_built_in_default():
    for data in (None, {}):
        policy = parse_policy(data)
        assert {rule: policy.action(rule) for rule in RULES} == {r.id: r.default_action for r in RULES.values()}


def test_attestation_keys_are_loaded_by_key_id():
    key = Ed25519PrivateKey.generate()
    policy = parse_policy({"attestationKeys": [{"kid": "k1", "publicKey": public_key_pem(key)}]})
    assert list(policy.public_keys) == ["k1"]
    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    assert policy.public_keys["k1"].public_bytes(*raw) == key.public_key().public_bytes(*raw)


def test_policy_digest_changes_with_the_policy():
    assert parse_policy({}).digest == parse_policy({}).digest
    assert parse_policy({}).digest != parse_policy({"adminGroups": ["ops"]}).digest


@pytest.mark.parametrize(
    ("data", "path", "reason"),
    [
        ({"gracePeriod": {"minimumSeconds": "soon"}}, "gracePeriod.minimumSeconds", "integer"),
        ({"gracePeriod": {"minimumSeconds": -1}}, "gracePeriod.minimumSeconds", "greater than or equal to 0"),
        ({"gpuDeviceClasses": "gpu.nvidia.com"}, "gpuDeviceClasses", "tuple"),
        ({"adminGroups": [["system:masters"]]}, "adminGroups.0", "string"),
        ({"gpuClasses": ["x"]}, "gpuClasses", "Extra inputs are not permitted"),
        ({"tenancy": {"trustedNamespace": ["a"]}}, "tenancy.trustedNamespace", "Extra inputs are not permitted"),
        ({"rules": {"SG999": {"action": "deny"}}}, "rules", "SG999"),
        ({"rules": {"SG001": {"action": "block"}}}, "rules.SG001.action", "'deny', 'warn', 'audit' or 'off'"),
        ({"rules": {"SG001": "deny"}}, "rules.SG001", "dictionary"),
        (
            {"gracePeriod": {"minimumSeconds": 90, "defaultSeconds": 60}},
            "gracePeriod",
            "minimumSeconds <= defaultSeconds",
        ),
        (
            {"gracePeriod": {"defaultSeconds": 60, "maximumSeconds": 30}},
            "gracePeriod",
            "defaultSeconds <= maximumSeconds",
        ),
        ({"attestationKeys": [{"kid": "k", "publicKey": "not a pem"}]}, "attestationKeys.0.publicKey", ""),
        ({"attestationKeys": [{"kid": "", "publicKey": "x"}]}, "attestationKeys.0.kid", "at least 1 character"),
        ({"apiVersion": "scrubgate.dev/v2"}, "apiVersion", "scrubgate.dev/v1"),
        ({"kind": "Policy"}, "kind", "PolicyConfig"),
    ],
)
def test_bad_policy_is_refused_with_field_path_and_reason(data, path, reason):
    with pytest.raises(PolicyError) as err:
        parse_policy(data, "team.yaml")
    message = str(err.value)
    assert message.startswith("team.yaml: invalid policy: ")
    assert f"{path}: " in message
    assert reason in message


def test_non_ed25519_key_is_refused():
    ec_pem = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    with pytest.raises(PolicyError, match=r"attestationKeys\.0\.publicKey: .*not an Ed25519 key"):
        parse_policy({"attestationKeys": [{"kid": "k", "publicKey": ec_pem}]})


@pytest.mark.parametrize("data", [["a"], "deny", 3])
def test_policy_that_is_not_a_mapping_is_refused(data):
    with pytest.raises(PolicyError, match="must be a YAML mapping"):
        parse_policy(data, "p.yaml")


def test_invalid_yaml_is_refused_with_its_line(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("apiVersion: scrubgate.dev/v1\nrules:\n  SG001: {action: deny\nadminGroups: []\n")
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    assert str(err.value).startswith(f"{path}:4: the policy is not valid YAML")


def test_missing_policy_file_is_refused(tmp_path):
    with pytest.raises(PolicyError, match="cannot read the policy file"):
        load_policy(tmp_path / "nope.yaml")


def test_policy_file_errors_name_the_file(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("gracePeriod:\n  minimumSeconds: 120\n")
    with pytest.raises(PolicyError, match=rf"^{path}: invalid policy: gracePeriod: "):
        load_policy(path)


def test_unquoted_off_is_never_silently_another_action(tmp_path):
    # YAML 1.1 reads an unquoted `off` as the boolean false: it must be refused or mean off, nothing else.
    path = tmp_path / "policy.yaml"
    path.write_text("rules:\n  SG003: {action: off}\n")
    try:
        policy = load_policy(path)
    except PolicyError as err:
        assert "rules.SG003.action" in str(err)
    else:
        assert policy.action("SG003") == "off"
    path.write_text("rules:\n  SG003: {action: 'off'}\n")
    assert load_policy(path).action("SG003") == "off"


def test_trusted_namespaces_and_agent_identities_from_the_file(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(
        "tenancy:\n  trustedNamespaces: [research]\n  label: example.com/tenancy\n"
        "agent:\n  identities: [system:serviceaccount:gpu:agent]\nadminGroups: [gpu-oncall]\n"
    )
    policy = load_policy(path)
    assert policy.tenancy.trusted_namespaces == ("research",)
    assert policy.tenancy.label == "example.com/tenancy"
    assert policy.agent.identities == ("system:serviceaccount:gpu:agent",)
    assert policy.admin_groups == ("gpu-oncall",)


def test_an_excluded_class_is_named_exactly_so_that_no_gpu_class_matching_a_glob_drops_out_of_scope():
    """A GPU class whose name happens to look like an excluded family (here, a model class named after the
    ComputeDomain it serves) stays a GPU class; a glob in excludeDeviceClasses is refused, naming it."""
    scope = Scope(load_policy(), DeviceClasses.of(NVIDIA_CLASSES, ["gpu.nvidia.com"]))
    assert scope.is_gpu_class("compute-domain-h100.gpu.nvidia.com")
    assert not scope.is_gpu_class("vfio.gpu.nvidia.com")
    with pytest.raises(PolicyError, match=r"excludeDeviceClasses: .*'compute-domain-\*\.nvidia\.com': a glob"):
        parse_policy({"excludeDeviceClasses": ["compute-domain-*.nvidia.com"]})
