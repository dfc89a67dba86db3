"""scrubgate: keeps one tenant's GPU memory from reaching the next through Kubernetes DRA."""

__version__ = "0.1.0"
