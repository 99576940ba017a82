"""Device kinds beyond the CPU: the platform a worker serves, the kind it reports, slices of
that kind, and functions exported for it, all without an accelerator."""

import itertools
import subprocess
import sys

import jax
import numpy as np
import pytest

import pathways as pw
from pathways.client.devices import VirtualDeviceSet
from pathways.controller.islands import Islands
from pathways.controller.placement import ResourceManager
from pathways import platforms
from pathways.platforms import (PLATFORMS, Devices, accelerator_backends, cpu_devices, export_platforms, find_devices,
                                kind_of)
from pathways.protocol import messages as m


def test_platforms_map_to_the_kinds_slices_ask_for():
    assert [kind_of(p) for p in PLATFORMS] == ["cpu", "gpu", "gpu", "tpu"]
    assert kind_of("gpu") == "gpu"  # jax's Device.platform for CUDA and ROCm devices alike
    with pytest.raises(ValueError, match="'metal' is not one pathways workers serve.*--platform cpu|cuda|rocm|tpu"):
        kind_of("metal")
    assert export_platforms("gpu") == ("cuda", "rocm") and export_platforms("cpu") == ("cpu",)
    with pytest.raises(pw.PlacementError, match="cpu, gpu or tpu"):
        export_platforms("cuda")


def test_devices_counts_cpu_devices_only():
    assert cpu_devices(None, None) == 1 and cpu_devices("cpu", 4) == 4 and cpu_devices(None, 2) == 2
    assert cpu_devices("cuda", None) == 1  # CPU devices besides the GPUs: the default, unused
    with pytest.raises(ValueError, match="--platform cuda the worker serves the devices JAX finds.*"
                                         "CUDA_VISIBLE_DEVICES.*drop --devices"):
        cpu_devices("cuda", 2)
    with pytest.raises(ValueError, match="TPU_VISIBLE_CHIPS"):
        cpu_devices("tpu", 1)
    with pytest.raises(ValueError, match="--devices must be at least 1, got 0"):
        cpu_devices("cpu", 0)


def test_the_worker_command_refuses_devices_with_an_accelerator_platform():
    done = subprocess.run([sys.executable, "-m", "pathways", "worker", "--controller", "grpc://127.0.0.1:1",
                           "--platform", "rocm", "--devices", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "ROCR_VISIBLE_DEVICES" in done.stderr and "drop --devices" in done.stderr


class Controllerless:
    """A session whose requests go through the wire checks to a resource manager holding one
    CPU host (worker 0, 4 devices) and, with ``gpu``, one GPU host (worker 1, 2 devices)."""

    def __init__(self, gpu=True):
        self.rm = ResourceManager(Islands())
        for worker, kind, devices in ((0, "cpu", 4), (1, "gpu", 2))[:2 if gpu else 1]:
            self.rm.islands.join(worker, str(worker), 1, None, "")  # island i holds worker i alone
            self.rm.add_host(worker, worker, kind, devices, 1 << 30, rank=0)
        self.sent, self.asked = [], []
        self.slices = {}  # the Slice objects by id, as a Session keeps them (SliceMoved)
        self.local = False  # a remote cluster, as far as placement advice goes (Session.local)
        self._ids = itertools.count(1)

    def request(self, make):
        msg = m.SESSION_UP.decode_one(m.pack(make(1).encode()))
        self.asked.append(msg)
        p = self.rm.place(msg.count, msg.kind, msg.mesh_shape, msg.island, msg.exclusive)
        return m.SliceReply(msg.req, p.slice_id, p.workers, tuple(f"grpc://h:{w}" for w in p.workers), p.island,
                            tuple(x for d in p.devices for x in d), p.mesh_shape)

    def allocate(self, n):
        return next(self._ids)

    def send(self, msg):
        self.sent.append(msg)


def test_gpu_and_tpu_slices_ask_for_their_kind_and_land_on_its_hosts():
    session = Controllerless()
    vds = VirtualDeviceSet(session)
    gpus = vds.add_slice(gpu_devices=2)
    assert session.asked[-1].kind == "gpu" and session.asked[-1].count == 2
    assert gpus.workers == (1,) and gpus.kind == "gpu" and len(gpus.gpus) == 2
    with pytest.raises(pw.PlacementError, match="holds gpu devices, not cpu"):
        gpus.cpus
    assert vds.add_slice(cpu_devices=3).workers == (0,)
    with pytest.raises(pw.PlacementError, match="no worker has tpu devices.*--platform tpu"):
        vds.add_slice(tpu_devices=1)
    with pytest.raises(pw.PlacementError, match=r"no worker has gpu devices.*--platform cuda \(or rocm\)"):
        VirtualDeviceSet(Controllerless(gpu=False)).add_slice(gpu_devices=1)


@pytest.mark.parametrize("kwargs, needle", [
    ({}, "exactly one of cpu_devices=, gpu_devices=, tpu_devices="),
    ({"cpu_devices": 1, "gpu_devices": 1}, "exactly one of"),
    ({"gpu_devices": 0}, "gpu_devices must be a positive integer, got 0"),
    ({"tpu_devices": 1.5}, "tpu_devices must be a positive integer, got 1.5"),
    ({"gpu_devices": True}, "gpu_devices must be a positive integer, got True"),
    ({"cpu_devices": 1, "island": "a"}, r"island= takes an island's id \(an integer\), not 'a'.*`island a \(id 0\)`"),
    ({"cpu_devices": 1, "island": 1.0}, r"island= takes an island's id \(an integer\), not 1.0"),
])
def test_add_slice_arguments_are_checked_before_asking(kwargs, needle):
    session = Controllerless()
    with pytest.raises(pw.PlacementError, match=needle):
        VirtualDeviceSet(session).add_slice(**kwargs)
    assert session.asked == []


def test_a_slice_request_carries_only_known_kinds():
    def wire(kind):
        return m.SESSION_UP.decode_one(m.pack(m.SliceRequest(1, kind, 8, None, None, False).encode()))

    assert [wire(k).kind for k in ("cpu", "gpu", "tpu")] == ["cpu", "gpu", "tpu"]
    with pytest.raises(pw.WireError, match="field 'kind' of message 'slice'"):
        wire("cuda")


def test_a_function_for_a_gpu_slice_is_exported_for_cuda_and_rocm_from_a_cpu_client():
    session = Controllerless()
    vds = VirtualDeviceSet(session)
    for s, platforms in ((vds.add_slice(gpu_devices=2), ("cuda", "rocm")), (vds.add_slice(cpu_devices=2), ("cpu",))):
        f = pw.pmap(lambda x: jax.lax.psum(x, "i") * 2.0, devices=s.devices)
        x = np.ones((2, 3), np.float32)
        f.specialize(jax.tree.structure((x,)), [(x.shape, x.dtype)], (x,))
        fn, = [msg for msg in session.sent if isinstance(msg, m.DefineFunction) and msg.slice == s.id]
        assert jax.export.deserialize(bytearray(fn.body.blob)).platforms == platforms


def test_accelerator_backends_leave_out_the_proxy_and_are_none_when_jax_platforms_says_cpu(monkeypatch):
    assert not any(name.startswith("pathways") for name in accelerator_backends())
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert accelerator_backends() == []


def test_find_devices_counts_cpu_devices_by_hand_and_asks_jax_for_the_rest(monkeypatch):
    assert find_devices("cpu", 3) == Devices("cpu", "cpu", 3)
    assert find_devices(None, 2) == Devices("cpu", "cpu", 2), "a count without a platform means the CPU"
    # neither, where an accelerator backend is installed: a child process asks JAX, which
    # finds only the CPU on this machine
    monkeypatch.setattr(platforms, "accelerator_backends", lambda: ["jax_cuda12_plugin"])
    assert find_devices(None, None) == Devices("cpu", "cpu", 1)
    # and where none is: the CPU, without a child process
    monkeypatch.setattr(platforms, "accelerator_backends", lambda: [])
    monkeypatch.setattr(platforms.subprocess, "run", lambda *a, **k: pytest.fail("asked JAX in a child process"))
    assert find_devices(None, None) == Devices("cpu", "cpu", 1)
    monkeypatch.undo()
    # a platform JAX cannot start here: the error says what to check
    with pytest.raises(ValueError, match="could not find the devices of --platform tpu on this host.*"
                                         "or pass --platform cpu"):
        find_devices("tpu", None)
