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
