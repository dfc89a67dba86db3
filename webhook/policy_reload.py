"""The policy in force, reloaded when its file changes. A changed file that does not load is refused
whole: the previous policy stays in force, the error is logged and counted."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from scrubgate.policies.config import PolicyConfig, PolicyError, load_policy

from .metrics import Metrics

log = logging.getLogger(__name__)

Stamp = tuple[int, int, int] | None


def file_stamp(path: Path) -> Stamp:
    """Identity and version of a file, following symlinks (a ConfigMap or Secret volume swaps a
    symlink, which changes the inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class PolicySource:
    def __init__(self, path: str | Path | None, metrics: Metrics) -> None:
        """Loads the policy (the shipped default when `path` is None); raises PolicyError when it
        cannot, so the webhook never starts without a policy."""
        self.path = Path(path) if path is not None else None
        self.metrics = metrics
        self._stamp = file_stamp(self.path) if self.path else None
        self.policy: PolicyConfig = load_policy(self.path)
        metrics.set_policy(self.policy.digest)

    def reload_if_changed(self) -> bool:
        """True when a changed file was loaded and is now in force."""
        if self.path is None:
            return False
        stamp = file_stamp(self.path)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            policy = load_policy(self.path)
        except PolicyError as exc:
            self.metrics.policy_reload_errors.inc()
            log.error(
                "refused the changed policy file, the previous policy (%s) stays in force: %s; fix the file, "
                "it is reloaded on its next change",
                self.policy.digest,
                exc,
                extra={"policy_file": str(self.path), "policy_digest": self.policy.digest},
            )
            return False
        if policy.digest != self.policy.digest:
            log.info(
                "policy reloaded from %s: %s -> %s",
                self.path,
                self.policy.digest,
                policy.digest,
                extra={"policy_file": str(self.path), "policy_digest": policy.digest},
            )
        self.policy = policy
        self.metrics.policy_reloads.inc()
        self.metrics.set_policy(policy.digest)
        return True

    async def watch(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await asyncio.to_thread(self.reload_if_changed)
