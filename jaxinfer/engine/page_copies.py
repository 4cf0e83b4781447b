"""Copy-on-write page copies as a program of their own (`ModelRunner.copy_pages`): a step whose plan has copies
runs it first, PAGE_COPY_WIDTH copies a call. Inside every step they would cost two scatters per layer whether or
not a page moved (see runner.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxinfer.engine.page_table import PageCopy
from jaxinfer.kv_cache import KVCache

# Page copies per call of the copy program; a step that has more makes more calls.
PAGE_COPY_WIDTH = 16


def page_copy_arrays(copies: Sequence[PageCopy]) -> tuple[np.ndarray, np.ndarray]:
    """At most PAGE_COPY_WIDTH (src, dst) copies as two [PAGE_COPY_WIDTH] int32 arrays, padded with 0 -> 0 (the
    trash page onto itself), so one program serves every call."""
    src, dst = np.zeros(PAGE_COPY_WIDTH, np.int32), np.zeros(PAGE_COPY_WIDTH, np.int32)
    for i, (s, d) in enumerate(copies):
        src[i], dst[i] = s, d
    return src, dst


def page_copy_call() -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """The copy program as `ModelRunner.precompile` takes it (warmup compiles it with the steps)."""
    return "copy", page_copy_arrays(()), {}


def copy_pages(kv_cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copy-on-write: page dst <- page src in every layer (reads all happen before writes); every leaf has
    pages first, so quantized pages copy their per-token scales with their values."""
    return jax.tree.map(lambda a: _copy_leaf_pages(a, src, dst), kv_cache)


@jax.jit
def _copy_leaf_pages(pages: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    # Jitted so that the 2 x layers leaves of one shape trace once per program (as models.common.layer_program
    # does for the layers); XLA inlines it, and the update stays in place in the donated cache.
    return pages.at[dst].set(pages[src])
