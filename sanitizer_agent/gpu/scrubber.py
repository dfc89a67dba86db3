"""The scrub of one device: checked with NVML open (scrub_target.py), run by ``cuda_scrub.py`` in a child with NVML
closed (child.py), its report judged against the coverage bounds; and the start-up check that CUDA works."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from scrubgate.policies.names import ATTESTATION_METHOD

from . import mig
from .base import ScrubResult
from .child import ScrubChild
from .driver_params import scrub_on_free_disabled
from .handles import Devices
from .scrub_target import scrub_target
from .session import OpenNvml

log = logging.getLogger(__name__)

# What scrub() reads from cuda_scrub.py's report.
_REPORT_NUMBERS = ("bytesScrubbed", "scrubS", "nonzeroWords", "wordBytes")
# The scrub's own CUDA context and the allocator's granularity stay out of reach: about 0.3-0.5 GiB of a
# 141 GB GPU; more than this share of the usable memory unreached, or more than this many bytes (the
# policy's scrubCoverage, whose defaults these are), fails the scrub.
DEFAULT_MAX_UNREACHABLE = 0.02
DEFAULT_MAX_UNREACHABLE_BYTES = 1 << 30


class Scrubber:
    """Scrubs a device or checks CUDA, each in a child of its own (the child bounds how many run at once)."""

    def __init__(
        self,
        nvml: Any,
        session: OpenNvml,
        devices: Devices,
        child: ScrubChild,
        capabilities: mig.CapabilityNodes,
        *,
        params_path: Path,
        chunk_bytes: int,
        min_chunk_bytes: int,
        margin_bytes: int,
        max_unreachable_fraction: float,
        max_unreachable_bytes: int,
    ) -> None:
        self._nvml = nvml
        self._session = session
        self._devices = devices
        self.child = child
        self._capabilities = capabilities
        self.params_path = params_path
        self.chunk_bytes = chunk_bytes
        self.min_chunk_bytes = min_chunk_bytes
        self.margin_bytes = margin_bytes
        # Memory the scrub could not allocate (its own CUDA context, allocator granularity, the driver's
        # own) beyond this share of the usable memory means the scrub cannot vouch for the device.
        self.max_unreachable_fraction = max_unreachable_fraction
        self.max_unreachable_bytes = max_unreachable_bytes

    def scrub_on_free_disabled(self) -> bool | None:
        return scrub_on_free_disabled(self.params_path)

    def scrub(self, uuid: str) -> ScrubResult:
        started = time.monotonic()
        disabled = self.scrub_on_free_disabled()
        scrub_on_free = None if disabled is None else not disabled
        # NVML open for the checks, not while the scrub runs (see nvml.py's docstring).
        with self._session():
            ecc, total, reserved, why_not = scrub_target(self._nvml, self._devices, self._capabilities, uuid)
        report: dict[str, Any] = {}

        def result(verified: bool, reason: str | None, scrubbed: int = 0) -> ScrubResult:
            rss = report.get("maxRssBytes")
            return ScrubResult(
                uuid=uuid,
                bytes_scrubbed=scrubbed,
                bytes_total=total,
                bytes_reserved=reserved,
                bytes_unreachable=max(total - reserved - scrubbed, 0),
                duration_s=time.monotonic() - started,
                verified=verified,
                method=ATTESTATION_METHOD,
                reason=reason,
                kernel_s=float(report["scrubS"]) if "scrubS" in report else None,
                kernels=str(report["kernels"]) if "kernels" in report else None,
                scrub_on_free=scrub_on_free,
                ecc_enabled=ecc,
                host_rss_bytes=int(rss) if isinstance(rss, int) else None,
            )

        if why_not is not None:
            return result(False, why_not)
        report, failure = self.child.run(
            uuid,
            [
                f"--chunk-bytes={self.chunk_bytes}",
                f"--min-chunk-bytes={self.min_chunk_bytes}",
                f"--margin-bytes={self.margin_bytes}",
            ],
        )
        if failure is None and not all(isinstance(report.get(key), int | float) for key in _REPORT_NUMBERS):
            report, failure = {}, f"scrub of {uuid} gave a malformed report: {json.dumps(report)[:500]}"
        if failure is not None:
            return result(False, failure)
        scrubbed = int(report["bytesScrubbed"])
        if report.get("kernelErrors"):
            log.warning("scrub of %s verified with %s: %s", uuid, report["kernels"], "; ".join(report["kernelErrors"]))
        nonzero = int(report["nonzeroWords"])
        usable = total - reserved
        if nonzero:
            reason = (
                f"verification found {nonzero} non-zero {report['wordBytes']}-byte words on {uuid} "
                "after zeroing: memory does not hold writes, or something wrote to it during the scrub"
            )
            return result(False, reason, scrubbed)
        unreachable = max(usable - scrubbed, 0)
        allowed = min(int(self.max_unreachable_fraction * usable), self.max_unreachable_bytes)
        if scrubbed <= 0 or unreachable > allowed:
            reason = (
                f"scrub of {uuid} reached only {scrubbed} of {usable} usable bytes; {unreachable} could not "
                f"be allocated (held by another process or the driver), more than the {allowed} allowed "
                f"({self.max_unreachable_fraction:.1%} and at most {self.max_unreachable_bytes} bytes), so they "
                "are unverified"
            )
            return result(False, reason, scrubbed)
        if unreachable and scrub_on_free is not True:
            why = (
                "the kernel driver runs with RMDisableScrubOnFree set, so nothing zeroes them before they are "
                "handed out again; remove RMDisableScrubOnFree from NVreg_RegistryDwords"
                if scrub_on_free is False
                else f"whether the kernel driver zeroes freed memory cannot be read ({self.params_path}), so "
                "nothing says they were zeroed; mount the host's /proc/driver/nvidia into the agent"
            )
            reason = f"{unreachable} bytes of {uuid} were out of the scrub's reach (its own CUDA context, the driver's), and {why}"
            return result(False, reason, scrubbed)
        return result(True, None, scrubbed)

    def cuda_problem(self) -> str | None:
        """Why this process cannot open a CUDA context and run the scrub's kernels, or None: the start-up check,
        once, on one idle device (a whole GPU out of MIG mode, else a MIG device), so that a broken CUDA setup
        (bindings, libcuda, device nodes) is named at start rather than at the first teardown."""
        with self._session():
            entries, _errors = self._devices.enumerate()
            whole_first = sorted((h.uuid for _i, h in entries), key=lambda u: u not in self._devices.pci)
            target = next(
                (u for u in whole_first if scrub_target(self._nvml, self._devices, self._capabilities, u)[3] is None),
                None,
            )
        if target is None:
            log.info("no idle device for the CUDA check at start: CUDA is first used by the first scrub")
            return None
        report, failure = self.child.run(target, ["--check"])
        if failure is not None:
            return failure
        log.info(
            "CUDA check on %s: driver API %s, kernels %s%s",
            target,
            report.get("cudaDriverVersion"),
            report.get("kernels"),
            f" ({'; '.join(report['kernelErrors'])})" if report.get("kernelErrors") else "",
        )
        return None
