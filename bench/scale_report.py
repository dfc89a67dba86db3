"""bench/scale.py's figures: per-agent rates at production intervals, scrubgate's total extrapolated to every
node, the kubelets' periodic traffic beside it, and the bar.

Rates are per second of production time: the bench runs the agents' intervals shortened by a factor and counts
over a window shortened by the same factor, so that the counts of a window are those of `PRODUCTION_WINDOW_S`.

The kubelets' periodic traffic, from the kubelet's defaults in Kubernetes v1.37.2:
- a Lease renewal every 10 s: `NodeLeaseDurationSeconds` 40 (pkg/kubelet/apis/config/v1beta1/defaults.go:149-150)
  times `nodeLeaseRenewIntervalFraction` 0.25 (pkg/kubelet/kubelet.go:236-237, 1156); one PUT each, from the
  last lease it wrote, without a GET (k8s.io/component-helpers/apimachinery/lease/controller.go:156-178);
- a node status PATCH every 5 minutes when nothing changed: `NodeStatusReportFrequency` 5m
  (defaults.go:136-141); the status is computed every `NodeStatusUpdateFrequency` 10 s (defaults.go:146-147) from
  the kubelet's informer, not a GET (pkg/kubelet/kubelet_node_status.go:499-517).
Each returns one object. Its watches, re-opened every few minutes, are left out, as the agents' are counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

PRODUCTION_WINDOW_S = 600.0  # what one window of the bench stands for: 10 minutes
LEASE_RENEW_S = 40 * 0.25
NODE_STATUS_REPORT_S = 300.0
BAR = 1.25  # per-agent rates at the largest N over those at the smallest


def kubelet_requests_per_s(nodes: int) -> float:
    """The kubelets' periodic requests per second across `nodes` nodes (and as many objects returned)."""
    return nodes * (1 / LEASE_RENEW_S + 1 / NODE_STATUS_REPORT_S)


@dataclass
class Step:
    """One cluster size: the counts of one window."""

    nodes: int
    claims: int
    agents: dict[str, tuple[int, int]]  # per agent (client): requests, objects returned, in the window
    window_s: float = PRODUCTION_WINDOW_S  # how long the window lasted (the agents' intervals shortened to match)
    central: tuple[int, int] = (0, 0)  # the central component's, all its users together
    calls: Counter[str] = field(default_factory=Counter)  # the agents' requests by call, all agents together

    def per_agent(self) -> tuple[float, float]:
        """Mean requests/s and objects/s of one agent, per production second."""
        if not self.agents:
            return 0.0, 0.0
        requests = sum(r for r, _ in self.agents.values()) / len(self.agents)
        objects = sum(o for _, o in self.agents.values()) / len(self.agents)
        return requests / PRODUCTION_WINDOW_S, objects / PRODUCTION_WINDOW_S

    def central_rates(self) -> tuple[float, float]:
        """The central component's requests/s and objects/s, per second of the window itself: it runs at its own
        intervals (leader election renewals every 2 s), not shortened."""
        return self.central[0] / self.window_s, self.central[1] / self.window_s

    def total(self) -> tuple[float, float]:
        """scrubgate's requests/s and objects/s with an agent on every node, plus the central component."""
        (requests, objects), (central_requests, central_objects) = self.per_agent(), self.central_rates()
        return self.nodes * requests + central_requests, self.nodes * objects + central_objects


def table(steps: list[Step]) -> str:
    lines = [
        "| nodes | claims | per agent: requests/s | per agent: objects/s | central: requests/s, objects/s "
        "| scrubgate at N nodes: requests/s | scrubgate at N nodes: objects/s | kubelets' periodic requests/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for step in steps:
        (requests, objects), (c_requests, c_objects), (t_requests, t_objects) = (
            step.per_agent(),
            step.central_rates(),
            step.total(),
        )
        lines.append(
            f"| {step.nodes} | {step.claims} | {requests:.3f} | {objects:.2f} | {c_requests:.3f}, {c_objects:.2f} "
            f"| {t_requests:.1f} | {t_objects:.0f} | {kubelet_requests_per_s(step.nodes):.1f} |"
        )
    return "\n".join(lines)


def calls_table(steps: list[Step]) -> str:
    """One agent's requests per production window (10 minutes) by call, mean over the agents, per N."""
    calls = sorted({call for step in steps for call in step.calls})
    lines = [
        "| requests of one agent per 10 min | " + " | ".join(f"N={s.nodes}" for s in steps) + " |",
        "| --- |" + " ---: |" * len(steps),
    ]
    for call in calls:
        cells = [f"{s.calls[call] / max(len(s.agents), 1):.1f}" for s in steps]
        lines.append(f"| {call} | {' | '.join(cells)} |")
    return "\n".join(lines)


def bar(steps: list[Step]) -> tuple[bool, str]:
    """Whether per-agent requests/s and objects/s at the largest N are within BAR times those at the smallest."""
    if len(steps) < 2:
        return True, "bar: needs two cluster sizes (not judged)"
    small, large = min(steps, key=lambda s: s.nodes), max(steps, key=lambda s: s.nodes)
    ratios = [
        (b / a if a else (1.0 if not b else float("inf")))
        for a, b in zip(small.per_agent(), large.per_agent(), strict=True)
    ]
    met = all(round(r, 9) <= BAR for r in ratios)  # not failed by the last bit of a division
    return met, (
        f"bar: per-agent requests/s and objects/s at N={large.nodes} <= {BAR}x those at N={small.nodes}: "
        f"{ratios[0]:.2f}x and {ratios[1]:.2f}x ({'met' if met else 'NOT met'})"
    )
