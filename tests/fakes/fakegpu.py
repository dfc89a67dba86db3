"""One fake GPU node shared by the fake ``pynvml`` and the fake CUDA driver bindings in this folder.

Put this folder first on ``sys.path`` / ``PYTHONPATH`` and set ``SCRUBGATE_FAKE_GPU`` to a node
directory; then ``import pynvml`` and ``from cuda.bindings import driver`` get the fakes, in the
test process and in any child process (the agent's scrub, the GPU check's tenant and probe), and they
agree on one node:

- ``node.json``: GPUs, MIG devices, health counters, injected NVML and CUDA faults;
- ``mem/<uuid>``: each CUDA-visible device's memory, so what one process writes the next one reads,
  as on a GPU whose driver does not scrub on free;
- ``contexts/<uuid>/<pid>``: processes holding a CUDA context (NVML lists them while they live).
"""

from __future__ import annotations

import json
import os
import uuid as uuidlib
from pathlib import Path
from typing import Any

ENV = "SCRUBGATE_FAKE_GPU"
FOLDER = Path(__file__).resolve().parent


def node_dir() -> Path:
    path = os.environ.get(ENV)
    if not path:
        raise RuntimeError(f"fake GPU: set {ENV} to a node directory (see tests/fakes/fakegpu.py)")
    return Path(path)


def load() -> dict[str, Any]:
    return json.loads((node_dir() / "node.json").read_text())


def memory_path(uuid: str) -> Path:
    return node_dir() / "mem" / uuid


def contexts_dir(uuid: str) -> Path:
    return node_dir() / "contexts" / uuid


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


def context_holders(uuid: str) -> list[tuple[int, int]]:
    """(pid, bytes allocated) of live processes with a CUDA context on the device."""
    found = []
    folder = contexts_dir(uuid)
    if folder.is_dir():
        for entry in folder.iterdir():
            pid = int(entry.name)
            if pid_alive(pid):
                found.append((pid, int(entry.read_text() or 0)))
    return found


class FakeNode:
    """Builds a fake node directory; tests edit ``data`` and call ``save()``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        (self.root / "mem").mkdir(parents=True, exist_ok=True)
        (self.root / "contexts").mkdir(exist_ok=True)
        self.data: dict[str, Any] = {"gpus": [], "nvmlErrors": {}, "cuda": {}}
        self.save()

    @property
    def env(self) -> dict[str, str]:
        return {ENV: str(self.root), "PYTHONPATH": str(FOLDER)}

    def save(self) -> None:
        tmp = self.root / "node.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.root / "node.json")

    def add_gpu(
        self,
        memory: int = 32 << 20,
        reserved: int = 1 << 20,
        name: str = "NVIDIA H200",
        mig: list[int] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """A GPU with ``memory`` bytes for CUDA; ``mig``: MIG mode on, one device per size given."""
        gpu: dict[str, Any] = {
            "uuid": f"GPU-{uuidlib.uuid4()}",
            "name": name,
            "memory": memory,
            "reserved": reserved,
            "contextBytes": 1 << 20,
            "sms": 4,
            "migMode": 1 if mig is not None else 0,
            "maxMig": 7,
            "migs": [],
            "ecc": 0,
            "remappedRows": [0, 0, 0, 0],
            "recoveryAction": 0,
            "events": True,
            "memoryV2": True,
            "processes": {"compute": [], "graphics": [], "mps": []},
        }
        gpu.update(fields)
        for slot, size in enumerate(mig or []):
            gpu["migs"].append(
                {"slot": slot, "uuid": f"MIG-{uuidlib.uuid4()}", "memory": size, "reserved": 0, "sms": 1}
            )
        self.data["gpus"].append(gpu)
        for device in [gpu, *gpu["migs"]]:
            with open(self.root / "mem" / device["uuid"], "wb") as f:
                f.truncate(device["memory"])
        self.save()
        return gpu

    def device(self, uuid: str) -> dict[str, Any]:
        for gpu in self.data["gpus"]:
            for device in [gpu, *gpu["migs"]]:
                if device["uuid"] == uuid:
                    return device
        raise KeyError(uuid)

    def memory(self, uuid: str) -> bytes:
        return (self.root / "mem" / uuid).read_bytes()

    def fill(self, uuid: str, pattern: bytes) -> None:
        """Leave a previous tenant's bytes in all of the device's memory."""
        size = self.device(uuid)["memory"]
        (self.root / "mem" / uuid).write_bytes((pattern * (size // len(pattern) + 1))[:size])
