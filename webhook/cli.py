"""`scrubgate webhook` and `scrubgate audit verify`. Argument setup imports nothing heavy, so that
`scrubgate check` starts fast; the server (uvloop, httptools) loads only in `run`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import defaults

if TYPE_CHECKING:
    from .audit import VerifyResult
    from .audit_checkpoints import Finding


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", type=Path, required=True, help="serving certificate (PEM); reloaded on change")
    parser.add_argument("--tls-key", type=Path, required=True, help="its private key (PEM); reloaded on change")
    parser.add_argument("--port", type=int, default=defaults.PORT, help=f"HTTPS port (default {defaults.PORT})")
    parser.add_argument("--host", default=defaults.HOST, help=f"address to listen on (default {defaults.HOST})")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=defaults.METRICS_PORT,
        help=f"plain HTTP port of /metrics, /healthz and /readyz (default {defaults.METRICS_PORT}); the admission "
        "port serves no /metrics",
    )
    parser.add_argument("--policy", type=Path, help="policy file (default: the shipped policy); reloaded on change")
    parser.add_argument("--audit-log", type=Path, help="hash-chained JSON Lines audit log (default: the process log)")
    parser.add_argument(
        "--audit-max-bytes",
        type=int,
        default=defaults.AUDIT_MAX_BYTES,
        help=f"rotate the audit log at this size (default {defaults.AUDIT_MAX_BYTES})",
    )
    parser.add_argument(
        "--audit-backups",
        type=int,
        default=defaults.AUDIT_BACKUPS,
        help=f"rotated audit files to keep (default {defaults.AUDIT_BACKUPS})",
    )
    parser.add_argument(
        "--audit-signing-key",
        type=Path,
        help="the webhook's own Ed25519 private key (PEM): signed checkpoints of the audit chain head go to stdout",
    )
    parser.add_argument(
        "--audit-checkpoint-interval",
        type=float,
        default=defaults.AUDIT_CHECKPOINT_INTERVAL,
        help=f"seconds between checkpoints while records arrive (default {defaults.AUDIT_CHECKPOINT_INTERVAL:g})",
    )
    parser.add_argument(
        "--client-ca",
        type=Path,
        help="CA that signs the API server's client certificate; admission paths then require one, of an "
        "allowed name (--client-name)",
    )
    parser.add_argument(
        "--client-name",
        dest="client_names",
        action="append",
        metavar="NAME",
        help="with --client-ca: a subject CN or DNS name the API server's client certificate carries; repeatable "
        f"(default {', '.join(defaults.CLIENT_NAMES)})",
    )
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        help="kubeconfig for reading DeviceClasses (default: the pod's ServiceAccount; outside a pod without "
        "one, every claim is guarded as one that may hold a GPU)",
    )


def run(args: argparse.Namespace) -> int:
    from .server import Settings, serve

    return serve(
        Settings(
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            policy=args.policy,
            audit_log=args.audit_log,
            audit_max_bytes=args.audit_max_bytes,
            audit_backups=args.audit_backups,
            audit_signing_key=args.audit_signing_key,
            audit_checkpoint_interval=args.audit_checkpoint_interval,
            client_ca=args.client_ca,
            kubeconfig=args.kubeconfig,
            client_names=tuple(args.client_names) if args.client_names else None,
        )
    )


def add_audit_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="audit_action", required=True, metavar="ACTION")
    verify = actions.add_parser(
        "verify",
        help="recompute the hash chain and name the first altered, dropped or reordered record",
        description="Exit 0: intact; 1: broken (the first broken record is named, and every checkpoint the "
        "files contradict: truncated, rewritten, gaps); 2: a file or key cannot be read, or bad usage.",
    )
    verify.add_argument(
        "files", nargs="+", type=Path, metavar="FILE", help="audit log files (rotated files in any order)"
    )
    for flag, help_text in (
        (
            "--checkpoints",
            "the webhook's stdout (kubectl logs, or the log collector's copy) holding its signed checkpoints",
        ),
        (
            "--public-key",
            "the webhook's audit public key (PEM); needed with --checkpoints; repeatable across key rotation",
        ),
    ):
        verify.add_argument(flag, type=Path, action="append", default=[], metavar="F", help=help_text)
    verify.add_argument(
        "--stream",
        action="store_true",
        help="the FILEs are the webhook's stdout (kubectl logs, a log collector's copy): verify the records "
        "copied there, rotated-away ones included; their checkpoints are read too when --public-key is given",
    )
    verify.add_argument("--host", help="the pod whose records and checkpoints to use, where a stream holds several")


def _one_host(args: argparse.Namespace, streams: list[Path]) -> str | int | None:
    """The pod the stream entries must come from: --host, or the only one there is; an exit code after
    an error message when the streams hold several and --host names none."""
    from .audit_checkpoints import stream_entries

    if args.host is not None:
        return args.host
    try:
        hosts = sorted({str(entry.get("host")) for path in streams for _, entry in stream_entries(path)})
    except OSError as exc:
        print(f"scrubgate audit verify: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    if len(hosts) > 1:
        print(
            f"scrubgate audit verify: the stream holds {len(hosts)} replicas ({', '.join(hosts)}); "
            "name the pod the files came from with --host",
            file=sys.stderr,
        )
        return 2
    return hosts[0] if hosts else None


def _checkpoint_findings(args: argparse.Namespace, result: VerifyResult, host: str | None) -> list[Finding] | int:
    """The checkpoints' findings, or an exit code after an error message."""
    from . import audit_checkpoints as cps

    if not args.checkpoints:
        return []
    if not args.public_key:
        print("scrubgate audit verify: --checkpoints needs --public-key (the webhook's audit key)", file=sys.stderr)
        return 2
    try:
        keys = cps.load_public_keys(args.public_key)
        found = [cp for path in args.checkpoints for cp in cps.read_checkpoints(path)]
    except (OSError, ValueError) as exc:
        print(f"scrubgate audit verify: {exc}", file=sys.stderr)
        return 2
    mine = [cp for cp in found if host is None or cp.host == host]
    if not mine:
        print(
            f"scrubgate audit verify: no checkpoint{' of ' + host if host else ''} in "
            f"{', '.join(map(str, args.checkpoints))}; was the webhook started with --audit-signing-key?",
            file=sys.stderr,
        )
        return 2
    return cps.check(mine, result.hashes, keys)


def run_audit(args: argparse.Namespace) -> int:
    from .audit import verify_files

    if args.stream and args.public_key and not args.checkpoints:
        args.checkpoints = list(args.files)
    host = _one_host(args, [*args.checkpoints, *(args.files if args.stream else [])])
    if isinstance(host, int):
        return host
    result = verify_files(args.files, stream=args.stream, host=host)
    if result.unreadable is not None:
        print(f"scrubgate audit verify: cannot read {result.unreadable}", file=sys.stderr)
        return 2
    findings = _checkpoint_findings(args, result, host)
    if isinstance(findings, int):
        return findings
    for finding in findings:
        if finding.kind != "matched":
            print(f"{'BROKEN' if finding.broken else 'note'} ({finding.where}): {finding.message}")
    matched = [f for f in findings if f.kind == "matched"]
    if matched:
        print(f"{len(matched)} signed checkpoint(s) match the files; the latest: {matched[-1].message}")
    broken_checkpoints = any(f.broken for f in findings)
    if result.problem is not None:
        p = result.problem
        seq = f" (seq {p.seq})" if p.seq is not None else ""
        print(f"BROKEN at {p.file}:{p.line}{seq}: {p.what}")
        print(f"{result.records} record(s) before it verified")
        return 1
    if broken_checkpoints:
        return 1
    if result.records == 0:
        print(f"intact: no records in {len(result.files)} file(s)")
        return 0
    print(
        f"intact: {result.records} record(s) in {len(result.files)} file(s), seq {result.first_seq}..{result.last_seq}, "
        f"head {result.last_hash}"
    )
    if not args.checkpoints:
        print(
            "note: the hash chain alone: a cut tail or a chain rewritten from some record on still verifies; "
            "check the files against the webhook's signed checkpoints too (--checkpoints STREAM --public-key KEY)"
        )
    if not result.starts_at_genesis:
        print(
            f"note: the chain starts at seq {result.first_seq}; older records were rotated away or not given, "
            "so nothing before it can be checked"
        )
    return 0
