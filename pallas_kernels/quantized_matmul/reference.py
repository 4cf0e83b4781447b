"""Weight-only quantized matmul: the weight format, quantization, and the jnp reference.

Storage format (`QuantizedWeights`), chosen for the kernels:

* values are stored output-major, `[N, Kp]` (int8 / float8_e4m3fn) or `[N, Kp // 2]` (int4 packed
  in uint8). Output-major lets the GPU kernel feed a weight tile straight to the tensor cores as the
  *left* operand (`y^T = W^T x^T`), so the few activation rows of decode become the narrow wgmma N
  dimension instead of a 64-row tile padded from 1 row; grouping and int4 packing run along the
  contiguous K axis.
* K is zero-padded at quantization time to `Kp`, a multiple of 128 (and of the group size), so the
  kernels never see a ragged K block; activations are zero-padded to match at call time.
* scales are `[Kp // group_size, N]` fp32: one row per K group (a single row for per-channel), laid
  out with N last so a kernel multiplies a `[M, N]` partial product by one broadcast row.
* int4 packing: inside every 128-wide chunk of K, byte j holds element j in its low nibble and
  element j + 64 in its high nibble, each stored as q + 8 (q in -7..7). Unpacking a chunk is then
  two whole half-chunks, no interleave, which both kernels do in registers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

PACK_CHUNK = 128  # K elements per int4 packing chunk; also the K padding granule
_INT_MAX = {8: 127.0, 4: 7.0}
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["values", "scales"],
                   meta_fields=["bits", "group_size", "in_features", "fp8"])
@dataclasses.dataclass(frozen=True)
class QuantizedWeights:
    """A [K, N] weight matrix in quantized form (see the module docstring for the layout)."""

    values: jax.Array  # [N, Kp] int8 | float8_e4m3fn, or [N, Kp // 2] uint8 (int4)
    scales: jax.Array  # [Kp // group_size, N] float32
    bits: int  # 8 or 4
    group_size: int  # K elements per scale (Kp for per-channel)
    in_features: int  # K before padding
    fp8: bool = False  # values are float8_e4m3fn (bits == 8)

    @property
    def padded_in_features(self) -> int:
        return self.values.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def out_features(self) -> int:
        return self.values.shape[0]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _check_args(w: jax.Array, bits: int, group_size: int | None, fp8: bool) -> None:
    if w.ndim != 2:
        raise ValueError(f"w must be [K, N], got shape {w.shape}")
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if fp8 and (bits != 8 or group_size is not None):
        raise ValueError("fp8 weights are 8-bit with one scale per output channel (group_size=None)")
    if group_size is not None and (group_size <= 0 or group_size % PACK_CHUNK):
        raise ValueError(f"group_size must be a positive multiple of {PACK_CHUNK}, got {group_size}")


def pack_int4(q: jax.Array) -> jax.Array:
    """[N, Kp] int8 in -8..7 -> [N, Kp // 2] uint8, chunk-halves layout (module docstring)."""
    n, kp = q.shape
    u = (q + 8).astype(jnp.uint8).reshape(n, kp // PACK_CHUNK, 2, PACK_CHUNK // 2)  # [N, C, 2, 64]
    packed = u[:, :, 0, :] | (u[:, :, 1, :] << 4)  # [N, C, 64]
    return packed.reshape(n, kp // 2)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """[N, Kc // 2] uint8 -> [N, Kc] int8 (Kc a multiple of 128); inverse of pack_int4."""
    n, half = packed.shape
    p = packed.reshape(n, half // (PACK_CHUNK // 2), PACK_CHUNK // 2)  # [N, C, 64]
    lo = (p & 0xF).astype(jnp.int8) - 8
    hi = (p >> 4).astype(jnp.int8) - 8
    return jnp.concatenate([lo, hi], axis=-1).reshape(n, half * 2)  # [N, Kc]


def quantize_weights(w: jax.Array, bits: int = 8, group_size: int | None = None, *,
                     fp8: bool = False) -> QuantizedWeights:
    """Symmetric weight-only quantization of w [K, N].

    bits=8: int8, one scale per output channel (or per K group). bits=4: int4 packed two per byte,
    one scale per group of `group_size` K elements (per channel when None). fp8=True: float8_e4m3fn
    with one scale per output channel (the Hopper path).
    """
    _check_args(w, bits, group_size, fp8)
    k, n = w.shape
    kp = _round_up(k, group_size or PACK_CHUNK)
    group = group_size or kp
    wt = jnp.pad(w.astype(jnp.float32).T, ((0, 0), (0, kp - k)))  # [N, Kp]
    grouped = wt.reshape(n, kp // group, group)  # [N, G, g]
    qmax = _FP8_MAX if fp8 else _INT_MAX[bits]
    scale = jnp.max(jnp.abs(grouped), axis=-1) / qmax  # [N, G]
    scale = jnp.where(scale > 0, scale, 1.0)
    scaled = grouped / scale[:, :, None]  # [N, G, g]
    if fp8:
        values = scaled.reshape(n, kp).astype(jnp.float8_e4m3fn)
    else:
        q = jnp.clip(jnp.round(scaled), -qmax, qmax).astype(jnp.int8).reshape(n, kp)  # [N, Kp]
        values = q if bits == 8 else pack_int4(q)
    return QuantizedWeights(values, scale.T, bits, group, k, fp8)


def dequantize_weights(wq: QuantizedWeights) -> jax.Array:
    """fp32 [Kp, N] (padded rows are zeros)."""
    q = unpack_int4(wq.values) if wq.bits == 4 else wq.values
    n, kp = q.shape
    grouped = q.astype(jnp.float32).reshape(n, kp // wq.group_size, wq.group_size)  # [N, G, g]
    w = grouped * wq.scales.T[:, :, None]
    return w.reshape(n, kp).T  # [Kp, N]


def pad_activations(x: jax.Array, wq: QuantizedWeights) -> jax.Array:
    """x [M, K] -> [M, Kp] with zeros, matching the weights' padding."""
    if x.ndim != 2 or x.shape[1] != wq.in_features:
        raise ValueError(f"x must be [M, {wq.in_features}], got shape {x.shape}")
    return jnp.pad(x, ((0, 0), (0, wq.padded_in_features - wq.in_features)))


def quantized_matmul(x: jax.Array, wq: QuantizedWeights) -> jax.Array:
    """x [M, K] @ dequantize(wq) -> [M, N] in x.dtype, fp32 arithmetic throughout."""
    xp = pad_activations(x, wq).astype(jnp.float32)  # [M, Kp]
    y = jnp.dot(xp, dequantize_weights(wq), precision=jax.lax.Precision.HIGHEST)  # [M, N]
    return y.astype(x.dtype)
