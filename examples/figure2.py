"""The client program of the Pathways paper (Barham et al., MLSys 2022, Figure 2).

Three compiled functions on three virtual slices of two devices, traced into one program.
With no cluster address, pw.connect() (called implicitly) starts an embedded local cluster:
a controller and two worker processes. Prints ``[3. 5.] [2. 4.]``.
"""

import numpy as np

import pathways as pw


def get_devices(n):
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
print(np.asarray(y), np.asarray(z))
