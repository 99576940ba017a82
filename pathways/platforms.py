"""JAX platforms and the device kinds slices ask for.

A worker runs one JAX platform (``--platform cpu|cuda|rocm|tpu``, or whichever JAX finds)
and reports its devices' kind: cpu, gpu (CUDA and ROCm alike) or tpu. Clients ask for a kind
(``add_slice(gpu_devices=n)``) and export each function for the platforms that kind may
run on, so that a CPU-only client can compile for accelerator workers.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pkgutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from pathways.errors import PlacementError

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

# jax's Device.platform is "gpu" for CUDA and ROCm devices; jax_platforms names them apart.
_KINDS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}

# What jax.export lowers a function of a slice of that kind for; a GPU worker runs either.
EXPORT_PLATFORMS = {"cpu": ("cpu",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}

# How to choose which accelerators a worker uses, since --devices counts CPU devices only.
_VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "rocm": "ROCR_VISIBLE_DEVICES", "tpu": "TPU_VISIBLE_CHIPS"}


def kind_of(platform: str) -> str:
    """The device kind (cpu, gpu, tpu) of a JAX platform name or a Device.platform."""
    try:
        return _KINDS[platform.lower()]
    except KeyError:
        raise ValueError(f"JAX platform {platform!r} is not one pathways workers serve; start the worker with "
                         f"--platform {'|'.join(PLATFORMS)}") from None


def export_platforms(kind: str) -> tuple[str, ...]:
    """The platforms a function for a slice of ``kind`` devices is exported for."""
    try:
        return EXPORT_PLATFORMS[kind]
    except KeyError:
        raise PlacementError(f"unknown device kind {kind!r}; slices hold cpu, gpu or tpu devices") from None


def cpu_devices(platform: Optional[str], devices: Optional[int]) -> int:
    """The number of CPU devices a worker makes (``--devices``; 1 by default), refusing a
    count with an accelerator platform, whose devices are those JAX finds on the host."""
    if devices is not None and platform not in (None, "cpu"):
        raise ValueError(f"--devices sets the number of virtual CPU devices; with --platform {platform} the "
                         f"worker serves the devices JAX finds on the host (choose them with "
                         f"{_VISIBLE[platform]}): drop --devices")
    if devices is not None and devices < 1:
        raise ValueError(f"--devices must be at least 1, got {devices}")
    return 1 if devices is None else devices


@dataclass(frozen=True)
class Devices:
    """What a worker serves: a JAX platform (for ``jax_platforms``), its device kind and how
    many devices of it this host has."""

    platform: str
    kind: str
    count: int


def accelerator_backends() -> list[str]:
    """The accelerator backends JAX could start here, found without starting JAX: its
    plugins (``jax_plugins`` modules and entry points, this package's IFRT proxy aside) and
    libtpu; none when JAX_PLATFORMS asks for the CPU alone."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return []
    found = [e.value for e in importlib.metadata.entry_points(group="jax_plugins")
             if e.value.split(".")[0] != __name__.split(".")[0]]
    namespace = importlib.util.find_spec("jax_plugins")
    if namespace is not None and namespace.submodule_search_locations:
        found += [m.name for m in pkgutil.iter_modules(namespace.submodule_search_locations)]
    if importlib.util.find_spec("libtpu") is not None:
        found.append("libtpu")
    return found


# Run by ``find_devices`` in a child process: which platform JAX picks here, and its devices.
_PROBE = """
import json, jax
d = jax.devices()[0]
name = d.platform
if name == "gpu":  # jax_platforms names CUDA and ROCm apart
    name = "rocm" if "rocm" in d.client.platform_version.lower() else "cuda"
print(json.dumps([name, jax.local_device_count()]))
"""


def find_devices(platform: Optional[str], devices: Optional[int], timeout: float = 120.0) -> Devices:
    """The devices a worker serves: ``devices`` virtual CPU devices (default 1) for the CPU
    (a count given without a platform means the CPU: only CPU devices are counted by hand);
    for an accelerator platform, or when neither is given (whichever JAX finds), what a
    child process finds, unless no accelerator backend is installed. The worker itself
    must not start JAX's backends before it joins its island's jax.distributed group,
    which comes after it registers these figures."""
    count = cpu_devices(platform, devices)
    if platform == "cpu" or (platform is None and (devices is not None or not accelerator_backends())):
        return Devices("cpu", "cpu", count)
    env = {**os.environ, **({"JAX_PLATFORMS": platform} if platform else {})}
    what = f"--platform {platform}" if platform else "a JAX platform"
    advice = "check the accelerator's JAX plugin, or pass --platform cpu"
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ValueError(f"finding the devices of {what} on this host took over {timeout:g} s; {advice}") from None
    try:
        found, found_count = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        lines = done.stderr.strip().splitlines()  # the last is the exception that ended the child
        why = lines[-1][-500:] if lines else f"exit code {done.returncode}"
        raise ValueError(f"could not find the devices of {what} on this host ({why}); {advice}") from None
    if found == "cpu":
        return Devices("cpu", "cpu", count)
    return Devices(found, kind_of(found), found_count)
