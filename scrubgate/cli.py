"""The `scrubgate` command: check (CI), webhook, agent, controller, certs, audit."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from . import __version__

if TYPE_CHECKING:
    from scrubgate.policies.config import PolicyConfig

    from .check import CheckResult

FORMATS = ("text", "json", "sarif", "junit", "policyreport")

# The optional extras (pyproject.toml), by the top-level modules their packages bring: `pip install scrubgate`
# is `check` for a pipeline; a command that needs more says which extra to install instead of a traceback.
EXTRA_OF_MODULE = {
    # the webhook, the agent, and the commands that talk to a cluster (check --cluster, reports, uninstall)
    "httptools": "server",
    "uvloop": "server",
    "prometheus_client": "server",
    "kubernetes": "server",
    "urllib3": "server",
    # the agent's GPU backend
    "pynvml": "gpu",
    "cuda": "gpu",
}


def _tenancy(value: str) -> tuple[str, bool]:
    namespace, sep, tenancy = value.partition("=")
    if not sep or not namespace or tenancy not in ("trusted", "multi-tenant"):
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAMESPACE=trusted or NAMESPACE=multi-tenant")
    return namespace, tenancy == "trusted"


def _add_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="check manifests against the policy (CI dry-run)",
        description="Check Kubernetes manifests against scrubgate's rules. Exit 0: no deny finding; "
        "1: a deny finding; 2: unreadable input or bad usage.",
    )
    p.add_argument("paths", nargs="*", default=["-"], metavar="PATH", help="files, directories, or - for stdin")
    p.add_argument("--policy", help="policy file (default: the shipped policies/default.yaml)")
    p.add_argument("--format", choices=FORMATS, default="text")
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="directories not to walk into, by name or path (repeatable; .git, .venv, venv, node_modules and "
        "other tool directories are never walked)",
    )
    p.add_argument("--fix", action="store_true", help="print the documents with the mechanical fixes applied")
    p.add_argument("--in-place", action="store_true", help="with --fix: rewrite the files instead of printing")
    p.add_argument(
        "--namespace-tenancy",
        action="append",
        type=_tenancy,
        default=[],
        metavar="NS=trusted",
        help="treat a namespace as trusted (single-tenant) or multi-tenant; repeatable",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="check the objects already in the cluster (read-only list calls) instead of files",
    )
    p.add_argument("--kubeconfig", help="with --cluster: kubeconfig file (default: KUBECONFIG or ~/.kube/config)")
    p.add_argument("--context", help="with --cluster: kubeconfig context (default: the current one)")
    p.add_argument(
        "--fail-if-no-objects-found",
        action="store_true",
        help="exit 2 when the PATHs hold no Kubernetes object (without it: a warning on stderr)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress on stderr once reading takes over a few seconds (default: when stderr is a terminal)",
    )
    p.set_defaults(handler=run_check_command)


def run_check_command(args: argparse.Namespace) -> int:
    from scrubgate.policies.config import PolicyError, load_policy

    from .report import build_report, render_json, render_junit, render_sarif, render_text

    if args.in_place and not args.fix:
        print("scrubgate check: --in-place needs --fix", file=sys.stderr)
        return 2
    if args.in_place and "-" in args.paths:
        print("scrubgate check: --fix --in-place cannot rewrite stdin; drop --in-place", file=sys.stderr)
        return 2
    if args.cluster and (args.fix or args.paths != ["-"]):
        print("scrubgate check: --cluster reads the cluster only: drop the PATHs and --fix", file=sys.stderr)
        return 2
    if not args.cluster and (args.kubeconfig or args.context):
        print("scrubgate check: --kubeconfig and --context go with --cluster", file=sys.stderr)
        return 2
    if args.cluster and args.fail_if_no_objects_found:
        print("scrubgate check: --fail-if-no-objects-found goes with PATHs, not --cluster", file=sys.stderr)
        return 2
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(f"scrubgate check: {exc}", file=sys.stderr)
        return 2
    if args.cluster:
        from .cluster import ApiError, KubeApi, check_cluster

        try:
            result, notes = check_cluster(
                KubeApi.connect(args.kubeconfig, args.context), policy, dict(args.namespace_tenancy)
            )
        except ApiError as exc:
            print(f"scrubgate check: {exc}", file=sys.stderr)
            return 2
        for note in notes:
            print(f"scrubgate check: note: {note}", file=sys.stderr)
    else:
        result = _check_paths(args, policy)
    report = build_report(result)
    out = sys.stdout
    if args.fix:
        from .fix import fix_all

        stream, fixed, problems = fix_all(result.objects, in_place=args.in_place)
        # The patched documents own stdout; the report goes to stderr so that `--fix > fixed.yaml` works.
        out = sys.stderr
        if not args.in_place:
            sys.stdout.write(stream)
        for problem in problems:
            print(f"scrubgate check: {problem}", file=sys.stderr)
        print(f"scrubgate check: fixed {fixed} finding(s)", file=sys.stderr)
        report = build_report(result)
    if args.format == "json":
        rendered = render_json(report)
    elif args.format == "sarif":
        rendered = render_sarif(report)
    elif args.format == "policyreport":
        from .policyreport import render_policyreport

        rendered = render_policyreport(result)
    elif args.format == "junit":
        rendered = render_junit(result, report)
    else:
        color = out.isatty() and "NO_COLOR" not in os.environ
        rendered = render_text(report, color)
    try:
        print(rendered, file=out)
        out.flush()
    except BrokenPipeError:  # `scrubgate check ... | head`: the reader has what it wanted; the verdict stands
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
    return result.exit_code


def _check_paths(args: argparse.Namespace, policy: PolicyConfig) -> CheckResult:
    """`check` of files, directories and stdin, with its notes on stderr."""
    from .check import Progress, run_check
    from .sources import STDIN

    typed = STDIN in args.paths and sys.stdin.isatty()
    if typed:
        # `scrubgate check` alone reads stdin: say so, rather than wait in silence.
        print(
            "scrubgate check: reading manifests from standard input (end with Ctrl-D); to check files, "
            "name them or a directory: scrubgate check .",
            file=sys.stderr,
        )
    progress = None
    if args.progress or (args.progress is None and sys.stderr.isatty() and not typed):  # no clock while one types
        progress = Progress(sys.stderr, terminal=sys.stderr.isatty())
    result = run_check(
        args.paths,
        policy,
        dict(args.namespace_tenancy),
        tuple(args.exclude),
        require_objects=args.fail_if_no_objects_found,
        progress=progress,
    )
    if result.templates:
        print(
            f"scrubgate check: note: left out Helm chart templates ({', '.join(result.templates)}): they are Go "
            "templates, not manifests; check what they render: helm template CHART | scrubgate check -",
            file=sys.stderr,
        )
    for link, same in result.repeats:
        print(f"scrubgate check: note: not read twice: {link} is {same}, read already", file=sys.stderr)
    if not result.kubernetes_objects and not result.errors:
        print(
            f"scrubgate check: warning: no Kubernetes object in {' '.join(args.paths)}: nothing was checked "
            "(directories are searched for *.yaml, *.yml and *.json; a document needs apiVersion and kind); "
            "--fail-if-no-objects-found makes this an error",
            file=sys.stderr,
        )
    return result


def _add_component(sub: argparse._SubParsersAction, name: str, help_text: str, module: str, add: str, run: str) -> None:
    """Subcommands whose code lives in another package; only their argument definitions load at startup."""
    import importlib

    mod = importlib.import_module(module)
    p = sub.add_parser(name, help=help_text)
    getattr(mod, add)(p)
    runner: Callable[[argparse.Namespace], int] = getattr(mod, run)
    p.set_defaults(handler=runner)


COMPONENTS = (
    ("webhook", "run the admission webhook server", "scrubgate.webhook.cli", "add_arguments", "run"),
    ("agent", "run or inspect the node agent", "scrubgate.sanitizer_agent.cli", "add_arguments", "run"),
    (
        "controller",
        "label claims no node agent saw with their node; release claims deleted before allocation (leader-elected)",
        "scrubgate.sanitizer_agent.controller_cli",
        "add_arguments",
        "run",
    ),
    ("certs", "generate the webhook's CA and serving certificate", "scrubgate.certs.cli", "add_arguments", "run"),
    ("audit", "verify the audit log's hash chain", "scrubgate.webhook.cli", "add_audit_arguments", "run_audit"),
    ("reports", "keep PolicyReports of the cluster's objects up to date", "scrubgate.reports", "add_arguments", "run"),
    (
        "uninstall",
        "remove scrubgate once no teardown is pending, leaving no fence and no claim held",
        "scrubgate.uninstall",
        "add_arguments",
        "run",
    ),
)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scrubgate", description=__doc__)
    parser.add_argument("--version", action="version", version=f"scrubgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_check(sub)
    # Load only the component named on the command line (all of them for --help), so `check` starts fast.
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text, module, add, run in COMPONENTS:
        if wanted in (None, name) or wanted not in {c[0] for c in COMPONENTS} | {"check"}:
            _add_component(sub, name, help_text, module, add, run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(argv).parse_args(argv)
        return args.handler(args)
    except ModuleNotFoundError as exc:
        extra = EXTRA_OF_MODULE.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        command = next((a for a in argv if not a.startswith("-")), "")
        if command == "check" and "--cluster" in argv:
            command += " --cluster"
        print(
            f"scrubgate {command}: needs the `{extra}` extra, which is not installed here (module {exc.name} is "
            f"missing): pip install 'scrubgate[{extra}]' (the container image has every extra)",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
