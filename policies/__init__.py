"""scrubgate policy core."""
