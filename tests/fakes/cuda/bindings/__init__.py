"""Stand-in for cuda.bindings: only the driver module is faked."""
