"""How the models apply quantized weights: the Pallas quantized matmul, and quantized embedding lookups.

Float weights never come here (the models keep their einsums, which XLA partitions itself). A quantized
weight goes through `pallas_kernels.quantized_matmul`, an opaque custom call on GPU and TPU: XLA's
partitioner would gather its operands onto every device. So with a mesh whose model axes hold more
than one device, each matmul runs inside one `jax.shard_map`, every device on its own shard, split
like the float weight would be (jaxinfer.quantization: the values' rows follow the output axis, K the
input axis):
* column-parallel (q/k/v, gate/up, LM head; N split): activations whole, output split on N, no
  collective;
* row-parallel (attention output, down projection; K split): activations split on K (they arrive
  that way from the heads / FFN shards), and the partial products are summed with one psum, the
  same all-reduce XLA inserts after the float weight's matmul.
With a `seq` axis the tokens stay split over it (a step's T divisible by seq). Scale rows of grouped
weights split with K; per-channel scales (one row) are whole on every device that splits K.

An embedding stored quantized (`[V, D]` values, a row per token) is looked up by dequantizing the
gathered rows. With the vocabulary split, each device looks up the tokens of its own rows (zeros for
the others) and one psum assembles them, as XLA does for a float table.

`Linear()` without a mesh (tests, a single device) calls the kernel directly; `impl` follows the
engine's attention choice ("auto": the Pallas kernel on GPU/TPU, the jnp reference on CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxinfer.sharding import Logical, ShardingRules, axis_size, flat_axes
from pallas_kernels.quantized_matmul import QuantizedWeights, quantized_matmul
from pallas_kernels.quantized_matmul.reference import dequantize_rows

# attention_impl -> quantized_matmul impl
_IMPLS = {"auto": "auto", "reference": "reference", "xla": "reference", "pallas_tpu": "tpu", "pallas_gpu": "gpu"}
SEQ = "seq"


def is_quantized(w: Any) -> bool:
    return isinstance(w, QuantizedWeights)


@dataclasses.dataclass(frozen=True)
class Linear:
    """Applies quantized weights (module docstring); hashable, so it can be bound into jitted code."""

    mesh: Mesh | None = None
    rules: ShardingRules | None = None
    impl: str = "auto"
    interpret: bool = False

    @classmethod
    def for_engine(cls, mesh: Mesh | None, rules: ShardingRules | None, attention_impl: str = "auto",
                   interpret: bool = False) -> Linear:
        return cls(mesh, rules, _IMPLS[attention_impl], interpret)

    def _local_matmul(self, x: jax.Array, w: QuantizedWeights) -> jax.Array:
        return quantized_matmul(x, w, impl=self.impl, interpret=self.interpret)

    def _axes(self, logical: Logical | None) -> tuple[str, ...]:
        if self.rules is None or logical is None:
            return ()
        return flat_axes(self.rules.mapping.get(logical))

    def _sharded(self) -> bool:
        return self.mesh is not None and self.mesh.devices.size > 1

    def _token_axis(self, num_tokens: int) -> str | None:
        seq = axis_size(self.mesh, SEQ)
        return SEQ if seq > 1 and num_tokens % seq == 0 else None

    def matmul(self, x: jax.Array, w: QuantizedWeights, in_axis: Logical | None,
               out_axis: Logical | None) -> jax.Array:
        """x [T, K] @ w ([K, N] quantized) -> [T, N] in x.dtype; `in_axis`/`out_axis` are the logical axes
        K and N are sharded like (the float weight's)."""
        if not self._sharded():
            return self._local_matmul(x, w)
        k_axes, n_axes = self._axes(in_axis), self._axes(out_axis)
        k_spec, n_spec = _spec_entry(k_axes), _spec_entry(n_axes)
        tokens = self._token_axis(x.shape[0])
        grouped = not w.per_channel
        w_specs = dataclasses.replace(
            w, values=P(n_spec, k_spec), scales=P(k_spec if grouped else None, n_spec),
            zeros=None if w.zeros is None else P(k_spec if grouped else None, n_spec))

        def per_device(x: jax.Array, w: QuantizedWeights) -> jax.Array:
            local_k = x.shape[1]
            local = dataclasses.replace(w, in_features=local_k, group_size=w.group_size if grouped else local_k)
            y = self._local_matmul(x, local)  # [T, N / n_shards]
            return jax.lax.psum(y.astype(jnp.float32), k_axes).astype(x.dtype) if k_axes else y

        return jax.shard_map(per_device, mesh=self.mesh, in_specs=(P(tokens, k_spec), w_specs),
                             out_specs=P(tokens, n_spec), check_vma=False)(x, w)

    def embed(self, token_ids: jax.Array, table: QuantizedWeights, dtype: Any) -> jax.Array:
        """token_ids [T] -> rows of a quantized [V, D] table, dequantized to `dtype`: [T, D]."""
        d = table.in_features
        if not self._sharded():
            return _lookup(token_ids, table, 0, dtype)[:, :d]
        v_axes = self._axes(Logical.VOCAB)
        v_spec = _spec_entry(v_axes)
        specs = dataclasses.replace(table, values=P(v_spec, None), scales=P(None, v_spec),
                                    zeros=None if table.zeros is None else P(None, v_spec))

        def per_device(ids: jax.Array, table: QuantizedWeights) -> jax.Array:
            if not v_axes:
                return _lookup(ids, table, 0, dtype)
            first = jax.lax.axis_index(v_axes) * table.values.shape[0]  # this device's first row
            rows = _lookup(ids, table, first, jnp.float32)
            return jax.lax.psum(rows, v_axes).astype(dtype)

        out = jax.shard_map(per_device, mesh=self.mesh, in_specs=(P(), specs), out_specs=P(), check_vma=False)
        return out(token_ids, table)[:, :d]


def _spec_entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _lookup(ids: jax.Array, table: QuantizedWeights, first: jax.Array | int, dtype: Any) -> jax.Array:
    """Rows `ids - first` of this (shard of the) table, zeros for ids outside it: [T, Kp] in `dtype`."""
    local = ids - first
    mine = (local >= 0) & (local < table.values.shape[0])
    local = jnp.where(mine, local, 0)
    zeros = None if table.zeros is None else jnp.take(table.zeros, local, axis=1).T
    rows = dequantize_rows(jnp.take(table.values, local, axis=0), jnp.take(table.scales, local, axis=1).T,
                           zeros, table)  # [T, Kp] f32
    return jnp.where(mine[:, None], rows, 0.0).astype(dtype)


DEFAULT_LINEAR = Linear()


__all__ = ["DEFAULT_LINEAR", "Linear", "is_quantized"]
