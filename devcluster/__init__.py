"""devcluster: the real Kubernetes control plane, simulated GPU nodes and scrubgate installed on them, for the
end-to-end tests and the demo.

A test and demo harness, not part of scrubgate: nothing under ``policies/``, ``webhook/``,
``sanitizer_agent/``, ``certs/`` or ``scrubgate/`` may import it. See ``devcluster/README.md``.
"""
