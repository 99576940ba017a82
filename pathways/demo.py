"""``python -m pathways demo``: the Pathways paper's Figure 2 client program."""

from __future__ import annotations

from typing import Optional

import numpy as np

import pathways as pw


def figure2(address: Optional[str] = None, token: Optional[str] = None,
            tls_ca: Optional[str] = None) -> tuple[np.ndarray, np.ndarray]:
    """Run the program on the cluster at ``address`` (see pw.connect for all three)."""
    pw.connect(address, token=token, tls_ca=tls_ca)

    def get_devices(n: int):
        return pw.make_virtual_device_set().add_slice(cpu_devices=n).devices

    a = pw.pmap(lambda x: x * 2.0, devices=get_devices(2))
    b = pw.pmap(lambda x: x + 1.0, devices=get_devices(2))
    c = pw.pmap(lambda x: x / 2.0, devices=get_devices(2))

    @pw.program
    def f(v):
        x = a(v)
        y = b(x)
        z = a(c(x))
        return y, z

    y, z = f(np.array([1.0, 2.0], np.float32))
    y, z = np.asarray(y), np.asarray(z)
    print(y, z)
    pw.disconnect()
    return y, z
