"""Repository tools (not installed): the image install script, the helm build, the chart schema."""
