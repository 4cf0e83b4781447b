"""GGUF quantized blocks -> the quantized matmul's format, on the host, one tensor at a time.

quantization="auto" keeps a GGUF model's quantization: each tensor's blocks are decoded into integer
codes, per-group scales and (where the block type has them) per-group offsets, and stored in the
nearest kernel format (pallas_kernels.quantized_matmul.reference), never through float weights:

| GGUF      | block                               | stored as                                   | exact |
| --------- | ----------------------------------- | ------------------------------------------- | ----- |
| Q8_0      | 32 x int8, fp16 d                   | int8, groups of 32, fp16 scales             | yes   |
| Q4_0      | 32 x 4-bit, fp16 d                  | int4, groups of 32, fp16 scales             | yes   |
| Q4_1      | 32 x 4-bit, fp16 d and min          | int4, groups of 32, scales + zero points    | yes*  |
| Q5_0      | 32 x 5-bit, fp16 d                  | int8, groups of 32, fp16 scales             | yes   |
| Q5_1      | 32 x 5-bit, fp16 d and min          | int8, groups of 32, scales + zero points    | yes   |
| Q4_K      | 256: 8 x 32 4-bit, 6-bit sub-scales | int4, groups of 32, scales + zero points    | yes*  |
| Q5_K      | 256: 8 x 32 5-bit, 6-bit sub-scales | int8, groups of 32, scales + zero points    | yes   |
| Q6_K      | 256: 16 x 16 6-bit, int8 sub-scales | int8, groups of 16                          | yes   |
| others    | Q2_K, Q3_K, IQ*, TQ*, ...           | dequantized, then int8 in groups of 32      | no    |

(* the offset is folded into one fp32 number per group, `min + 8 d`, rounded once in fp32.) Scales of
the K-quants are products of two numbers (d x sub-scale) and are kept in fp32, where they are exact.
5- and 6-bit codes are stored one per byte: int4 cannot hold them and the kernels have no 5/6-bit
path; that is the one place the device bytes exceed the file's (Q5_0: 1.06 bytes per weight instead
of 0.69). MoE expert tensors go through grouped_matmul's experts, which are 8-bit per channel:
those are dequantized and requantized to int8 per channel (not exact either).

Every decoder returns codes [rows, K] int8, scales [rows, K / g] fp32 and zeros [rows, K / g] or None,
row r being output channel r (GGUF stores a linear layer as [out, in] rows, which is the kernels'
output-major layout). int4 codes are packed in the order the backend's kernel reads
(quantization.fit_packs: plain int4 order on a GPU, chunk halves elsewhere), like any other int4 weight.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as Q

from jaxinfer.quantization import QFormat

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """[rows, row_bytes] uint8 -> [rows, blocks, block_bytes]."""
    rows, row_bytes = raw.shape
    return raw.reshape(rows, row_bytes // block_bytes, block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] fp32 from little-endian fp16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n] values: low nibbles of all bytes, then high nibbles (GGUF's order
    inside a 32-element block and inside each 64-element chunk of a K-quant)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _flat(x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0], -1)


def _q8_0(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 34)
    return _flat(b[..., 2:].view(np.int8)), _f16(b[..., 0:2]), None


def _q4_0(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 18)
    codes = _nibbles(b[..., 2:]).astype(np.int8) - 8  # x = d (u - 8)
    return _flat(codes), _f16(b[..., 0:2]), None


def _q4_1(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    codes = _nibbles(b[..., 4:]).astype(np.int8) - 8  # x = d u + m = d (u - 8) + (m + 8 d)
    return _flat(codes), d, m + 8 * d


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (one uint32, bit j = 5th bit of element j) -> [..., 32] in {0, 16}."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [..., 32], bit j of the little-endian word
    return bits.astype(np.uint8) << 4


def _q5_0(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 22)
    q = _nibbles(b[..., 6:]) | _high_bits(b[..., 2:6])  # 0..31
    return _flat(q.astype(np.int8) - 16), _f16(b[..., 0:2]), None


def _q5_1(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 24)
    q = _nibbles(b[..., 8:]) | _high_bits(b[..., 4:8])  # 0..31; x = d q + m
    return _flat(q.astype(np.int8)), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K / Q5_K super-block -> 8 six-bit scales and 8 six-bit minimums.
    Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums). Sub-blocks 4-7: a low
    nibble from bytes 8-11 (scales: low nibble, minimums: high nibble) and the top 2 bits of bytes
    0-3 (scales) or 4-7 (minimums) as bits 4-5."""
    lo_s, lo_m, mixed = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = np.concatenate([lo_s & 0x3F, (mixed & 0x0F) | ((lo_s >> 6) << 4)], axis=-1)
    mins = np.concatenate([lo_m & 0x3F, (mixed >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_quant_low(qs: np.ndarray) -> np.ndarray:
    """[..., 128] bytes -> [..., 256] 4-bit values: for each 32-byte chunk c, its low nibbles are
    elements 64c..64c+31 and its high nibbles 64c+32..64c+63."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return _nibbles(chunks).reshape(*qs.shape[:-1], 256)


def _q4_k(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 144)
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    scale, minimum = d * sc, dmin * mn  # [rows, blocks, 8]: x = scale u - minimum
    codes = _k_quant_low(b[..., 16:]).astype(np.int8) - 8
    return _flat(codes), _flat(scale), _flat(8 * scale - minimum)


def _q5_k(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 176)
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    qh = b[..., 16:48]  # bit j of byte i is the 5th bit of element 32 j + i
    high = np.unpackbits(qh[..., None, :], axis=-2, count=8, bitorder="little")  # [rows, blocks, 8, 32]
    q = _k_quant_low(b[..., 48:]) | (high.reshape(*qh.shape[:-1], 256) << 4)  # 0..31
    return _flat(q.astype(np.int8)), _flat(d * sc), _flat(-(dmin * mn))


def _q6_k(raw: np.ndarray) -> Decoded:
    b = _blocks(raw, 210)
    ql, qh, sc, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])[..., None]
    lead = b.shape[:-1]
    # Each 128-element half h: low 4 bits from ql[64h:64h+64] (low nibbles: elements 0-63, high
    # nibbles: 64-127), high 2 bits from qh[32h:32h+32], bit pair t for elements 32t..32t+31.
    low = _nibbles(ql.reshape(*lead, 2, 64))  # [.., 2, 128]
    pairs = qh.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)  # [.., 2, 4, 32]
    high = (pairs & 0x03).reshape(*lead, 2, 128)
    q = (low | (high << 4)).reshape(*lead, 256).astype(np.int8) - 32
    return _flat(q), _flat(d * sc.view(np.int8).astype(np.float32)), None


# type -> (decoder, block elements, format for a tensor of K columns)
_EXACT: dict[Q, tuple[Callable[[np.ndarray], Decoded], Callable[[int], QFormat]]] = {
    Q.Q8_0: (_q8_0, lambda k: QFormat(8, 32, scale_dtype="float16")),
    Q.Q4_0: (_q4_0, lambda k: QFormat(4, 32, scale_dtype="float16")),
    Q.Q4_1: (_q4_1, lambda k: QFormat(4, 32, zeros=True)),
    Q.Q5_0: (_q5_0, lambda k: QFormat(8, 32, scale_dtype="float16")),
    Q.Q5_1: (_q5_1, lambda k: QFormat(8, 32, zeros=True)),
    Q.Q4_K: (_q4_k, lambda k: QFormat(4, 32, zeros=True)),
    Q.Q5_K: (_q5_k, lambda k: QFormat(8, 32, zeros=True)),
    Q.Q6_K: (_q6_k, lambda k: QFormat(8, 16)),
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16, Q.F64)
FALLBACK = QFormat(8, 32)  # block types without an exact repack: dequantized, then int8 in groups of 32
EXPERTS = QFormat(8, experts=True)


EXACT_TYPES = frozenset(_EXACT)  # the block types repacked without a float copy


def exact_types() -> tuple[str, ...]:
    return tuple(t.name for t in _EXACT)


def format_for(qtype: Q, k: int, experts: bool) -> QFormat | None:
    """The stored format of a GGUF tensor of this type and K; None: stays float."""
    if qtype in FLOAT_TYPES:
        return None
    if experts:
        return EXPERTS
    if qtype in _EXACT:
        return _EXACT[qtype][1](k)
    return FALLBACK


def is_exact(qtype: Q, fmt: QFormat) -> bool:
    """Whether `decode` reproduces this tensor in `fmt` exactly (else it is dequantized and requantized)."""
    return qtype in _EXACT and not fmt.experts and _EXACT[qtype][1](0).bits == fmt.bits and \
        _EXACT[qtype][1](0).group == fmt.group and _EXACT[qtype][1](0).zeros == fmt.zeros


def decode(qtype: Q, raw: np.ndarray) -> Decoded:
    """raw [rows, row bytes] of one tensor -> (codes [rows, K] int8, scales [rows, G], zeros or None)."""
    return _EXACT[qtype][0](raw)


__all__ = ["EXACT_TYPES", "EXPERTS", "FALLBACK", "FLOAT_TYPES", "decode", "exact_types", "format_for", "is_exact"]
