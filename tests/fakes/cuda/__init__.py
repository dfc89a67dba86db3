"""Stand-in for the cuda-python namespace package (see bindings/driver.py)."""
