"""An independent NumPy (float64) statement of the numeric contract, written from docs/layouts.md.

It shares no code with jax_w4a4: the tests check the JAX reference against it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Values in −8..15 -> uint8, element 2i in the low nibble."""
    nib = (q.astype(np.int64) & 0xF).astype(np.uint8)
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def unpack_nibbles(packed: np.ndarray, signed: bool) -> np.ndarray:
    lo = (packed & 0xF).astype(np.int64)
    hi = (packed >> 4).astype(np.int64)
    q = np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return np.where(q >= 8, q - 16, q) if signed else q


def e4m3_codes(values: np.ndarray) -> np.ndarray:
    """Values exactly representable in float8_e4m3fn → their uint8 codes (asserting exactness)."""
    codes = np.asarray(values, np.float32).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(codes.astype(np.float64), np.asarray(values, np.float64)), "not exact in e4m3"
    return codes.view(np.uint8)


def group_scale(x: np.ndarray, group: int, divisor: float, scale_dtype) -> np.ndarray:
    """absmax(group) / divisor rounded to scale_dtype, returned as float32."""
    g = x.reshape(*x.shape[:-1], -1, group)
    return (np.abs(g).max(-1).astype(np.float32) / np.float32(divisor)).astype(scale_dtype).astype(np.float32)


def quantize_int4(x_hat: np.ndarray, scale_dtype, unsigned: bool) -> tuple[np.ndarray, np.ndarray]:
    """svdq activations/weights: (q values, scales float32). IEEE fp32 division by the rounded scale."""
    x_hat = x_hat.astype(np.float32)
    scales = group_scale(x_hat, 64, 15.0 if unsigned else 7.0, scale_dtype)
    s = np.repeat(scales, 64, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s == 0, 0, np.rint(x_hat / np.where(s == 0, 1, s)))
    lo, hi = (0, 15) if unsigned else (-8, 7)
    return np.clip(q, lo, hi).astype(np.int64), scales


def quantize_fp8(x_hat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w4a8 activations: (e4m3 values as float64, fp32 scales)."""
    x_hat = x_hat.astype(np.float32)
    g = x_hat.reshape(*x_hat.shape[:-1], -1, 128)
    scales = np.abs(g).max(-1).astype(np.float32) / np.float32(448.0)
    s = np.repeat(scales, 128, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(s == 0, 0, x_hat / np.where(s == 0, 1, s)).astype(np.float32)
    return np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64), scales


def w4a4_gemm(
    x_values: np.ndarray,
    x_scales: np.ndarray,
    x_group: int,
    q_w: np.ndarray,
    s_w: np.ndarray,
    la: np.ndarray,
    lora_up: np.ndarray,
    out_dtype,
    alpha: np.ndarray | None = None,
    bias: np.ndarray | None = None,
) -> np.ndarray:
    """float64 Y = α ⊙ (X_deq · W_deqᵀ) + out_dtype(LA) · L_up + β (before the output rounding)."""
    x_deq = x_values.astype(np.float64) * np.repeat(x_scales.astype(np.float64), x_group, axis=-1)
    w_deq = q_w.astype(np.float64) * np.repeat(s_w.astype(np.float64), 64, axis=-1)
    y = x_deq @ w_deq.T
    if alpha is not None:
        y = y * alpha.astype(np.float64)
    la_rounded = la.astype(np.float32).astype(out_dtype).astype(np.float64)
    y = y + la_rounded @ lora_up.astype(np.float64)
    if bias is not None:
        y = y + bias.astype(np.float64)
    return y


def w4a16_dequantize(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, g_idx: np.ndarray) -> np.ndarray:
    """Ŵ[n,k] = (q[n,k] − z[n,g(k)]) · s[n,g(k)] in float64; q, zeros are 0..15 values, g_idx (K,)."""
    z = 8.0 if zeros is None else zeros[:, g_idx].astype(np.float64)
    return (q.astype(np.float64) - z) * scales[:, g_idx].astype(np.float64)


def la_rounding_slack(x: np.ndarray, lora_down: np.ndarray, lora_up: np.ndarray, out_dtype) -> np.ndarray:
    """How far Y may move because out_dtype(LA) rounds the other way: LA = X·L_down is summed in fp32, in
    an order this spec does not fix, so an entry whose float64 value lies within the fp32 summation error
    (4·sqrt(K)·2^-24·Σ|x·l|, a generous statistical bound) of a rounding boundary may round either way."""
    x64, down64 = np.asarray(x, np.float64), np.asarray(lora_down, np.float64)
    la = x64 @ down64
    delta = 4 * np.sqrt(x64.shape[-1]) * 2.0**-24 * (np.abs(x64) @ np.abs(down64))
    low = (la - delta).astype(np.float32).astype(out_dtype).astype(np.float64)
    high = (la + delta).astype(np.float32).astype(out_dtype).astype(np.float64)
    return np.abs(high - low) @ np.abs(np.asarray(lora_up, np.float64))


def assert_close_to_rounded(y: np.ndarray, y64: np.ndarray, out_dtype, ulps: float = 1.0, extra_slack=0.0) -> None:
    """y (in out_dtype) is within `ulps` output ulps of the float64 value, plus fp32-accumulation slack and
    `extra_slack` (e.g. la_rounding_slack, elementwise)."""
    y = np.asarray(y, dtype=np.float64)
    eps = float(ml_dtypes.finfo(out_dtype).eps)
    slack = 1e-5 * np.sqrt(np.mean(y64**2))
    bound = ulps * eps * np.abs(y64) + slack + extra_slack
    bad = np.abs(y - y64) > bound
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} elements off by more than {ulps} ulp; worst "
        f"{np.max(np.abs(y - y64) - bound):.3g} over the bound"
    )
