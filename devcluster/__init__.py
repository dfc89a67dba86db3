"""devcluster: a local Kubernetes API stand-in and simulated DRA control plane for tests and the demo.

A test and demo harness, not part of scrubgate: nothing under ``policies/``, ``webhook/``,
``sanitizer_agent/``, ``certs/`` or ``scrubgate/`` may import it. See ``devcluster/README.md``.
"""
