"""Differential test of DeviceClass verdicts against the real control plane (issue 28, item 8).

A few hundred DeviceClasses generated from the DRA CEL grammar (tests/class_generator.py, fixed seed) and the
real classes of tests/data/deviceclasses/ are created on kube-apiserver, where scrubgate's webhook admits or
refuses each (SG009). kube-scheduler then allocates, for each class, every device it selects among devices
shaped as NVIDIA's driver publishes them (`gpu`, `mig` and `vfio`, cmd/gpu-kubelet-plugin/deviceinfo.go) and as
other drivers publish theirs (a NIC, IMEX channels, an Intel GPU): devcluster/fakenode.py, tests/scheduler_truth.py.
What it allocated is the ground truth; scrubgate's verdict (policies/selectors.py, policies/scope.py) and the
webhook's real answers are held to it:

- unsafe: a class that was allocated a `gpu` or `mig` device of a GPU driver is refused by SG009, or every claim
  of it got the sanitize finalizer from the webhook, its allocated GPU devices are guarded at deallocation
  (SG007), and in a multi-tenant namespace admin access (SG006) and a toleration of the fence (SG005) in a claim
  of it are refused. A class allocated any device of a GPU driver must not be "proven" unable to get one.
- needless: a class never allocated GPU memory is not refused, unless it is one SG009 refuses by design (an
  excluded name, or an unlisted extended resource, whose selectors do not prove their driver: the generator
  makes a few). The webhook's finalizer and SG009 agree with the model for every class.

The report (run with -s) gives the counts, the classes SG009 refuses by design and the phases' wall times.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import class_generator
import e2e_support
import pytest
from e2e_support import tenant_namespace
from kubernetes.client.exceptions import ApiException
from scheduler_truth import Scheduler, Truth, in_parallel
from scrubgate.policies import names, rules
from scrubgate.policies.config import PolicyConfig, parse_policy
from scrubgate.policies.scope import Scope, guarded_devices
from scrubgate.policies.selectors import MEMORY_TYPES, DeviceClasses, class_verdict
from test_policies_class_corpus import corpus

from devcluster import fakenode, workloads
from devcluster.harness import Cluster, wait_for
from devcluster.rest import status_message

cluster_factory_fixture = e2e_support.cluster_factory_fixture

SEED = 28
COUNT = 300
PROBE = "excluded-probe.diff.example.com"  # an excluded name: the policy reload is seen when SG009 refuses it
SENTINEL = "zz-sentinel.diff.example.com"  # created last: once the webhook knows it, it knows every class
ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"


@dataclass
class Case:
    label: str
    obj: dict[str, Any]
    generated: class_generator.Generated | None = None
    refused: str = ""  # SG009's message, as the API server returned it
    own: bool = False  # created under its own name: its claims show what the webhook does with them
    truth_name: str = ""  # the class kube-scheduler allocated for: itself, or a twin with its selectors
    tenant_problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.obj["metadata"]["name"]

    def describe(self) -> str:
        expressions = [s["cel"]["expression"] for s in self.obj["spec"].get("selectors") or []]
        extended = self.obj["spec"].get("extendedResourceName")
        return f"{self.label} {json.dumps(expressions)}" + (f" extendedResourceName={extended}" if extended else "")


def cases() -> list[Case]:
    generated = [Case(f"generated {g.name}", g.obj(), g) for g in class_generator.generate(SEED, COUNT)]
    real = [Case(f"corpus {stem}/{name}", obj) for (stem, name), obj in sorted(corpus().items())]
    return generated + real


def excluding(cluster: Cluster, extra: list[str]) -> PolicyConfig:
    """The policy with `extra` (and PROBE) in excludeDeviceClasses, once the webhook has loaded it."""
    data = cluster.policy()
    data["excludeDeviceClasses"] = [*data["excludeDeviceClasses"], *extra, PROBE]
    cluster.write_policy(data)
    probe = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": PROBE},
        "spec": {"selectors": [{"cel": {"expression": "has(device.attributes['gpu.nvidia.com'].productName)"}}]},
    }

    def refused() -> bool:
        try:
            cluster.request("POST", cluster.resource_path("deviceclasses"), probe, query=[("dryRun", "All")])
        except ApiException as exc:
            return "SG009" in (exc.body or "")
        return False

    wait_for(refused, 60, "the webhook enforcing the policy with the generated excluded names")
    return parse_policy(data)


def create_classes(cluster: Cluster, all_cases: list[Case]) -> None:
    """Each class under its own name where it is free; where it is taken, a dry-run replacement of the class
    of that name gets SG009's answer (it judges UPDATEs as it judges CREATEs). A refused or replacing class's
    selectors are created again under a twin name, for kube-scheduler to allocate."""
    existing = {c["metadata"]["name"] for c in cluster.request("GET", cluster.resource_path("deviceclasses"))["items"]}
    seen: set[str] = set()
    taken = []
    for case in all_cases:
        taken.append(case.name in existing or case.name in seen)
        seen.add(case.name)

    def create(case: Case, replace: bool) -> None:
        path = cluster.resource_path("deviceclasses", version=case.obj["apiVersion"].split("/")[1])
        try:
            if replace:
                current = cluster.request("GET", f"{path}/{case.name}")
                version = {"resourceVersion": current["metadata"]["resourceVersion"]}
                body = {**case.obj, "metadata": {**case.obj["metadata"], **version}}
                cluster.request("PUT", f"{path}/{case.name}", body, query=[("dryRun", "All")])
            else:
                cluster.request("POST", path, case.obj)
        except ApiException as exc:
            message = status_message(exc)
            if "SG009" not in message:
                raise AssertionError(f"the API server refused {case.describe()}: HTTP {exc.status} {message}") from exc
            case.refused = message
        case.own = not replace and not case.refused

    in_parallel(lambda item: create(*item), [(c, False) for c, t in zip(all_cases, taken, strict=True) if not t])
    in_parallel(lambda item: create(*item), [(c, True) for c, t in zip(all_cases, taken, strict=True) if t])
    twins = [case for case in all_cases if not case.own]
    for case in all_cases:
        case.truth_name = case.name
    for index, case in enumerate(twins):
        case.truth_name = f"twin-{index:03d}.diff.example.com"

    def create_twin(case: Case) -> None:
        spec = {"selectors": case.obj["spec"]["selectors"]}
        twin = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": case.truth_name}}
        cluster.request("POST", cluster.resource_path("deviceclasses"), {**twin, "spec": spec})

    in_parallel(create_twin, twins)


def wait_webhook_knows_classes(cluster: Cluster, namespace: str) -> None:
    sentinel = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": SENTINEL}}
    sentinel["spec"] = {"selectors": [{"cel": {"expression": "device.driver == 'dra.net'"}}]}
    cluster.request("POST", cluster.resource_path("deviceclasses"), sentinel)
    path = cluster.resource_path("resourceclaims", namespace)
    body = workloads.resource_claim("sentinel-probe", device_class=SENTINEL)

    def unguarded() -> bool:
        created = cluster.request("POST", path, body, query=[("dryRun", "All")])
        return names.FINALIZER not in (created["metadata"].get("finalizers") or [])

    wait_for(unguarded, 60, f"the webhook knowing DeviceClass {SENTINEL}")


def tenant_guards(cluster: Cluster, namespace: str, case: Case) -> None:
    """SG006 and SG005 in a multi-tenant namespace, on a claim of this class (dry runs, as tenant alice)."""
    path = cluster.resource_path("resourceclaims", namespace)
    toleration = [{"key": names.TAINT_UNSANITIZED, "operator": "Exists"}]
    for rule, request in (("SG006", {"admin_access": True}), ("SG005", {"tolerations": toleration})):
        body = workloads.resource_claim("probe", device_class=case.name, **request)
        try:
            cluster.request("POST", path, body, user="alice", query=[("dryRun", "All")])
        except ApiException as exc:
            if rule not in status_message(exc):
                case.tenant_problems.append(f"{rule}: refused otherwise (HTTP {exc.status}): {status_message(exc)}")
            continue
        case.tenant_problems.append(f"{rule}: a claim of it was admitted in a multi-tenant namespace")


def memory_devices(claim: dict[str, Any] | None, policy: PolicyConfig) -> set[tuple[str, str, str]]:
    """The allocated `gpu` and `mig` devices of GPU drivers, as (driver, pool, device)."""
    results = ((claim or {}).get("status") or {}).get("allocation", {}).get("devices", {}).get("results") or []
    return {
        (r["driver"], r["pool"], r["device"])
        for r in results
        if r["driver"] in policy.gpu_drivers
        and getattr(fakenode.shape_of(r["driver"], r["device"]), "type", None) in MEMORY_TYPES
    }


def judge(case: Case, truth: Truth, policy: PolicyConfig, scope: Scope) -> list[str]:
    """What is wrong with scrubgate's handling of this class, given what kube-scheduler allocated for it."""
    verdict = class_verdict(case.obj, policy.gpu_drivers)
    name = case.name
    gpu_got = {v for d in policy.gpu_drivers for v in truth.got(d)}
    memory_got = {v for d in policy.gpu_drivers for v in truth.got(d, MEMORY_TYPES)}
    found = []
    if bool(rules.gpu_class_coverage(case.obj, scope)) != bool(case.refused):
        found.append(f"SG009 on the API server ({case.refused or 'admitted'}) differs from the model")
    if gpu_got and not verdict.gpu:
        found.append(f"UNSOUND: allocated {sorted(gpu_got)}, yet its selectors 'prove' no device of a GPU driver")
    if memory_got and not verdict.gpu_memory:
        found.append(f"UNSOUND: allocated {sorted(memory_got)}, yet its selectors 'prove' no GPU memory")
    if case.generated is not None and (verdict.gpu, verdict.gpu_memory) != case.generated.proves(policy.gpu_drivers):
        found.append(
            f"read as {(verdict.gpu, verdict.gpu_memory)}, built as {case.generated.proves(policy.gpu_drivers)}"
        )
    if case.own:
        guarded = scope.is_gpu_class(name)
        if memory_got and not guarded:
            found.append(f"UNGUARDED: allocated {sorted(memory_got)}, and its claims skip every guard")
        for outcome in truth.claims:
            claim = outcome.created["metadata"]["name"]
            if (names.FINALIZER in (outcome.created["metadata"].get("finalizers") or [])) != guarded:
                found.append(f"claim {claim}: the webhook's finalizer differs from the model (guarded={guarded})")
            memory = memory_devices(outcome.allocated, policy)
            if outcome.allocated is not None and memory - guarded_devices(outcome.allocated, scope):
                found.append(f"claim {claim}: SG007 would not guard {sorted(memory)} at deallocation")
        found += case.tenant_problems
    proven = not verdict.gpu_memory if policy.is_excluded_class(name) else not verdict.gpu
    if case.refused and not memory_got and proven and not policy.names_gpu_class(name):
        found.append("NEEDLESS: refused by SG009, though it proves it hands out no GPU memory and got none")
    return [f"{case.describe()}\n    {problem}\n    verdict: {verdict.why}; kube-scheduler allocated "
            f"{sorted(truth.matched) or 'nothing'}, errors on {sorted(truth.errors) or 'no device'}"
            for problem in found]  # fmt: skip


def allocated(truth: Truth, policy: PolicyConfig) -> str:
    """What kube-scheduler allocated for a class, in the terms of the verdict."""
    if any(truth.got(d, MEMORY_TYPES) for d in policy.gpu_drivers):
        return "gpu/mig"
    if any(truth.got(d) for d in policy.gpu_drivers):
        return "vfio only"
    return "other drivers' only" if truth.matched else "nothing"


def handled(case: Case, scope: Scope) -> str:
    """What scrubgate does with a class: refuses it (SG009), guards its claims, or lets them by."""
    if case.refused:
        return "refused"
    return "guarded" if scope.is_gpu_class(case.name) else "unguarded"


def report(all_cases: list[Case], truths: dict[str, Truth], scope: Scope, phases: dict[str, float], units: int) -> str:
    """The differential table (scrubgate's handling x kube-scheduler's allocation), counts and wall times."""
    generated = sum(c.generated is not None for c in all_cases)
    lines = [f"classes: {len(all_cases)} ({generated} generated with seed {SEED}, {len(all_cases) - generated} real)"]
    table: dict[tuple[str, str], int] = {}
    for case in all_cases:
        key = (handled(case, scope), allocated(truths[case.truth_name], scope.policy))
        table[key] = table.get(key, 0) + 1
    columns = ("gpu/mig", "vfio only", "other drivers' only", "nothing")
    lines.append(f"{'':>10} | " + " | ".join(f"{c:>19}" for c in columns))
    for row in ("refused", "guarded", "unguarded"):
        lines.append(f"{row:>10} | " + " | ".join(f"{table.get((row, c), 0):>19}" for c in columns))
    lines.append(f"errors on some device: {sum(bool(truths[c.truth_name].errors) for c in all_cases)} classes")
    lines += [f"refused by design: {c.describe()}" for c in all_cases if c.refused]
    lines.append(f"nodes, claims and pods: {units} of each")
    lines.append("wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    return "\n".join(lines)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_device_class_verdicts_hold_against_kube_scheduler(
    cluster_factory: Callable[..., Cluster], request: pytest.FixtureRequest
) -> None:
    phases: dict[str, float] = {}
    mark = time.monotonic()

    def phase(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        phases[name] = now - mark
        mark = now

    all_cases = cases()
    cluster = cluster_factory(gpus=1, client_qps=200)
    policy = excluding(cluster, class_generator.excluded_names(c.generated for c in all_cases if c.generated))
    truth_ns = tenant_namespace(cluster, "truth", trusted=True)
    tenant_ns = tenant_namespace(cluster, "tenant", labels={ADMIN_ACCESS_LABEL: "true"})
    phase("start")
    create_classes(cluster, all_cases)
    wait_webhook_knows_classes(cluster, truth_ns)
    phase("classes")
    scheduler = Scheduler(cluster, truth_ns)
    truths = scheduler.truth(sorted({c.truth_name for c in all_cases}))
    phase("allocation")
    in_parallel(lambda case: tenant_guards(cluster, tenant_ns, case), [c for c in all_cases if c.own])
    phase("tenant guards")
    known = cluster.request("GET", cluster.resource_path("deviceclasses"))["items"]
    scope = Scope(policy, DeviceClasses.of(known, policy.gpu_drivers))
    problems = [p for case in all_cases for p in judge(case, truths[case.truth_name], policy, scope)]
    summary = report(all_cases, truths, scope, phases, scheduler.units)
    print(summary)
    request.node.add_report_section("call", "differential", summary)
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)
