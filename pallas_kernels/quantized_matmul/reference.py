"""Weight-only quantized matmul: the weight format, quantization, and the jnp reference.

Storage format (`QuantizedWeights`), chosen for the kernels:

* values are stored output-major, `[N, Kp]` (int8 / float8_e4m3fn) or `[N, Kp // 2]` (int4 packed
  in uint8). Output-major lets the GPU kernel feed a weight tile straight to the tensor cores as the
  *left* operand (`y^T = W^T x^T`), so the few activation rows of decode become the narrow wgmma N
  dimension instead of a 64-row tile padded from 1 row; grouping and int4 packing run along the
  contiguous K axis. An embedding table stored this way (`[V, D]`, K = D) is also a row per token.
* K is zero-padded at quantization time to `Kp`, a multiple of the group size and of 32 (and of the
  int4 packing chunk), so the kernels never see a ragged K block; activations are zero-padded to
  match at call time. (jaxinfer quantizes only weights whose K needs no padding.)
* scales are `[Kp // group_size, N]`: one row per K group (a single row for per-channel), laid out
  with N last so a kernel multiplies a `[M, N]` partial product by one broadcast row. float32, or
  float16 (GGUF's legacy blocks store their scales that way; jaxinfer's int4 rounds its scales and
  zero points to it).
* zeros (optional, same shape and dtype family as scales): an offset per group, so a weight is
  `q * scale + zero`. GGUF's Q4_1, Q5_1, Q4_K and Q5_K blocks carry a minimum per block, which
  lands here exactly. Kernels never add it per weight: `x @ (q s + z) = (x @ q) s + xsum @ z`
  where `xsum [M, G]` sums the activations over each group, a matmul 1/group the size of the real
  one, done in the wrapper.
* Group sizes: 8-bit 16, 32, 64 or a multiple of 128; int4 32, 64 or a multiple of 128; fp8 per
  channel only. 16 exists for GGUF Q6_K, whose sub-blocks have 16 weights.
* int4 packing (`pack`, the chunk): inside every `pack`-wide chunk of K, byte j holds element j in
  its low nibble and element j + pack/2 in its high nibble, each a two's complement code (q in -8..7).
  `pack` 2 (NATURAL_PACK) is plain int4 order, two codes a byte, low first: the bytes of a jnp.int4
  [N, Kp] array, which the GPU kernel hands to Mosaic GPU's int4 loads and conversions (what the engine
  stores on a GPU, jaxinfer.quantization.fit_packs). Wider chunks unpack into two whole half-chunks, no
  interleave, which the TPU kernel wants (and GGUF's Q4_K stores its nibbles this way with pack 64):
  `pack` is 2 x the group for groups of 32 and 64 (so each half-chunk is exactly one group and
  carries one scale; the group itself when Kp is no multiple of twice the group), 128 for larger
  groups, and for per-channel weights the largest of 128/64/32 dividing Kp. GGUF blocks are decoded
  to codes at load and packed like any other weight.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

PACK_CHUNK = 128  # the widest int4 packing chunk
NATURAL_PACK = 2  # int4 in plain order (module docstring)
K_ALIGN = 32  # K is padded to a multiple of this (and of the group and the packing chunk)
_INT_MAX = {8: 127.0, 4: 7.0}
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
SMALL_GROUPS = {8: (16, 32, 64), 4: (32, 64)}  # group sizes below 128 that each width takes
SCALE_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["values", "scales", "zeros"],
                   meta_fields=["bits", "group_size", "in_features", "fp8", "pack", "w8a8"])
@dataclasses.dataclass(frozen=True)
class QuantizedWeights:
    """A [K, N] weight matrix in quantized form (see the module docstring for the layout)."""

    values: jax.Array  # [N, Kp] int8 | float8_e4m3fn, or [N, Kp // 2] uint8 (int4)
    scales: jax.Array  # [Kp // group_size, N] float32 | float16
    zeros: jax.Array | None = None  # [Kp // group_size, N], added after scaling; None: symmetric
    bits: int = 8  # 8 or 4
    group_size: int = 0  # K elements per scale (Kp for per-channel)
    in_features: int = 0  # K before padding
    fp8: bool = False  # values are float8_e4m3fn (bits == 8)
    pack: int = PACK_CHUNK  # int4 packing chunk (module docstring); unused for 8-bit
    # fp8 only: activations are quantized to e4m3 per row (dynamic absmax scales) and the product
    # runs on fp8 x fp8 (Hopper's fp8 wgmma, twice the bf16 rate): `quantize_rows` is the format.
    w8a8: bool = False

    @property
    def padded_in_features(self) -> int:
        return self.values.shape[-1] * (2 if self.bits == 4 else 1)

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.padded_in_features

    @property
    def num_groups(self) -> int:
        return self.padded_in_features // self.group_size

    @property
    def shape(self) -> tuple[int, int]:
        """The logical [K, N] shape of the matrix these values stand for."""
        return (self.in_features, self.out_features)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def default_pack(group_size: int | None, padded_k: int) -> int:
    """The int4 packing chunk for a group size (None: per channel) and padded K (module docstring)."""
    if group_size is not None and group_size < PACK_CHUNK:
        return 2 * group_size if padded_k % (2 * group_size) == 0 else group_size
    if group_size is not None:
        return PACK_CHUNK
    return next(c for c in (PACK_CHUNK, 64, 32) if padded_k % c == 0)


def check_group_size(bits: int, group_size: int | None, fp8: bool = False) -> None:
    """One sentence naming what is wrong with a (bits, group, fp8) combination."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if fp8 and (bits != 8 or group_size is not None):
        raise ValueError("fp8 weights are 8-bit with one scale per output channel (group_size=None)")
    if group_size is None:
        return
    if group_size <= 0 or (group_size % PACK_CHUNK and group_size not in SMALL_GROUPS[bits]):
        allowed = ", ".join(str(g) for g in SMALL_GROUPS[bits])
        raise ValueError(f"group_size must be {allowed} or a positive multiple of {PACK_CHUNK} for "
                         f"{bits}-bit weights, got {group_size}")


def padded_k(k: int, bits: int, group_size: int | None) -> int:
    """Kp for K input features: a multiple of 32, of the group and of the int4 packing chunk."""
    kp = _round_up(k, math.lcm(K_ALIGN, group_size or 1))
    if bits == 4:
        kp = _round_up(kp, default_pack(group_size, kp) if group_size is not None else K_ALIGN)
    return kp


def pack_int4(q: jax.Array, pack: int = PACK_CHUNK) -> jax.Array:
    """[N, Kp] int8 in -8..7 -> [N, Kp // 2] uint8, chunk-halves layout (module docstring)."""
    n, kp = q.shape
    u = (q.astype(jnp.uint8) & 0xF).reshape(n, kp // pack, 2, pack // 2)  # [N, C, 2, pack/2] two's complement
    packed = u[:, :, 0, :] | (u[:, :, 1, :] << 4)  # [N, C, pack/2]
    return packed.reshape(n, kp // 2)


def unpack_int4(packed: jax.Array, pack: int = PACK_CHUNK) -> jax.Array:
    """[N, Kc // 2] uint8 -> [N, Kc] int8 (Kc a multiple of `pack`); inverse of pack_int4."""
    n, half = packed.shape
    p = jax.lax.bitcast_convert_type(packed, jnp.int8).reshape(n, half // (pack // 2), pack // 2)  # [N, C, pack/2]
    lo = (p << 4) >> 4  # arithmetic shifts sign-extend each nibble
    hi = p >> 4
    return jnp.concatenate([lo, hi], axis=-1).reshape(n, half * 2)  # [N, Kc]


def from_codes(q: jax.Array, scales: jax.Array, zeros: jax.Array | None, *, bits: int, group_size: int,
               in_features: int, fp8: bool = False, pack: int | None = None) -> QuantizedWeights:
    """Builds the pytree from integer codes q [N, Kp] (int8; int4 codes in -8..7), scales and zeros
    [Kp // group_size, N]: the constructor GGUF repacking and random init use."""
    kp = q.shape[1]
    pack = pack or default_pack(None if group_size == kp else group_size, kp)
    values = pack_int4(q, pack) if bits == 4 else q
    return QuantizedWeights(values, scales, zeros, bits, group_size, in_features, fp8, pack)


def quantize_weights(w: jax.Array, bits: int = 8, group_size: int | None = None, *,
                     fp8: bool = False, zero_point: bool = False, w8a8: bool = False,
                     pack: int | None = None) -> QuantizedWeights:
    """Weight-only quantization of w [K, N].

    bits=8: int8, one scale per output channel (or per K group). bits=4: int4 packed two per byte,
    one scale per group of `group_size` K elements (per channel when None). fp8=True: float8_e4m3fn
    with one scale per output channel (the Hopper path). Symmetric (absmax) scales unless
    zero_point=True, which maps each group's [min, max] onto the code range and stores the offset
    in `zeros` (int4's 16 levels then cover the group's real range instead of +-absmax).
    w8a8=True (fp8 only): the activations are quantized too when the weights are applied. pack: the
    int4 packing chunk (default_pack when None; NATURAL_PACK is the GPU kernel's fast order).
    """
    if w.ndim != 2:
        raise ValueError(f"w must be [K, N], got shape {w.shape}")
    check_group_size(bits, group_size, fp8)
    if zero_point and fp8:
        raise ValueError("fp8 weights are symmetric (zero_point=False)")
    if w8a8 and not fp8:
        raise ValueError("w8a8 (fp8 activations) needs fp8 weights")
    k, n = w.shape
    kp = padded_k(k, bits, group_size)
    group = group_size or kp
    wt = jnp.pad(w.astype(jnp.float32).T, ((0, 0), (0, kp - k)))  # [N, Kp]
    grouped = wt.reshape(n, kp // group, group)  # [N, G, g]
    if fp8:
        scale = _positive(jnp.max(jnp.abs(grouped), axis=-1) / _FP8_MAX)  # [N, G]
        values = (grouped / scale[:, :, None]).reshape(n, kp).astype(jnp.float8_e4m3fn)
        return QuantizedWeights(values, scale.T, None, 8, group, k, True, PACK_CHUNK, w8a8)
    qmax = _INT_MAX[bits]
    zero = None
    if zero_point:
        lo, hi = jnp.min(grouped, axis=-1), jnp.max(grouped, axis=-1)  # [N, G]
        scale = _positive((hi - lo) / (2 * qmax + 1))
        zero = lo + (qmax + 1) * scale  # code -qmax-1 is the group's minimum
        q = jnp.clip(jnp.round((grouped - zero[:, :, None]) / scale[:, :, None]), -qmax - 1, qmax)
    else:
        scale = _positive(jnp.max(jnp.abs(grouped), axis=-1) / qmax)  # [N, G]
        q = jnp.clip(jnp.round(grouped / scale[:, :, None]), -qmax, qmax)
    q = q.astype(jnp.int8).reshape(n, kp)  # [N, Kp]
    return from_codes(q, scale.T, None if zero is None else zero.T, bits=bits, group_size=group,
                      in_features=k, pack=(pack or default_pack(group_size, kp)) if bits == 4 else None)


def _positive(scale: jax.Array) -> jax.Array:
    return jnp.where(scale > 0, scale, 1.0)


def codes(wq: QuantizedWeights) -> jax.Array:
    """The integer (or e4m3) codes as [N, Kp] in int8 / float8_e4m3fn."""
    return unpack_int4(wq.values, wq.pack) if wq.bits == 4 else wq.values


def dequantize_weights(wq: QuantizedWeights) -> jax.Array:
    """fp32 [Kp, N] (padded rows are zeros unless zeros offsets say otherwise)."""
    return dequantize_rows(wq.values, wq.scales.T, None if wq.zeros is None else wq.zeros.T, wq).T


def dequantize_rows(values: jax.Array, scales: jax.Array, zeros: jax.Array | None,
                    wq: QuantizedWeights) -> jax.Array:
    """Output channels [R] of a QuantizedWeights as fp32 [R, Kp], given their values [R, Kp(/2)],
    scales [R, G] and zeros [R, G]: how an embedding table stored as QuantizedWeights looks up rows."""
    q = unpack_int4(values, wq.pack) if wq.bits == 4 else values
    r, kp = q.shape
    grouped = q.astype(jnp.float32).reshape(r, kp // wq.group_size, wq.group_size)  # [R, G, g]
    w = grouped * scales.astype(jnp.float32)[:, :, None]
    if zeros is not None:
        w = w + zeros.astype(jnp.float32)[:, :, None]
    return w.reshape(r, kp)


def pad_activations(x: jax.Array, wq: QuantizedWeights) -> jax.Array:
    """x [M, K] -> [M, Kp] with zeros, matching the weights' padding."""
    if x.ndim != 2 or x.shape[1] != wq.in_features:
        raise ValueError(f"x must be [M, {wq.in_features}], got shape {x.shape}")
    return jnp.pad(x, ((0, 0), (0, wq.padded_in_features - wq.in_features)))


def zero_point_term(xp: jax.Array, wq: QuantizedWeights) -> jax.Array:
    """sum_g xsum[:, g] * zeros[g, :] in fp32 [M, N]: what the zeros add (kernels add it after)."""
    m, kp = xp.shape
    xsum = xp.astype(jnp.float32).reshape(m, kp // wq.group_size, wq.group_size).sum(-1)  # [M, G]
    return jnp.dot(xsum, wq.zeros.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)  # [M, N]


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (xq [M, K] e4m3, sx [M] fp32): the W8A8 activation format, one absmax scale per
    row computed on the fly, so x ~= xq * sx[:, None]."""
    x32 = x.astype(jnp.float32)
    sx = _positive(jnp.max(jnp.abs(x32), axis=1) / _FP8_MAX)  # [M]
    return (x32 / sx[:, None]).astype(jnp.float8_e4m3fn), sx


def quantized_matmul(x: jax.Array, wq: QuantizedWeights) -> jax.Array:
    """x [M, K] @ dequantize(wq) -> [M, N] in x.dtype, fp32 arithmetic throughout (W8A8 weights:
    x quantized per row to e4m3 first, as every kernel does)."""
    xp = pad_activations(x, wq).astype(jnp.float32)  # [M, Kp]
    if wq.w8a8:
        xq, sx = quantize_rows(xp)
        xp = xq.astype(jnp.float32) * sx[:, None]
    y = jnp.dot(xp, dequantize_weights(wq), precision=jax.lax.Precision.HIGHEST)  # [M, N]
    return y.astype(x.dtype)
