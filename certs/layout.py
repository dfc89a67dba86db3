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

DEFAULT_CA_DAYS: Final = 3650
DEFAULT_SERVING_DAYS: Final = 365
