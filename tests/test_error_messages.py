"""Errors a new user meets first say what went wrong and what to do, on a real cluster."""

import jax.numpy as jnp
import numpy as np
import pytest

import pathways as pw


def test_a_dict_of_specs_for_one_dict_argument_says_to_wrap_it_in_a_tuple(session):
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2)
    step = pw.jit(lambda d: d["a"] + d["b"], mesh=s.mesh("x"), in_shardings={"a": pw.P("x"), "b": None})
    x = {"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}
    with pytest.raises(pw.SignatureError, match=r"one-element tuple, in_shardings=\(\{'a'"):
        step(x)
    wrapped = pw.jit(lambda d: d["a"] + d["b"], mesh=s.mesh("x"), in_shardings=({"a": pw.P("x"), "b": None},))
    assert np.asarray(wrapped(x)).tolist() == [2.0] * 4, "the advice works"


@pytest.mark.parametrize("outside", [np.sin, jnp.sin], ids=["np.sin", "jnp.sin"])
def test_a_numpy_or_jax_call_on_a_traced_value_names_the_program(session, outside):
    s = pw.make_virtual_device_set().add_slice(cpu_devices=2)
    double = pw.pmap(lambda x: x * 2.0, devices=s.devices)

    @pw.program
    def my_step(v):
        return outside(double(v))

    with pytest.raises(pw.ProgramTraceError, match="^program my_step.*compiled function"):
        my_step(np.ones(2, np.float32))


def test_a_gpu_slice_on_a_cpu_cluster_says_workers_have_cpus_only(session):
    with pytest.raises(pw.PlacementError, match="no worker has gpu devices") as info:
        pw.make_virtual_device_set().add_slice(gpu_devices=1)
    assert "python -m pathways worker" in str(info.value) and "--platform" in str(info.value)
    assert "cpu_devices=" in str(info.value)


def test_a_slice_larger_than_a_remote_cluster_says_what_fits_and_how_to_see_the_cluster(session):
    with pytest.raises(pw.PlacementError) as info:  # a client of a cluster it did not start
        pw.make_virtual_device_set().add_slice(cpu_devices=16)
    message = str(info.value)
    assert "island 0: up to 4 on one host, or 8 over 2 hosts (4 each)" in message
    assert "python -m pathways status" in message and "local_cluster" not in message


def test_a_slice_larger_than_a_local_cluster_suggests_starting_it_larger():
    with pw.local_cluster(hosts=1, devices_per_host=1):
        with pytest.raises(pw.PlacementError) as info:
            pw.make_virtual_device_set().add_slice(cpu_devices=2)
    assert "island 0: up to 1 on one host" in str(info.value)
    assert "pw.local_cluster(islands=[pw.Island(hosts=H, devices_per_host=D)])" in str(info.value)
