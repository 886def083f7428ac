"""The primitives: trace-time validation, jit / vmap / export, and the golden CUDA lowering."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_w4a4
from jax_w4a4 import budget, ops, reference
from jax_w4a4.formats import svdq, svdq_layout, w4a16, w4a16_layout
from jax_w4a4.ops import _library

BF16 = jnp.bfloat16
N, K, R = 128, 256, 16


def _operands(rng, lead=(4,), act_format="int4"):
    x = jnp.asarray(rng.standard_normal((*lead, K)), BF16)
    smooth = jnp.asarray(rng.uniform(0.5, 2, K), jnp.float32)
    lora_down = jnp.asarray(rng.standard_normal((K, R)) * 0.1, BF16)
    qweight, wscales = svdq.quantize_weights(jnp.asarray(rng.standard_normal((N, K)), jnp.float32), scale_dtype=BF16)
    qweight, wscales = svdq_layout.prepack(qweight), svdq_layout.prepack_scales(wscales)
    lora_up = jnp.asarray(rng.standard_normal((R, N)) * 0.1, BF16)
    return x, smooth, lora_down, qweight, wscales, lora_up


def _w4a16_operands(rng, lead=(4,), group_size=64):
    x = jnp.asarray(rng.standard_normal((*lead, K)), BF16)
    q = w4a16.quantize(jnp.asarray(rng.standard_normal((N, K)), jnp.float32), group_size=group_size,
                       zero_point=True, scale_dtype=BF16)
    return x, w4a16_layout.prepack(q.qweight), w4a16_layout.prepack_scales(q.scales), w4a16_layout.prepack_scales(q.zeros)


def _w4a4(x, smooth, lora_down, qweight, wscales, lora_up, act_format="int4", alpha=None, bias=None):
    q, s, la = ops.act_quant(x, smooth, lora_down, act_format=act_format)
    return ops.w4a4_gemm(q, s, la, qweight, wscales, lora_up, alpha, bias, act_format=act_format)


# ---------------------------------------------------------------------------------------------- errors

def _bad_inputs(rng):
    x, smooth, ld, qw, ws, lu = _operands(rng)
    xw, qw16, s16, z16 = _w4a16_operands(rng)
    q, s, la = ops.act_quant(x, smooth, ld, act_format="int4")
    gemm = functools.partial(ops.w4a4_gemm, act_format="int4")
    aq = functools.partial(ops.act_quant, act_format="int4")
    lin = functools.partial(ops.w4a4_linear, act_format="int4")
    g16 = functools.partial(ops.w4a16_gemm, group_size=64)
    return [
        (lambda: ops.act_quant(x, smooth, ld, act_format="int2"), r"act_format must be one of"),
        (lambda: aq(x.astype(jnp.float32), smooth, ld), r"x must have dtype bfloat16 or float16, got float32"),
        (lambda: aq(x[..., :200], smooth[:200], ld[:200]), r"x.shape\[-1\] \(K\) must be a multiple of 64"),
        (lambda: ops.act_quant(x[..., :192], smooth[:192], ld[:192], act_format="fp8"), r"multiple of 128 for act_format='fp8'"),
        (lambda: aq(x, smooth[:128], ld), r"smooth must have shape \(256,\), got \(128,\)"),
        (lambda: aq(x, smooth.astype(BF16), ld), r"smooth must have dtype float32"),
        (lambda: aq(x, smooth, ld[:, :8]), r"rank r\) must be a multiple of 16"),
        (lambda: aq(x, smooth, ld.astype(jnp.float16)), r"lora_down must have dtype bfloat16"),
        (lambda: gemm(q, s, la, qw.astype(jnp.int8), ws, lu), r"qweight must have dtype uint8"),
        (lambda: gemm(q, s, la, svdq_layout.unprepack(qw, N, K), ws, lu), r"qweight \(prepacked, formats.svdq_layout\) must have shape \(2, 4, 2048\)"),
        (lambda: gemm(q, s, la, qw, ws[:1], lu), r"qweight \(prepacked, formats.svdq_layout\) must have shape \(2, 2, 2048\)"),
        (lambda: gemm(q, s, la, qw, svdq_layout.unprepack_scales(ws), lu), r"wscales \(prepacked, formats.svdq_layout.prepack_scales\) must be 3-D, got shape \(128, 4\)"),
        (lambda: gemm(q, s, la, qw, ws.reshape(2, 64, 4), lu), r"wscales \(prepacked, formats.svdq_layout.prepack_scales\) must have shape \(2, 64, 2\)"),
        (lambda: gemm(q[..., :192], s[..., :3], la, qw, ws, lu), r"q_x must have shape \(4, 256\), got \(4, 192\)"),
        (lambda: gemm(q, s, la, qw, ws.astype(jnp.float32), lu), r"wscales must have dtype bfloat16 or float16"),
        (lambda: gemm(q[:2], s, la, qw, ws, lu), r"s_x must have leading dims \(2,\)"),
        (lambda: gemm(q, s, la, qw, ws, lu[:, :64]), r"lora_up must have shape \(16, 128\)"),
        (lambda: gemm(q, s, la[:, :0], qw, ws, lu), r"la must have shape \(4, 16\)"),
        (lambda: gemm(q, s, la, qw, ws, lu, alpha=jnp.ones(N, BF16)), r"alpha must have dtype float32"),
        (lambda: gemm(q, s, la, qw, ws, lu, bias=jnp.ones(64, BF16)), r"bias must have shape \(128,\)"),
        (lambda: ops.w4a4_gemm(q, s, la, qw, ws, lu, act_format="fp8"), r"s_x must have shape \(4, 2\)"),
        (lambda: gemm(q[..., :128], s, la, qw, ws, lu), r"q_x must have shape \(4, 256\)"),
        (lambda: lin(x.astype(jnp.float32), smooth, ld, qw, ws, lu), r"w4a4_linear: x must have dtype bfloat16 or float16"),
        (lambda: lin(x, smooth, ld[:, :8], qw, ws, lu), r"w4a4_linear: lora_down.shape\[1\] \(the low-rank rank r\) must be a multiple of 16"),
        (lambda: lin(x, smooth, ld, qw, ws.astype(jnp.float16), lu), r"w4a4_linear: wscales \(the output dtype\) must have dtype bfloat16"),
        (lambda: lin(x, smooth, ld, qw[:1], ws, lu), r"w4a4_linear: qweight \(prepacked, formats.svdq_layout\) must have shape \(2, 4, 2048\)"),
        (lambda: lin(x, smooth, ld, qw, ws, lu[:, :64]), r"w4a4_linear: lora_up must have shape \(16, 128\)"),
        (lambda: lin(x, smooth, ld, qw, ws, lu, bias=jnp.ones(64, BF16)), r"w4a4_linear: bias must have shape \(128,\)"),
        (lambda: g16(xw, qw16, s16, z16, group_size=48), r"group_size must be one of"),
        (lambda: g16(xw, qw16, s16.astype(jnp.float16), z16), r"scales must have dtype bfloat16"),
        (lambda: g16(xw, qw16, s16, z16[:1]), r"zeros must have shape \(4, 128\)"),
        (lambda: g16(xw, qw16, s16, z16, g_idx=jnp.zeros(K, jnp.int64 if jax.config.x64_enabled else jnp.float32)), r"g_idx must have dtype int32"),
        (lambda: g16(xw[..., :128], qw16, s16, z16), r"scales must have shape \(2, 128\)"),
        (lambda: g16(xw, qw16, s16.T, z16), r"scales \(128, 4\) look like the logical \(N, K/G\) layout.*prepack_scales"),
    ]


def test_bad_inputs_raise_value_error_naming_the_argument(rng):
    cases = _bad_inputs(rng)
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            jax.jit(fn).trace()


# ---------------------------------------------------------------------------------------------- transforms

def test_eager_jit_and_reference_agree(rng):
    args = _operands(rng)
    eager = _w4a4(*args)
    jitted = jax.jit(_w4a4)(*args)
    x, smooth, lora_down, qweight, wscales, lora_up = args
    q, s, la = reference.act_quant(x, smooth, lora_down, act_format="int4")
    ref = reference.w4a4_gemm(q, s, la, svdq_layout.unprepack(qweight, N, K), svdq_layout.unprepack_scales(wscales),
                              lora_up, act_format="int4")
    np.testing.assert_array_equal(np.asarray(eager, np.float32), np.asarray(ref, np.float32))
    np.testing.assert_array_equal(np.asarray(jitted, np.float32), np.asarray(ref, np.float32))


@pytest.mark.parametrize("act_format", ["int4", "fp8"])
def test_vmap_over_activations_matches_leading_dims(rng, act_format):
    x, smooth, ld, qw, ws, lu = _operands(rng, lead=(3, 5))
    f = functools.partial(_w4a4, act_format=act_format)
    whole = f(x, smooth, ld, qw, ws, lu)
    mapped = jax.vmap(f, in_axes=(1, None, None, None, None, None), out_axes=1)(x, smooth, ld, qw, ws, lu)
    np.testing.assert_array_equal(np.asarray(mapped, np.float32), np.asarray(whole, np.float32))


def test_vmap_over_stacked_weights(rng):
    layers = [_operands(rng) for _ in range(3)]
    x = layers[0][0]
    stacked = [jnp.stack(parts) for parts in zip(*layers)]
    mapped = jax.vmap(_w4a4, in_axes=(None, 0, 0, 0, 0, 0))(x, *stacked[1:])
    for i, (_, smooth, ld, qw, ws, lu) in enumerate(layers):
        np.testing.assert_array_equal(np.asarray(mapped[i], np.float32), np.asarray(_w4a4(x, smooth, ld, qw, ws, lu), np.float32))


@pytest.mark.parametrize("act_format", ["int4", "uint4", "fp8"])
def test_w4a4_linear_is_act_quant_then_w4a4_gemm(rng, act_format):
    """The fused op equals the two ops in sequence, bit for bit: eager, jitted, vmapped over tokens and over
    stacked weights."""
    x, smooth, ld, qw, ws, lu = _operands(rng, lead=(3, 5))
    alpha = jnp.asarray(rng.uniform(0.5, 1.5, N), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(N), BF16)
    fused = functools.partial(ops.w4a4_linear, act_format=act_format)
    apart = _w4a4(x, smooth, ld, qw, ws, lu, act_format=act_format, alpha=alpha, bias=bias)
    same = functools.partial(np.testing.assert_array_equal, np.asarray(apart, np.float32))
    same(np.asarray(fused(x, smooth, ld, qw, ws, lu, alpha, bias), np.float32))
    same(np.asarray(jax.jit(fused)(x, smooth, ld, qw, ws, lu, alpha, bias), np.float32))
    tokens = jax.vmap(fused, in_axes=(1, None, None, None, None, None, None, None), out_axes=1)
    same(np.asarray(tokens(x, smooth, ld, qw, ws, lu, alpha, bias), np.float32))
    layers = jax.vmap(fused, in_axes=(None, 0, 0, 0, 0, 0, 0, 0))
    stacked = [jnp.stack([a, a]) for a in (smooth, ld, qw, ws, lu, alpha, bias)]
    np.testing.assert_array_equal(np.asarray(layers(x, *stacked)[1], np.float32), np.asarray(apart, np.float32))


def test_w4a4_linear_lowering_returns_act_quants_outputs_and_both_workspaces(rng):
    """One FFI call with act_quant's (q, scales, la), act_quant's workspace and the GEMM's as extra results
    that XLA allocates; the primitive returns only y."""
    m, n, k, r = 1, 1024, 17408, 32  # 8 column tiles x 136 k-stages at one token: stream-K on 132 SMs
    x = jnp.asarray(rng.standard_normal((m, k)), BF16)
    smooth = jnp.ones((k,), jnp.float32)
    lora_down = jnp.asarray(rng.standard_normal((k, r)), BF16)
    qw, ws = svdq.quantize_weights(jnp.asarray(rng.standard_normal((n, k)), jnp.float32), scale_dtype=BF16)
    lora_up = jnp.asarray(rng.standard_normal((r, n)), BF16)
    lowered = jax.jit(functools.partial(ops.w4a4_linear, act_format="int4")).trace(
        x, smooth, lora_down, svdq_layout.prepack(qw), svdq_layout.prepack_scales(ws), lora_up
    ).lower(lowering_platforms=("cuda",))
    sms = _library.cuda_sm_count()
    act_quant_bytes = budget.act_quant_launch(m, k, r, num_sms=sms).workspace_bytes
    gemm_bytes = budget.w4a4_workspace_bytes(m, n, k, num_sms=sms)
    assert act_quant_bytes > 0 and gemm_bytes > 0
    results = (f"-> (tensor<{m}x{n}xbf16>, tensor<{m}x{k}xui8>, tensor<{m}x{k // 64}xbf16>, tensor<{m}x{r}xf32>, "
               f"tensor<{act_quant_bytes}xui8>, tensor<{gemm_bytes}xui8>)")
    assert results in lowered.as_text()
    assert lowered.out_info.shape == (m, n)


def test_vmap_w4a16(rng):
    x, qw, s, z = _w4a16_operands(rng, lead=(2, 3))
    f = functools.partial(ops.w4a16_gemm, group_size=64)
    whole = f(x, qw, s, z)
    mapped = jax.vmap(f, in_axes=(1, None, None, None), out_axes=1)(x, qw, s, z)
    np.testing.assert_array_equal(np.asarray(mapped, np.float32), np.asarray(whole, np.float32))


# ---------------------------------------------------------------------------------------------- lowering

def _op_calls(rng):
    x, smooth, ld, qw, ws, lu = _operands(rng)
    q, s, la = ops.act_quant(x, smooth, ld, act_format="uint4")
    xw, qw16, s16, z16 = _w4a16_operands(rng)
    return {
        "act_quant": (
            functools.partial(ops.act_quant, act_format="uint4"),
            (x, smooth, ld),
            f'act_format = "uint4", num_sms = {_library.cuda_sm_count()} : i64',
        ),
        "w4a4_gemm": (
            functools.partial(ops.w4a4_gemm, act_format="uint4"),
            (q, s, la, qw, ws, lu),
            f'act_format = "uint4", num_sms = {_library.cuda_sm_count()} : i64',
        ),
        "w4a4_linear": (
            functools.partial(ops.w4a4_linear, act_format="uint4"),
            (x, smooth, ld, qw, ws, lu),
            f'act_format = "uint4", num_sms = {_library.cuda_sm_count()} : i64',
        ),
        "w4a16_gemm": (
            functools.partial(ops.w4a16_gemm, group_size=64),
            (xw, qw16, s16, z16),
            f"group_size = 64 : i64, num_sms = {_library.cuda_sm_count()} : i64",
        ),
    }


@pytest.mark.parametrize("op", [o.name for o in ops.ALL_OPS])
def test_cuda_lowering_golden_or_not_implemented(rng, op):
    """The CUDA lowering is a typed-FFI custom call: in jax 0.11's StableHLO that is api_version 1 with the
    attributes in a ``mhlo.backend_config`` dictionary (XLA turns it into API_VERSION_TYPED_FFI)."""
    fn, args, attribute = _op_calls(rng)[op]
    lowered = lambda: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))  # noqa: E731
    if op not in _library.CUDA_KERNELS:
        with pytest.raises(NotImplementedError, match=f"jax_w4a4.{op}: no CUDA kernel"):
            lowered()
        return
    generic = lowered().compiler_ir("stablehlo").operation.get_asm(print_generic_op_form=True)
    calls = re.findall(r'"stablehlo.custom_call"\(.*', generic)
    ours = [c for c in calls if f'call_target_name = "jax_w4a4_{op}"' in c]
    assert len(ours) == 1, calls
    assert "api_version = 1 : i32" in ours[0]
    assert f"mhlo.backend_config = {{{attribute}}}" in ours[0]


def test_w4a16_lowering_adds_an_xla_allocated_workspace(rng):
    """w4a16's split-K / act-order scratch is a second FFI result of the size the launch plan needs (so
    the call can be captured in a CUDA graph); the primitive still returns only y."""
    n, k = 14336, 1024  # split over K: too many rows for one wave of narrow CTAs (w4a16_gemm_plan.h)
    q = w4a16.quantize(jnp.asarray(rng.standard_normal((n, k)), jnp.float32), group_size=64, zero_point=True,
                       scale_dtype=BF16)
    qw, s, z = w4a16_layout.prepack(q.qweight), w4a16_layout.prepack_scales(q.scales), w4a16_layout.prepack_scales(q.zeros)
    for m in (4, 64):
        xm = jnp.asarray(rng.standard_normal((m, k)), BF16)
        lowered = jax.jit(functools.partial(ops.w4a16_gemm, group_size=64)).trace(xm, qw, s, z).lower(
            lowering_platforms=("cuda",)
        )
        text = lowered.as_text()
        expected = budget.w4a16_workspace_bytes(m, n, k, 64, act_order=False, num_sms=_library.cuda_sm_count())
        assert expected > 0  # this small layer is split over K
        assert f"-> (tensor<{m}x{n}xbf16>, tensor<{expected}xui8>)" in text
        assert lowered.out_info.shape == (m, n)


def test_act_quant_lowering_adds_an_xla_allocated_workspace(rng):
    """act_quant's K-split LA partials and tickets are a fourth FFI result sized by the launch plan; the
    primitive still returns (q, scales, la)."""
    k, r = 4096, 32
    smooth = jnp.ones((k,), jnp.float32)
    lora_down = jnp.asarray(rng.standard_normal((k, r)), jnp.bfloat16)
    for m in (1, 4096):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        lowered = jax.jit(functools.partial(ops.act_quant, act_format="int4")).trace(x, smooth, lora_down).lower(
            lowering_platforms=("cuda",)
        )
        expected = budget.act_quant_launch(m, k, r, num_sms=_library.cuda_sm_count()).workspace_bytes
        assert expected > 0  # both are split over K with a low-rank branch
        assert f"tensor<{m}x{r}xf32>, tensor<{expected}xui8>)" in lowered.as_text()
        assert [o.shape for o in lowered.out_info] == [(m, k), (m, k // 64), (m, r)]


def test_op_without_a_kernel_fails_at_lowering_not_at_run_time(rng, monkeypatch):
    """The mechanism for ops whose kernel is not written yet: NotImplementedError while lowering for CUDA."""
    monkeypatch.setattr(_library, "CUDA_KERNELS", {k: v for k, v in _library.CUDA_KERNELS.items() if k != "w4a16_gemm"})
    fn, args, _ = _op_calls(rng)["w4a16_gemm"]
    with pytest.raises(NotImplementedError, match="jax_w4a4.w4a16_gemm: no CUDA kernel in this version"):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def test_cpu_lowering_has_no_custom_call(rng):
    for op, (fn, args, _) in _op_calls(rng).items():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
        assert "custom_call @jax_w4a4" not in text, op


# ---------------------------------------------------------------------------------------------- export

def _platforms():
    have_all = all(o.name in _library.CUDA_KERNELS for o in ops.ALL_OPS)
    return ("cpu", "cuda") if have_all else ("cpu",)


def test_export_round_trip(rng):
    args = _operands(rng)
    exported = jax.export.export(
        jax.jit(_w4a4), platforms=_platforms(), disabled_checks=jax_w4a4.export_safety_checks()
    )(*args)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(np.asarray(restored.call(*args), np.float32), np.asarray(_w4a4(*args), np.float32))


def test_library_table_matches_the_binary():
    """Every op the Python side lowers to CUDA is compiled into the library, and nothing else."""
    if _library.load() is None:
        pytest.skip("the CUDA library is not built here (no nvcc at install time)")
    ops_and_tools = {_library.target_name(op) for op in _library.CUDA_KERNELS} | set(_library.TOOL_TARGETS)
    assert set(_library.compiled_targets()) == ops_and_tools


def test_w4a4_lowering_adds_the_stream_k_workspace():
    """w4a4's stream-K partials are a second FFI result of the size the launch plan needs (decode shapes
    whose column tiles do not divide over the SMs); other launches get an empty one."""
    n, k, r = 1024, 17408, 32  # 8 column tiles x 136 k-stages: stream-K at M <= 64 on 132 SMs
    sds = jax.ShapeDtypeStruct
    weights = (sds(svdq_layout.prepacked_shape(n, k), jnp.uint8), sds(svdq_layout.prepacked_scales_shape(n, k), BF16),
               sds((r, n), BF16))
    sizes = {}
    for m in (1, 128):
        tokens = (sds((m, k), jnp.uint8), sds((m, k // 64), BF16), sds((m, r), jnp.float32))
        lowered = jax.jit(functools.partial(ops.w4a4_gemm, act_format="int4")).trace(*tokens, *weights).lower(
            lowering_platforms=("cuda",)
        )
        sizes[m] = budget.w4a4_workspace_bytes(m, n, k, num_sms=_library.cuda_sm_count())
        assert f"-> (tensor<{m}x{n}xbf16>, tensor<{sizes[m]}xui8>)" in lowered.as_text()
        assert lowered.out_info.shape == (m, n)
    assert sizes[1] > 0 and sizes[128] == 0
