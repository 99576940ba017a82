"""JAX platforms and the device kinds slices ask for.

A worker runs one JAX platform (``--platform cpu|cuda|rocm|tpu``, or whichever JAX finds)
and reports its devices' kind: cpu, gpu (CUDA and ROCm alike) or tpu. Clients ask for a kind
(``add_slice(gpu_devices=n)``) and export each function for the platforms that kind may
run on, so that a CPU-only client can compile for accelerator workers.
"""

from __future__ import annotations

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
