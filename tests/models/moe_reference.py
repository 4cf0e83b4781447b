"""Independent float64 NumPy references for the MoE block and the Qwen3 / Qwen3-MoE / Mixtral forward.

Written the obvious way (a loop over tokens and their chosen experts, dense causal attention over one whole
sequence), sharing no code with jaxinfer.models, so the paged, sorted, grouped-matmul path is checked
against something that cannot share its mistakes.
"""

from __future__ import annotations

import math

import numpy as np

from jaxinfer.config import ModelConfig


def f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def reference_routing(x: np.ndarray, router: np.ndarray, top_k: int, renorm: bool) -> tuple[np.ndarray, np.ndarray]:
    """(weights [T, k], experts [T, k]) by softmax, argsort (best first) and optional renormalization."""
    logits = f64(x) @ f64(router)  # [T, E]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    experts = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(p, experts, axis=-1)
    if renorm:
        weights /= weights.sum(-1, keepdims=True)
    return weights, experts


def reference_moe(x: np.ndarray, w, top_k: int, renorm: bool) -> np.ndarray:
    """Each token through each of its top-k experts, one at a time: [T, D]."""
    x = f64(x)
    weights, experts = reference_routing(x, w.router, top_k, renorm)
    gate, up, down = f64(w.w_gate), f64(w.w_up), f64(w.w_down)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(top_k):
            e = experts[t, slot]
            h = silu(x[t] @ gate[e]) * (x[t] @ up[e])
            out[t] += weights[t, slot] * (h @ down[e])
    return out


def _norm(x: np.ndarray, g, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * f64(g)


def _rope(x: np.ndarray, theta: float) -> np.ndarray:  # x [T, heads, H], half-split convention
    t, h = x.shape[0], x.shape[-1]
    ang = np.arange(t)[:, None] * (1.0 / theta ** (np.arange(0, h, 2) / h))[None, :]  # [T, H/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attention(layer, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    eps, g = cfg.rms_norm_eps, cfg.q_per_kv
    q = np.einsum("td,dnh->tnh", x, f64(layer.wq))  # [T, N, H]
    k = np.einsum("td,dkh->tkh", x, f64(layer.wk))  # [T, K, H]
    if hasattr(layer, "q_norm"):  # Qwen3's QK-norm, before RoPE
        q, k = _norm(q, layer.q_norm, eps), _norm(k, layer.k_norm, eps)
    q, k = _rope(q, cfg.rope_theta), np.repeat(_rope(k, cfg.rope_theta), g, axis=1)
    v = np.repeat(np.einsum("td,dkh->tkh", x, f64(layer.wv)), g, axis=1)  # [T, N, H]
    s = np.einsum("qnh,knh->nqk", q, k) / math.sqrt(cfg.head_size)
    s = np.where(np.tril(np.ones((len(x), len(x)), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("tnh,nhd->td", np.einsum("nqk,knh->qnh", p, v), f64(layer.wo))  # [T, D]


def _feed_forward(layer, h: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    if getattr(layer, "moe", None) is not None:
        return reference_moe(h, layer.moe, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    mlp = layer.mlp
    return (silu(h @ f64(mlp.w_gate)) * (h @ f64(mlp.w_up))) @ f64(mlp.w_down)


def reference_logits(w, cfg: ModelConfig, ids: list[int]) -> np.ndarray:
    """Qwen3, Qwen3-MoE or Mixtral over one whole sequence: logits [T, V] in float64."""
    x = f64(w.embed)[ids]
    for layer in w.layers:
        x = x + _attention(layer, _norm(x, layer.attn_norm, cfg.rms_norm_eps), cfg)
        x = x + _feed_forward(layer, _norm(x, layer.mlp_norm, cfg.rms_norm_eps), cfg)
    x = _norm(x, w.final_norm, cfg.rms_norm_eps)
    return x @ (f64(w.embed).T if w.lm_head is None else f64(w.lm_head))
