"""``scrubgate certs``: make the webhook's CA and serving certificate, and put the CA into the webhooks.

Only argparse is imported at module level: the top-level CLI imports `add_arguments` on every start.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from scrubgate.policies import names

from . import layout

if TYPE_CHECKING:
    from .inject import InjectedFile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``generate``, ``ensure`` and ``inject`` subcommands (``args.certs_command``) to the ``certs`` parser."""
    sub = parser.add_subparsers(dest="certs_command", required=True, metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="make a CA and a serving certificate, the TLS Secret manifest, and inject the caBundle",
        description=(
            "Write ca.crt, ca.key, tls.crt, tls.key and tls-secret.yaml (Secret "
            "scrubgate-webhook-tls, type kubernetes.io/tls) into DIR, and the webhook's key for signed audit "
            "checkpoints: audit-key.pem, audit.pub (for scrubgate audit verify --public-key) and "
            "audit-key-secret.yaml (Secret scrubgate-audit-signing-key). A CA already in DIR (ca.crt and "
            "ca.key) is reused, so running this again renews the serving certificate without changing the "
            "caBundle; an audit key already in DIR is reused too. With --manifests, the caBundle goes into every webhook of the webhook "
            "configurations found there: patched copies are written into DIR, or the files are patched "
            "with --in-place."
        ),
    )
    gen.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory to write into")
    gen.add_argument("--service", default=names.WEBHOOK_SERVICE, help="webhook Service name (%(default)s)")
    gen.add_argument(
        "--namespace", default=names.SYSTEM_NAMESPACE, help="namespace of the Service and Secret (%(default)s)"
    )
    gen.add_argument(
        "--extra-san",
        action="append",
        default=[],
        metavar="NAME",
        help="another DNS name or IP address for the serving certificate, e.g. localhost or 127.0.0.1 "
        "when serving on loopback (repeatable)",
    )
    gen.add_argument(
        "--days", type=int, default=layout.DEFAULT_SERVING_DAYS, help="serving certificate validity (%(default)s)"
    )
    gen.add_argument("--ca-days", type=int, default=layout.DEFAULT_CA_DAYS, help="validity of a new CA (%(default)s)")
    gen.add_argument("--key-type", choices=["ec", "rsa"], default="ec", help="EC P-256 or RSA-2048 (ec)")
    gen.add_argument("--new-ca", action="store_true", help="replace a CA already in DIR")
    gen.add_argument(
        "--manifests",
        type=Path,
        metavar="PATH",
        help="YAML file, or directory of YAML files, holding the webhook configurations",
    )
    gen.add_argument("--in-place", action="store_true", help="patch the --manifests files themselves")

    ens = sub.add_parser(
        "ensure",
        help="make the webhook's TLS and audit key Secrets in the cluster when absent, and set every caBundle",
        description=(
            "In the cluster (what the chart's hook runs, certs.source in-cluster): make the Secret "
            "scrubgate-webhook-tls (a new CA and the serving certificate of the webhook's Service) and, with "
            "--audit-key-secret, the webhook's audit checkpoint key, each only when absent; then set the caBundle "
            "of every webhook in the --webhook-configuration objects to that Secret's ca.crt (one not there yet is "
            "left for the next run). Running it again changes nothing."
        ),
    )
    ens.add_argument("--namespace", default=names.SYSTEM_NAMESPACE, help="of the Service and Secrets (%(default)s)")
    ens.add_argument("--service", default=names.WEBHOOK_SERVICE, help="webhook Service name (%(default)s)")
    ens.add_argument(
        "--days", type=int, default=layout.DEFAULT_CA_DAYS, help="validity of a new CA and certificate (%(default)s)"
    )
    ens.add_argument(
        "--webhook-configuration",
        action="append",
        default=[],
        metavar="RESOURCE/NAME",
        help="validatingwebhookconfigurations/NAME or mutatingwebhookconfigurations/NAME (repeatable)",
    )
    ens.add_argument("--audit-key-secret", metavar="NAME", help="also make this audit key Secret when absent")
    ens.add_argument("--kubeconfig", help="kubeconfig file (default: in a pod its service account)")
    ens.add_argument("--context", help="kubeconfig context")

    inj = sub.add_parser(
        "inject",
        help="put a CA bundle into the webhook configurations of YAML files or a stream",
        description=(
            "Set clientConfig.caBundle of every webhook in the Validating/MutatingWebhookConfiguration "
            "documents; other documents pass through. With '-', read standard input and write standard "
            "output, e.g.: kubectl kustomize manifests/ | scrubgate certs inject --ca DIR/ca.crt - | "
            "kubectl apply -f -"
        ),
    )
    inj.add_argument("--ca", required=True, type=Path, metavar="FILE", help="PEM CA certificate(s)")
    inj.add_argument("path", metavar="PATH", help="YAML file, directory of YAML files, or - for stdin")
    where = inj.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, metavar="DIR", help="write patched copies into DIR")
    where.add_argument("--in-place", action="store_true", help="patch the files themselves")


def run(args: argparse.Namespace) -> int:
    """Run the subcommand chosen in ``args``; 0 on success, 1 with a message on stderr otherwise."""
    from ruamel.yaml.error import YAMLError

    command = args.certs_command
    try:
        if command == "generate":
            return _generate(args)
        if command == "ensure":
            return _ensure(args)
        return _inject(args)
    except (ValueError, OSError, YAMLError) as e:
        print(f"scrubgate certs {command}: {e}", file=sys.stderr)
        return 1


def _generate(args: argparse.Namespace) -> int:
    from . import generate as gen
    from .inject import inject_files

    if args.in_place and args.manifests is None:
        raise ValueError("--in-place needs --manifests")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    have_cert, have_key = (out / layout.CA_CERT_FILE).exists(), (out / layout.CA_KEY_FILE).exists()
    if have_cert != have_key and not args.new_ca:
        present, missing = (
            (layout.CA_CERT_FILE, layout.CA_KEY_FILE) if have_cert else (layout.CA_KEY_FILE, layout.CA_CERT_FILE)
        )
        raise ValueError(
            f"{out / present} exists but {out / missing} does not; restore it, or pass --new-ca to replace "
            "the CA (then every webhook's caBundle must be injected again)"
        )
    if have_cert and have_key and not args.new_ca:
        ca = gen.load_ca(out)
        ca_note = "reused"
    else:
        ca = gen.generate_ca(days=args.ca_days, key_type=args.key_type)
        ca_note = "new"
    sans = [*gen.service_sans(args.service, args.namespace), *args.extra_san]
    serving = gen.issue_serving_cert(ca, sans, days=args.days, key_type=args.key_type)
    files = gen.write_tls_dir(out, ca, serving)
    secret = gen.write_secret_manifest(
        out / layout.SECRET_MANIFEST_FILE, gen.secret_manifest(ca, serving, namespace=args.namespace)
    )
    print(f"{ca_note} CA {files.ca_cert} (valid until {ca.certificate.not_valid_after_utc:%Y-%m-%d})")
    print(
        f"serving certificate {files.tls_cert} for {', '.join(sans)} "
        f"(valid until {serving.certificate.not_valid_after_utc:%Y-%m-%d})"
    )
    print(f"Secret {args.namespace}/{layout.TLS_SECRET_NAME}: {secret}")
    audit = gen.write_audit_key(out, namespace=args.namespace)
    print(f"{'new' if audit.new else 'reused'} audit signing key {audit.key} (public key {audit.public})")
    print(f"Secret {args.namespace}/{layout.AUDIT_KEY_SECRET_NAME}: {audit.secret}")
    if args.manifests is not None:
        injected = inject_files(args.manifests, ca.cert_pem, None if args.in_place else out)
        _report_injected(injected)
    return 0


def _ensure(args: argparse.Namespace) -> int:
    from scrubgate.cluster import ApiError, KubeApi

    from .incluster import ensure

    try:
        lines = ensure(
            KubeApi.connect(args.kubeconfig, args.context),
            args.namespace,
            service=args.service,
            days=args.days,
            configurations=args.webhook_configuration,
            audit_key_secret=args.audit_key_secret,
        )
    except ApiError as e:
        print(f"scrubgate certs ensure: {e}; what was done before it stays", file=sys.stderr)
        return 1
    for line in lines:
        print(line)
    return 0


def _inject(args: argparse.Namespace) -> int:
    from .inject import inject_files, inject_yaml_text

    ca_pem = args.ca.read_bytes()
    if args.path == "-":
        if args.out is not None or args.in_place:
            raise ValueError("--out and --in-place apply to files; with '-' the result goes to standard output")
        text, webhooks = inject_yaml_text(sys.stdin.read(), ca_pem)
        if not webhooks:
            raise ValueError("no webhook configuration on standard input; nothing to inject the caBundle into")
        sys.stdout.write(text)
        print(f"caBundle injected into {webhooks} webhook(s)", file=sys.stderr)
        return 0
    if args.out is None and not args.in_place:
        raise ValueError("say where the result goes: --out DIR or --in-place")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    _report_injected(inject_files(Path(args.path), ca_pem, args.out))
    return 0


def _report_injected(injected: list[InjectedFile]) -> None:
    for item in injected:
        print(f"caBundle injected into {item.webhooks} webhook(s): {item.written}")
