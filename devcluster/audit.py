"""The webhook's audit log as the tests read it: its records, its denials, and `scrubgate audit verify` over
it. Part of the test and demo harness (devcluster/harness.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


class AuditLog:
    """The audit log at ``path``; ``checkpoints``: the webhook's stdout, where it writes the signed checkpoints
    that ``public_key`` verifies."""

    def __init__(self, path: Path, checkpoints: Path, public_key: Path, env: dict[str, str]) -> None:
        self.path = path
        self.checkpoints = checkpoints
        self.public_key = public_key
        self._env = env

    def records(self) -> list[dict[str, Any]]:
        """Every record of the webhook's audit log (current file only), in order."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def denials(self, rule: str | None = None, **match: str) -> list[dict[str, Any]]:
        """Denied records with a finding of ``rule``, whose fields equal ``match`` (e.g. namespace=, user=)."""
        return [
            r
            for r in self.records()
            if r.get("decision") == "deny"
            and (rule is None or any(f["rule"]["id"] == rule for f in r.get("findings") or []))
            and all(r.get(k) == v for k, v in match.items())
        ]

    def verify(self) -> subprocess.CompletedProcess[str]:
        """`scrubgate audit verify` over the audit log and against the signed checkpoints in the webhook's
        stdout, as an operator would run it."""
        checkpoints = ["--checkpoints", str(self.checkpoints), "--public-key", str(self.public_key)]
        return subprocess.run(
            [sys.executable, "-m", "scrubgate.cli", "audit", "verify", str(self.path), *checkpoints],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=self._env,
        )
