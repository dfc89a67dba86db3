"""The webhook's DeviceClass watch (webhook/device_classes.py): what its verdicts are before, at and after the
first list, and what it says of an excluded class whose selectors prove nothing."""

from __future__ import annotations

import threading

from kube_fake import FakeApi
from scrubgate.policies.config import load_policy

from webhook.device_classes import DeviceClassWatch

PATH = "/apis/resource.k8s.io/v1/deviceclasses"


def device_class(name: str, expression: str) -> dict:
    return {"metadata": {"name": name}, "spec": {"selectors": [{"cel": {"expression": expression}}]}}


def run_until_watching(api: FakeApi, watch: DeviceClassWatch) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    policy = load_policy()
    thread = threading.Thread(target=watch.run, args=(stop, lambda: policy), daemon=True)
    thread.start()
    assert api.watched.wait(10)
    return stop, thread


def test_every_class_is_a_gpu_class_until_the_first_list_then_each_by_its_selectors(caplog):
    policy = load_policy()
    api = FakeApi()
    api.add(PATH, device_class("nic.example.com", "device.driver == 'nic.example.com'"))
    api.add(PATH, device_class("imex.nvidia.com", "device.attributes['gpu.nvidia.com'].type == 'gpu'"))
    unproven: list[list[str]] = []
    watch = DeviceClassWatch(lambda: api, on_unproven=unproven.append)
    assert watch.classes(policy).may_hand_out_gpus("nic.example.com"), "before the first list"
    stop, thread = run_until_watching(api, watch)
    try:
        assert watch.synced.is_set()
        assert not watch.classes(policy).may_hand_out_gpus("nic.example.com")
        assert watch.classes(policy).may_hand_out_gpus("unknown.example.com")
        assert unproven[0] == ["imex.nvidia.com"]
        assert "imex.nvidia.com are in the policy's excludeDeviceClasses" in caplog.text
    finally:
        stop.set()
        thread.join(5)


def test_watch_events_change_the_verdicts():
    policy = load_policy()
    api = FakeApi()
    api.events[PATH] = [
        {"type": "ADDED", "object": device_class("fpga.example.com", "device.driver == 'fpga.example.com'")},
        {"type": "MODIFIED", "object": device_class("nic.example.com", "has(device.attributes['x'].y)")},
    ]
    api.add(PATH, device_class("nic.example.com", "device.driver == 'nic.example.com'"))
    watch = DeviceClassWatch(lambda: api)
    stop, thread = run_until_watching(api, watch)
    try:
        deadline = threading.Event()
        for _ in range(100):
            if not watch.classes(policy).may_hand_out_gpus("fpga.example.com"):
                break
            deadline.wait(0.05)
        assert not watch.classes(policy).may_hand_out_gpus("fpga.example.com")
        assert watch.classes(policy).may_hand_out_gpus("nic.example.com"), "changed to select by attribute only"
    finally:
        stop.set()
        thread.join(5)
