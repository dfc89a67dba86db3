"""One fake GPU node shared by the fake ``pynvml`` and the fake CUDA driver bindings in this folder.

Put this folder first on ``sys.path`` / ``PYTHONPATH`` and set ``SCRUBGATE_FAKE_GPU`` to a node
directory; then ``import pynvml`` and ``from cuda.bindings import driver`` get the fakes, in the
test process and in any child process (the agent's scrub, the GPU check's tenant and probe), and they
agree on one node:

- ``node.json``: GPUs, MIG devices, health counters, injected NVML and CUDA faults;
- ``mem/<uuid>``: each CUDA-visible device's memory, so what one process writes the next one reads,
  as on a GPU whose driver does not scrub on free; a MIG device's memory is its placement's
  (``mem/<GPU uuid>@<start>+<size>``), so a GPU instance created again there sees what the last one left;
- ``contexts/<uuid>/<pid>``: processes holding a CUDA context (NVML lists them while they live);
- ``nvml-sessions/<pid>/``: processes with NVML open (between nvmlInit and the last nvmlShutdown), with a file
  per GPU the process attached in that session (a handle lookup attaches the GPUs nvml.h says it does): while
  another live process has a GPU attached, a MIG mode change of it is "in use by another client";
- ``kmsg``: the kernel log as /dev/kmsg gives it (one record a line, numbered from 0 at boot), where
  ``FakeNode.log_xid`` writes the driver's XID records and ``log_kernel``/``log_user`` any other;
- with ``FakeNode.enable_capabilities()``, the driver's MIG capabilities: a `capabilities/` tree as under
  /proc/driver/nvidia/capabilities (written when a GPU or compute instance is created, removed when it is
  destroyed), `proc-devices` with the nvidia-caps major, and `dev-caps/` standing for /dev/nvidia-caps, which
  starts empty as in a container: the fake CUDA driver then sees a MIG device only once the nodes of its
  GPU and compute instance capabilities exist there.
"""

from __future__ import annotations

import json
import os
import time
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


def device_memory_path(record: dict[str, Any]) -> Path:
    """The memory of a device record: its placement's for a MIG device, else its own."""
    return memory_path(record.get("memoryFile") or record["uuid"])


def placement_file(gpu_uuid: str, start: int, size: int) -> str:
    return f"{gpu_uuid}@{start}+{size}"


CAPS_MAJOR = 508


def capability_minors(gpu_index: int, gi_id: int, ci_id: int) -> tuple[int, int]:
    """The DeviceFileMinor of a GPU instance's and a compute instance's access capabilities (made up, distinct)."""
    gi = 1000 + 100 * gpu_index + 10 * gi_id
    return gi, gi + 1 + ci_id


def capability_access(data: dict[str, Any], gpu_index: int, gi_id: int, ci_id: int | None = None) -> Path | None:
    """The /proc access file of a GPU instance (or of its compute instance `ci_id`); None without capabilities."""
    caps = data.get("capabilities")
    if not caps:
        return None
    gi = Path(caps["proc"]) / f"gpu{gpu_index}" / "mig" / f"gi{gi_id}"
    return gi / "access" if ci_id is None else gi / f"ci{ci_id}" / "access"


def grant_capability(data: dict[str, Any], gpu_index: int, gi_id: int, ci_id: int | None = None) -> None:
    """What the kernel driver does when a GPU instance (or compute instance) is created: its access file."""
    access = capability_access(data, gpu_index, gi_id, ci_id)
    if access is not None:
        gi_minor, ci_minor = capability_minors(gpu_index, gi_id, ci_id or 0)
        access.parent.mkdir(parents=True, exist_ok=True)
        access.write_text(f"DeviceFileMinor: {gi_minor if ci_id is None else ci_minor}\nDeviceFileMode: 292\n")


def revoke_capability(data: dict[str, Any], gpu_index: int, gi_id: int, ci_id: int | None = None) -> None:
    access = capability_access(data, gpu_index, gi_id, ci_id)
    if access is not None:
        access.unlink(missing_ok=True)


def obliterate(mig_uuid: str) -> None:
    """NVIDIA's DRA driver starting: it tears down the MIG devices its checkpoint does not name (compute and
    GPU instance), here the one `mig_uuid` names, in node.json as the fake NVML sees it."""
    path = node_dir() / "node.json"
    data = json.loads(path.read_text())
    for index, gpu in enumerate(data["gpus"]):
        for mig in [m for m in gpu["migs"] if m["uuid"] == mig_uuid]:
            gpu["migs"].remove(mig)
            gpu["gis"] = [g for g in gpu["gis"] if g["id"] != mig["gi"]]
            revoke_capability(data, index, mig["gi"], mig["ci"])
            revoke_capability(data, index, mig["gi"])
    tmp = path.with_name("node.json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def fake_mknod(path: Path, major: int, minor: int) -> None:
    """mknod as a test may run it: a regular file naming the device (no real driver behind the numbers)."""
    with open(path, "x") as f:
        f.write(f"c {major}:{minor}\n")


def fake_device_of(path: Path) -> tuple[int, int] | None:
    """(major, minor) of a node `fake_mknod` made; None for no node or anything else."""
    try:
        kind, _, numbers = path.read_text().strip().partition(" ")
        major, _, minor = numbers.partition(":")
        return (int(major), int(minor)) if kind == "c" else None
    except (OSError, ValueError):
        return None


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


def sessions_dir() -> Path:
    return node_dir() / "nvml-sessions"


def own_session() -> Path:
    return sessions_dir() / str(os.getpid())


def attach(gpu_uuid: str) -> None:
    """This process's NVML session attached the GPU (until its nvmlShutdown)."""
    (own_session() / gpu_uuid).touch()


def attached_by_others(gpu_uuid: str) -> list[int]:
    """Live processes other than this one whose NVML session has the GPU attached."""
    folder = sessions_dir()
    if not folder.is_dir():
        return []
    return [
        int(e.name)
        for e in folder.iterdir()
        if int(e.name) != os.getpid() and (e / gpu_uuid).exists() and pid_alive(int(e.name))
    ]


def attached(pid: int) -> set[str]:
    """The GPUs process `pid` has attached in its NVML session now (empty when it has none)."""
    folder = sessions_dir() / str(pid)
    return {e.name for e in folder.iterdir()} if folder.is_dir() else set()


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
        (self.root / "nvml-sessions").mkdir(exist_ok=True)
        self.kmsg.touch()
        self._seq = 0  # the kernel numbers records from 0 at boot
        self.data: dict[str, Any] = {"gpus": [], "nvmlErrors": {}, "cuda": {}}
        self.save()

    @property
    def kmsg(self) -> Path:
        return self.root / "kmsg"

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
            "pciBus": 0x18 + 0x10 * len(self.data["gpus"]),
            "name": name,
            "memory": memory,
            "reserved": reserved,
            "contextBytes": 1 << 20,
            "sms": 4,
            "migMode": 1 if mig is not None else 0,
            "maxMig": 7,
            "migs": [],
            # MIG: GPU instances (id, profileId, start, size) and the GI profiles the card offers, by ID:
            # memory slices, compute slices and memory bytes (an H100-like 8 memory / 7 compute slices).
            "gis": [],
            "memorySlices": 8,
            "giProfiles": {
                "19": [1, 1, 16 << 20],
                "15": [2, 2, 32 << 20],
                "9": [4, 3, 64 << 20],
                "0": [8, 7, 128 << 20],
            },
            "architecture": 9,  # nvmlDeviceArchitecture_t: 7 Ampere, 9 Hopper (MIG mode changes without a reset)
            "persistenceMode": 1,
            "gspFirmware": "595.45.04",  # None: no GSP firmware (NOT_SUPPORTED)
            "ecc": 0,
            "eccMode": [1, 1],  # current, pending (NVML_FEATURE_ENABLED); None: NOT_SUPPORTED
            "remappedRows": [0, 0, 0, 0],
            "recoveryAction": 0,
            "memoryV2": True,
            "processes": {"compute": [], "graphics": [], "mps": []},
        }
        gpu.update(fields)
        self.data["gpus"].append(gpu)
        with open(self.root / "mem" / gpu["uuid"], "wb") as f:
            f.truncate(gpu["memory"])
        for slot, size in enumerate(mig or []):
            self.create_mig(gpu, "19", start=slot, memory=size)
        self.save()
        return gpu

    def _log(self, prival: int, message: str, flags: str = "-") -> None:
        """One record as a read of /dev/kmsg returns it (Linux kernel/printk/printk.c, info_print_ext_header and
        msg_add_ext_text): `prival` is facility << 3 | level; bytes outside 0x20..0x7e and the backslash are escaped
        as \\xNN, so a record is one line."""
        escaped = "".join(c if " " <= c < "\x7f" and c != "\\" else f"\\x{ord(c):02x}" for c in message)
        with self.kmsg.open("a") as log:
            log.write(f"{prival},{self._seq},{int(time.monotonic() * 1e6)},{flags};{escaped}\n")
        self._seq += 1

    def log_kernel(self, message: str, level: int = 6) -> None:
        """A record the kernel itself writes (facility 0, LOG_KERN); `level` 6 is KERN_INFO."""
        self._log(level, message)

    def log_user(self, message: str, level: int = 4) -> None:
        """What a process writes into /dev/kmsg: the kernel stores it with facility LOG_USER (1) at least."""
        self._log(1 << 3 | level, message)

    def log_xid(self, uuid: str, xid: int, name: str = "python3") -> None:
        """The kernel driver's record for an XID on a GPU, as the open driver writes it in every branch 535-595
        (open-gpu-kernel-modules kernel_rc.c, krcReportXid): no GPU instance (krcGetMigAttributionForError_KERNEL
        leaves it invalid), printed through nv_printf with KERN_CONT only (kernel-open/nvidia/os-interface.c), so
        at the default level 4 with the continuation flag."""
        gpu = next(g for g in load()["gpus"] if g["uuid"] == uuid)
        where = f"PCI:{gpu.get('pciDomain', 0):04x}:{gpu['pciBus']:02x}:00"
        self._log(4, f"NVRM: Xid ({where}): {xid}, pid=4242, name={name}, Ch 00000008", flags="c")

    def create_mig(self, gpu: dict[str, Any], profile_id: str, start: int, memory: int | None = None) -> dict[str, Any]:
        """A GPU instance with one compute instance at a placement, as nvidia-smi or NVIDIA's DRA driver
        (dynamic MIG, on prepare) creates it; its memory keeps what the placement held before."""
        slices, _compute, size_bytes = gpu["giProfiles"][profile_id]
        gi_id = max([g["id"] for g in gpu["gis"]], default=0) + 1
        gpu["gis"].append({"id": gi_id, "profileId": int(profile_id), "start": start, "size": slices})
        slot = min(set(range(gpu["maxMig"])) - {m["slot"] for m in gpu["migs"]})
        mig = {
            "slot": slot,
            "uuid": f"MIG-{uuidlib.uuid4()}",
            "memory": memory or size_bytes,
            "reserved": 0,
            "sms": 1,
            "gi": gi_id,
            "ci": 0,
            "memoryFile": placement_file(gpu["uuid"], start, slices),
        }
        gpu["migs"].append(mig)
        index = self.data["gpus"].index(gpu)
        grant_capability(self.data, index, gi_id)
        grant_capability(self.data, index, gi_id, 0)
        path = self.root / "mem" / mig["memoryFile"]
        if not path.exists():
            with open(path, "wb") as f:
                f.truncate(mig["memory"])
        self.save()
        return mig

    def delete_mig(self, uuid: str) -> None:
        """NVIDIA's DRA driver's unprepare of a dynamic MIG device: compute and GPU instance destroyed,
        the memory left as it was."""
        for gpu in self.data["gpus"]:
            for mig in list(gpu["migs"]):
                if mig["uuid"] == uuid:
                    index = self.data["gpus"].index(gpu)
                    revoke_capability(self.data, index, mig["gi"], mig["ci"])
                    revoke_capability(self.data, index, mig["gi"])
                    gpu["migs"].remove(mig)
                    gpu["gis"] = [g for g in gpu["gis"] if g["id"] != mig["gi"]]
        self.save()

    def enable_capabilities(self) -> dict[str, Path]:
        """The driver's capability files as a host has them, and an empty /dev/nvidia-caps as a container started
        before any MIG device has: the `CapabilityNodes` paths of this node."""
        paths = {
            "proc": self.root / "capabilities",
            "dev": self.root / "dev-caps",
            "devices": self.root / "proc-devices",
        }
        (paths["proc"] / "mig").mkdir(parents=True, exist_ok=True)
        (paths["proc"] / "mig" / "config").write_text("DeviceFileMinor: 1\nDeviceFileMode: 256\n")
        paths["dev"].mkdir(exist_ok=True)
        paths["devices"].write_text(f"Character devices:\n195 nvidia\n{CAPS_MAJOR} nvidia-caps\n")
        self.data["capabilities"] = {name: str(path) for name, path in paths.items()}
        for index, gpu in enumerate(self.data["gpus"]):
            for mig in gpu["migs"]:
                grant_capability(self.data, index, mig["gi"])
                grant_capability(self.data, index, mig["gi"], mig["ci"])
        self.save()
        return paths

    def device(self, uuid: str) -> dict[str, Any]:
        for gpu in self.data["gpus"]:
            for device in [gpu, *gpu["migs"]]:
                if device["uuid"] == uuid:
                    return device
        raise KeyError(uuid)

    def memory(self, uuid: str) -> bytes:
        return (self.root / "mem" / (self.device(uuid).get("memoryFile") or uuid)).read_bytes()

    def fill(self, uuid: str, pattern: bytes) -> None:
        """Leave a previous tenant's bytes in all of the device's memory."""
        device = self.device(uuid)
        size = device["memory"]
        path = self.root / "mem" / (device.get("memoryFile") or uuid)
        path.write_bytes((pattern * (size // len(pattern) + 1))[:size])
