"""The webhook's TLS material: CA and serving certificate generation, caBundle injection."""
