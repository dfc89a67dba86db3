"""`scrubgate webhook` and `scrubgate audit verify`. Argument setup imports nothing heavy, so that
`scrubgate check` starts fast; FastAPI and uvicorn load only in `run`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import defaults


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", type=Path, required=True, help="serving certificate (PEM); reloaded on change")
    parser.add_argument("--tls-key", type=Path, required=True, help="its private key (PEM); reloaded on change")
    parser.add_argument("--port", type=int, default=defaults.PORT, help=f"HTTPS port (default {defaults.PORT})")
    parser.add_argument("--host", default=defaults.HOST, help=f"address to listen on (default {defaults.HOST})")
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
        "--client-ca",
        type=Path,
        help="CA that signs the API server's client certificate; admission paths then require one",
    )


def run(args: argparse.Namespace) -> int:
    from .server import Settings, serve

    return serve(
        Settings(
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            host=args.host,
            port=args.port,
            policy=args.policy,
            audit_log=args.audit_log,
            audit_max_bytes=args.audit_max_bytes,
            audit_backups=args.audit_backups,
            client_ca=args.client_ca,
        )
    )


def add_audit_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="audit_action", required=True, metavar="ACTION")
    verify = actions.add_parser(
        "verify",
        help="recompute the hash chain and name the first altered, dropped or reordered record",
        description="Exit 0: intact; 1: broken (the first broken record is named); 2: a file cannot be read.",
    )
    verify.add_argument(
        "files", nargs="+", type=Path, metavar="FILE", help="audit log files (rotated files in any order)"
    )


def run_audit(args: argparse.Namespace) -> int:
    from .audit import verify_files

    result = verify_files(args.files)
    if result.unreadable is not None:
        print(f"scrubgate audit verify: cannot read {result.unreadable}", file=sys.stderr)
        return 2
    if result.problem is not None:
        p = result.problem
        seq = f" (seq {p.seq})" if p.seq is not None else ""
        print(f"BROKEN at {p.file}:{p.line}{seq}: {p.what}")
        print(f"{result.records} record(s) before it verified")
        return 1
    if result.records == 0:
        print(f"intact: no records in {len(result.files)} file(s)")
        return 0
    print(
        f"intact: {result.records} record(s) in {len(result.files)} file(s), seq {result.first_seq}..{result.last_seq}, "
        f"head {result.last_hash}"
    )
    if not result.starts_at_genesis:
        print(
            f"note: the chain starts at seq {result.first_seq}; older records were rotated away or not given, "
            "so nothing before it can be checked"
        )
    return 0
