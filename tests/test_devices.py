"""The test process has 8 fake CPU devices, and a quantized linear runs data-parallel over them."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_w4a4


def test_eight_fake_cpu_devices():
    assert len(jax.devices("cpu")) == 8


def test_linear_data_parallel_over_eight_devices(rng):
    w = jnp.asarray(rng.standard_normal((256, 512)) * 0.05, jnp.float32)
    weights = jax_w4a4.quantize_linear(w, mode="svdq-int4", rank=16)
    x = jnp.asarray(rng.standard_normal((16, 512)), jnp.bfloat16)
    mesh = Mesh(np.array(jax.devices("cpu")), ("data",))
    x_sharded = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    y = jax.jit(jax_w4a4.linear)(x_sharded, weights)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(jax_w4a4.linear(x, weights), np.float32))
