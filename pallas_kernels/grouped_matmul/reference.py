"""Grouped (ragged) matmul for MoE experts: the quantized expert format and the jnp reference.

    out [M, N] = grouped_matmul(lhs [M, K], rhs [G, K, N] | QuantizedExperts, group_sizes [G])

Semantics are those of `jax.lax.ragged_dot`: the rows of lhs are sorted by group, rows
[start_g, start_g + group_sizes[g]) are multiplied by expert g's [K, N] matrix, and rows at or past
sum(group_sizes) come out as zeros. Group sizes are data, shapes are static: new routing never
recompiles. fp32 accumulation; the output is in lhs.dtype unless preferred_element_type says
otherwise.

Quantized experts (`QuantizedExperts`, a registered dataclass so it is a pytree like any weight):

* `values [G, N, K]`, int8 or float8_e4m3fn, *output-major* (K contiguous), like
  `quantized_matmul.QuantizedWeights`. Why: the GPU decode kernel feeds a weight tile to the tensor
  cores as the left operand (`y^T = W^T x^T`, the few token rows become the narrow wgmma N
  dimension), which wants rows of output channels with K contiguous; the prefill kernel stages the
  dequantized tile into shared memory as the K-major right operand, and the TPU kernel contracts
  K of both operands, so the same layout serves all three.
* `scales [G, N]` fp32, one per output channel per expert (symmetric: absmax / 127 for int8,
  absmax / 448 for e4m3). The scale of a column is constant over K, so kernels multiply the
  finished fp32 accumulator once instead of dequantizing every weight: `x @ (q * s) = (x @ q) * s`.
  int8 and e4m3 values convert exactly to bf16, so the products themselves are exact.

K is not padded: the kernels need K to be a multiple of their K tile (GPU: 64), and the dispatcher
sends other shapes to this reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

_INT8_MAX = 127.0
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class QuantizedExperts:
    """G experts' [K, N] weights, quantized per output channel (module docstring for the layout)."""

    values: jax.Array  # [G, N, K] int8 | float8_e4m3fn
    scales: jax.Array  # [G, N] float32

    @property
    def num_groups(self) -> int:
        return self.values.shape[0]

    @property
    def out_features(self) -> int:
        return self.values.shape[1]

    @property
    def in_features(self) -> int:
        return self.values.shape[2]

    @property
    def fp8(self) -> bool:
        return self.values.dtype == jnp.float8_e4m3fn

    @property
    def shape(self) -> tuple[int, int, int]:
        """The logical [G, K, N] shape of the weights these values stand for."""
        return (self.num_groups, self.in_features, self.out_features)


def quantize_experts(w: jax.Array, fp8: bool = False) -> QuantizedExperts:
    """Symmetric per-output-channel quantization of expert weights w [G, K, N] (int8, or e4m3)."""
    if w.ndim != 3:
        raise ValueError(f"w must be [G, K, N], got shape {w.shape}")
    wt = jnp.swapaxes(w.astype(jnp.float32), 1, 2)  # [G, N, K]
    qmax = _FP8_MAX if fp8 else _INT8_MAX
    scales = jnp.max(jnp.abs(wt), axis=-1) / qmax  # [G, N]
    scales = jnp.where(scales > 0, scales, 1.0)
    scaled = wt / scales[:, :, None]  # [G, N, K]
    if fp8:
        values = scaled.astype(jnp.float8_e4m3fn)
    else:
        values = jnp.clip(jnp.round(scaled), -qmax, qmax).astype(jnp.int8)
    return QuantizedExperts(values, scales)


def dequantize(wq: QuantizedExperts) -> jax.Array:
    """fp32 [G, K, N]."""
    w = wq.values.astype(jnp.float32) * wq.scales[:, :, None]  # [G, N, K]
    return jnp.swapaxes(w, 1, 2)


def rhs_shape(rhs) -> tuple[int, int, int]:
    """[G, K, N] of a dense or quantized rhs."""
    return tuple(rhs.shape)


def check_args(lhs: jax.Array, rhs, group_sizes: jax.Array) -> None:
    """One clear sentence naming the argument for every malformed call (shared by all impls)."""
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K], got shape {lhs.shape}")
    if isinstance(rhs, QuantizedExperts):
        if rhs.values.dtype not in (jnp.int8, jnp.float8_e4m3fn):
            raise ValueError(f"quantized rhs values must be int8 or float8_e4m3fn, got {rhs.values.dtype}")
        if rhs.scales.shape != rhs.values.shape[:2]:
            raise ValueError(f"quantized rhs scales must be [G, N] = {rhs.values.shape[:2]}, "
                             f"got {rhs.scales.shape}")
    elif rhs.ndim != 3:
        raise ValueError(f"rhs must be [G, K, N] or QuantizedExperts, got shape {rhs.shape}")
    g, k, _ = rhs_shape(rhs)
    if lhs.shape[1] != k:
        raise ValueError(f"lhs has K = {lhs.shape[1]} columns but rhs has K = {k} rows per group")
    if group_sizes.shape != (g,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be an integer array of shape ({g},), got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")


def output_dtype(lhs: jax.Array, preferred_element_type) -> jnp.dtype:
    return jnp.dtype(preferred_element_type or lhs.dtype)


def grouped_matmul(lhs: jax.Array, rhs, group_sizes: jax.Array, *,
                   preferred_element_type=None) -> jax.Array:
    """The specification: `jax.lax.ragged_dot` in fp32 at HIGHEST precision; [M, N]."""
    check_args(lhs, rhs, group_sizes)
    w = dequantize(rhs) if isinstance(rhs, QuantizedExperts) else rhs.astype(jnp.float32)
    out = jax.lax.ragged_dot(lhs.astype(jnp.float32), w, group_sizes.astype(jnp.int32),
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)  # [M, N]
    return out.astype(output_dtype(lhs, preferred_element_type))


def gather_matmul(lhs: jax.Array, rhs, rows: jax.Array, experts: jax.Array, *,
                  preferred_element_type=None) -> jax.Array:
    """The specification of the per-pair form: out[p] = lhs[rows[p]] @ rhs[experts[p]], zeros where
    experts[p] is outside [0, G); [P, N]. It gathers a [K, N] weight copy per pair, so it is meant for
    tests and small shapes; the GPU kernel reads each pair's expert tiles in place."""
    g = rhs_shape(rhs)[0]
    check_args(lhs, rhs, jnp.zeros((g,), jnp.int32))
    w = dequantize(rhs) if isinstance(rhs, QuantizedExperts) else rhs.astype(jnp.float32)
    live = (experts >= 0) & (experts < g)  # [P]
    x = jnp.take(lhs.astype(jnp.float32), rows, axis=0)  # [P, K]
    wp = jnp.take(w, jnp.where(live, experts, 0), axis=0)  # [P, K, N]
    out = jnp.einsum("pk,pkn->pn", x, wp, precision=jax.lax.Precision.HIGHEST)  # [P, N]
    return jnp.where(live[:, None], out, 0).astype(output_dtype(lhs, preferred_element_type))


def swiglu_experts(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, experts: jax.Array,
                   valid: jax.Array | None = None, expert_offset: jax.Array | int = 0) -> jax.Array:
    """The specification of the fused MoE SwiGLU: for token t's slot j with e = experts[t, j] - expert_offset in
    [0, G) and valid[t], silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e]) @ w_down[e] in float32, zeros for the other
    pairs; returned as a single partial sum, slot-major: [1, k, T, D] (the kernel's form)."""
    f32 = jnp.float32
    tokens, top_k = experts.shape
    local = (experts - expert_offset).T.reshape(-1)  # [k*T], slot-major
    if valid is not None:
        local = jnp.where(jnp.tile(valid, top_k), local, -1)
    rows = jnp.tile(jnp.arange(tokens, dtype=jnp.int32), top_k)  # [k*T]: pair j*T + t is token t
    gate = gather_matmul(x, w_gate, rows, local, preferred_element_type=f32)  # [k*T, F]
    up = gather_matmul(x, w_up, rows, local, preferred_element_type=f32)  # [k*T, F]
    hidden = jax.nn.silu(gate) * up  # [k*T, F]
    pairs = jnp.arange(rows.shape[0], dtype=jnp.int32)
    out = gather_matmul(hidden, w_down, pairs, local, preferred_element_type=f32)  # [k*T, D]
    return out.reshape(1, top_k, tokens, -1)
