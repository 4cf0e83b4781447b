"""GGUF checkpoints (llama.cpp files) through the `gguf` package.

Config comes from the metadata. With quantization="auto" the quantized tensors keep their quantization:
`quantization_plan` gives each its nearest kernel format and the loader repacks its blocks into it
(jaxinfer.checkpoint.gguf_repack). Otherwise (quantization="none", or float tensors) tensors are
dequantized with the gguf package's NumPy dequantizers (every quant type it implements: F32, F16, BF16,
Q4_0/1, Q5_0/1, Q8_0, K-quants, ...). The Q/K row interleave that llama.cpp's converter applies to
Llama-architecture files is undone (on floats, or on the rows of codes and scales) so our rotary
embedding (HF half-split convention) applies unchanged. Likewise a rule's `gguf_add` undoes value
conventions of llama.cpp's converters (Gemma norms stored as 1 + w), so loaded weights are HF's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from jax.sharding import Mesh

from jaxinfer.checkpoint import gguf_repack
from jaxinfer.checkpoint.assemble import CheckpointError, TensorRule, TensorSource, assemble_weights, plan_sources
from jaxinfer.checkpoint.gguf_metadata import GGUFMetadataError, TensorInfo, read_gguf_layout
from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.models import ModelFamily, family_for_gguf
from jaxinfer.models.common import llama3_inv_freq, rope_inv_freq
from jaxinfer.quantization import Plan, QFormat, matrix_view
from jaxinfer.sharding import ShardingRules

# Tensors llama.cpp files may carry that we derive ourselves (checked, then not loaded).
_DERIVED_TENSORS = ("rope_freqs.weight",)


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permute: within each head, rows were interleaved (pairs) for its rotary kernel.

    w: [heads*H, D] in llama.cpp order -> the same shape in HF's half-split order.
    """
    rows, cols = w.shape
    return w.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


@dataclasses.dataclass
class GGUFCheckpoint:
    path: Path

    @cached_property
    def _layout(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file.")
        try:
            meta, infos = read_gguf_layout(self.path)
        except GGUFMetadataError as e:
            raise CheckpointError(f"{e} (not a readable GGUF file, or it is truncated)") from None
        return meta, {t.name: t for t in infos}

    @property
    def metadata(self) -> dict[str, Any]:
        return self._layout[0]

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return self._layout[1]

    @cached_property
    def _data(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    @cached_property
    def family(self) -> ModelFamily:
        arch = self.metadata.get("general.architecture")
        if arch is None:
            raise CheckpointError(f"{self.path}: GGUF metadata has no general.architecture.")
        return family_for_gguf(arch, self.metadata)

    @cached_property
    def config(self) -> ModelConfig:
        cfg = self.family.config_from_gguf(self.metadata)
        cfg = cfg.replace(tie_word_embeddings="output.weight" not in self.tensors)
        if "rope_freqs.weight" in self.tensors:
            cfg = self._llama3_rope_from_tensor(cfg)
        return cfg

    def _llama3_rope_from_tensor(self, cfg: ModelConfig) -> ModelConfig:
        """llama.cpp stores Llama 3.1 rope scaling as per-frequency divisors; we recompute and compare."""
        arch = self.metadata["general.architecture"]
        cfg = cfg.replace(
            rope_scaling=RopeScaling.LLAMA3,
            rope_scaling_factor=float(self.metadata.get(f"{arch}.rope.scaling.factor", 8.0)),
            rope_original_max_position=int(
                self.metadata.get(f"{arch}.rope.scaling.original_context_length", 8192)
            ),
        )
        stored = self._read("rope_freqs.weight").reshape(-1)
        base = np.asarray(rope_inv_freq(cfg.head_size, cfg.rope_theta))
        ours = base / np.asarray(llama3_inv_freq(rope_inv_freq(cfg.head_size, cfg.rope_theta), cfg))
        if stored.shape != ours.shape or not np.allclose(stored, ours, rtol=1e-3):
            raise CheckpointError(
                f"{self.path}: rope_freqs.weight does not match Llama 3 rope scaling with factor "
                f"{cfg.rope_scaling_factor}; this rope scaling variant is not supported."
            )
        return cfg

    def qtype(self, name: str) -> GGMLQuantizationType:
        t = self.tensors[name]
        try:
            return GGMLQuantizationType(t.type_code)
        except ValueError:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unknown GGML type code {t.type_code}.") from None

    def check_types(self) -> None:
        """Every tensor's GGML type is one we can read (repack or dequantize), checked from the header alone
        before anything is loaded: otherwise a CheckpointError naming the tensor, its type and what we read."""
        for name in self.tensors:
            qtype = self.qtype(name)
            if not _decodable(qtype):
                readable = ", ".join(sorted(t.name for t in GGMLQuantizationType if _decodable(t)))
                raise CheckpointError(f"{self.path}: tensor {name!r} is stored as GGML {qtype.name}, which jaxinfer "
                                      f"cannot read (it reads {readable}); re-quantize the file with another type.")

    def _raw(self, name: str) -> tuple[GGMLQuantizationType, np.ndarray]:
        """One tensor's bytes as [rows, row bytes] (rows: every dimension but the innermost)."""
        t = self.tensors[name]
        qtype = self.qtype(name)
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = t.dims[0] // block * type_size
        rows = math.prod(t.dims[1:])
        end = t.offset + rows * row_bytes
        if end > self._data.size:
            raise CheckpointError(
                f"{self.path}: truncated: tensor {name!r} needs bytes up to {end} but the file has {self._data.size}."
            )
        return qtype, np.array(self._data[t.offset : end]).reshape(rows, row_bytes)  # a copy: memmap views are slow

    def _read(self, name: str) -> np.ndarray:
        """Dequantize one tensor to float32 in NumPy (row-major) shape."""
        qtype, raw = self._raw(name)
        try:
            w = dequantize(raw, qtype)
        except (NotImplementedError, ValueError) as e:
            raise CheckpointError(f"{self.path}: cannot dequantize tensor {name!r} ({qtype.name}: {e}).") from None
        return w.reshape(self._shape(name))

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.tensors[name].dims))  # GGML lists dims innermost first

    def _read_quantized(self, name: str, fmt: QFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        """Codes and scales of a tensor whose blocks map onto `fmt` exactly (gguf_repack); None otherwise."""
        qtype = self.qtype(name)
        if len(self.tensors[name].dims) != 2 or not gguf_repack.is_exact(qtype, fmt):
            return None
        return gguf_repack.decode(qtype, self._raw(name)[1])

    def quantization_plan(self, specs: Any) -> tuple[Plan, dict[str, list[str]]]:
        """quantization="auto": each quantizable weight stored in a quantized block type gets the nearest
        kernel format. Also returns {GGUF type: weights} of the types that are not repacked exactly
        (dequantized and requantized), for the notice that says so."""
        self.check_types()
        plan, inexact = {}, {}
        for p in plan_sources(specs, self.family.checkpoint_rules(), set(self.tensors), "gguf"):
            view = matrix_view(p.spec)
            if view is None or p.names[0] not in self.tensors:
                continue  # a missing tensor is reported by the loader with the others
            qtype = self.qtype(p.names[0])
            fmt = gguf_repack.format_for(qtype, view.k, view.experts is not None)
            if fmt is None:
                continue
            plan[p.path] = fmt
            if not gguf_repack.is_exact(qtype, fmt) or p.part is not None:
                inexact.setdefault(qtype.name, []).append(p.path)
        return plan, inexact

    def load_weights(self, specs: Any, mesh: Mesh, rules: ShardingRules, plan: Plan | None = None) -> Any:
        """The weights of `specs` (float specs); those named in `plan` quantized (module docstring)."""
        self.check_types()
        cfg = self.config
        source = TensorSource(
            description=str(self.path),
            names=set(self.tensors),
            shape_of=self._shape,
            read=self._read,
            ignorable=lambda n: n in _DERIVED_TENSORS,
            read_quantized=self._read_quantized,
        )

        # llama.cpp permutes Q/K rows only in Llama-architecture files; other families keep HF's order.
        permuted = self.metadata["general.architecture"] in ("llama", "mistral")

        def postprocess(path: str, rule: TensorRule, w: np.ndarray) -> np.ndarray:
            if permuted and rule.gguf_unpermute is not None:
                w = unpermute_rotary_rows(w, cfg.num_heads if rule.gguf_unpermute == "q" else cfg.num_kv_heads)
            if rule.gguf_add:
                w = w + np.asarray(rule.gguf_add, w.dtype)
            return w

        return assemble_weights(specs, self.family.checkpoint_rules(), source, "gguf", mesh, rules, postprocess,
                                quant_plan=plan)


@functools.cache
def _decodable(qtype: GGMLQuantizationType) -> bool:
    """Whether the gguf package dequantizes this type (probed on one block of zeros: its table of
    dequantizers is private) or we repack it exactly."""
    if qtype in gguf_repack.EXACT_TYPES:
        return True
    if qtype not in GGML_QUANT_SIZES:
        return False
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except (NotImplementedError, ValueError):
        return False
    return True
