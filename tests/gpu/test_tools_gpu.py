"""GPU tests of the library's benchmark tools (FFI targets that are not ops): the device clock and the
stream peer. Run on the GPU machine (benchmarks/gpu_check.sh); skipped elsewhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import harness
from jax_w4a4.ops import _library

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _tools():
    if not (_library.register_tool_target(harness.DEVICE_CLOCK) and _library.register_tool_target(harness.STREAM_PEER)):
        pytest.skip("needs the CUDA library on a GPU")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(1, 8192), (333, 4096), (2, 3, 1040)])
def test_stream_peer_writes_the_high_byte_of_every_value(dtype, shape):
    x = jax.random.normal(jax.random.key(sum(shape)), shape, jnp.float32).astype(dtype)
    jax.block_until_ready(jnp.full(shape, 0xA5, jnp.uint8))  # freed poison the output buffer then reuses
    out = jax.jit(harness.stream_peer)(x)
    expected = (np.asarray(x).view(np.uint16) >> 8).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_stream_peer_rejects_sizes_it_cannot_stream():
    with pytest.raises(Exception, match="multiple of 16 values"):
        jax.block_until_ready(jax.jit(harness.stream_peer)(jnp.ones((3, 100), jnp.bfloat16)))


def test_device_clock_advances_over_a_chain():
    seconds = harness.time_jax(lambda x: x * 2, [(jnp.ones((1024, 1024), jnp.float32),)], calls=4, trials=3)
    assert 0 < seconds < 1e-2
