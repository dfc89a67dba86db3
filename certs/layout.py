"""File and object names of the webhook's TLS material, and default validity (no heavy imports: the CLI
reads these at startup)."""

from typing import Final

TLS_SECRET_NAME: Final = "scrubgate-webhook-tls"
CA_COMMON_NAME: Final = "scrubgate-webhook-ca"
# The file names are the keys of a kubernetes.io/tls Secret, so the directory can be mounted or turned into
# a Secret as it is.
CA_CERT_FILE: Final = "ca.crt"
CA_KEY_FILE: Final = "ca.key"
TLS_CERT_FILE: Final = "tls.crt"
TLS_KEY_FILE: Final = "tls.key"
SECRET_MANIFEST_FILE: Final = "tls-secret.yaml"
# The webhook's own key for signed audit checkpoints: the Secret its Deployment mounts, the private key kept
# beside the CA (reused by the next run), and the public key `scrubgate audit verify --public-key` takes.
AUDIT_KEY_SECRET_NAME: Final = "scrubgate-audit-signing-key"
AUDIT_KEY_FILE: Final = "audit-key.pem"
AUDIT_PUBLIC_KEY_FILE: Final = "audit.pub"
AUDIT_SECRET_MANIFEST_FILE: Final = "audit-key-secret.yaml"

DEFAULT_CA_DAYS: Final = 3650
DEFAULT_SERVING_DAYS: Final = 365
