"""What the NVIDIA kernel driver says about its own scrub-on-free (``RMDisableScrubOnFree``).

The key is a registry DWORD, set at module load through ``NVreg_RegistryDwords`` (or
``NVreg_RegistryDwordsPerDevice``) and echoed by the driver in ``/proc/driver/nvidia/params`` as
``RegistryDwords: "Key=Value;..."``. Its default, 0, means the driver scrubs memory on free; the
behaviour is undocumented, so scrubgate scrubs and verifies regardless and only reports this.
"""

from __future__ import annotations

import re
from pathlib import Path

PARAMS_PATH = Path("/proc/driver/nvidia/params")
KEY = "RMDisableScrubOnFree"
_LINE = re.compile(r'^(RegistryDwords|RegistryDwordsPerDevice):\s*"?(.*?)"?\s*$')


def scrub_on_free_disabled(params_path: Path = PARAMS_PATH) -> bool | None:
    """True when the key is set non-zero (for any GPU), False when the driver runs with the
    default, None when the params file cannot be read or the value cannot be parsed."""
    try:
        text = params_path.read_text()
    except OSError:
        return None
    disabled = False
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if not match:
            continue
        for entry in match.group(2).split(";"):
            name, sep, value = entry.strip().partition("=")
            if sep and name.strip() == KEY:
                try:
                    disabled = disabled or int(value.strip(), 0) != 0
                except ValueError:
                    return None
    return disabled
