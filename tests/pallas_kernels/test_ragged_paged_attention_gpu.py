"""Ragged paged attention, the GPU kernel (Mosaic GPU): its host-side tables, the kernel body in Pallas' Mosaic GPU
interpreter on CPU, lowering for CUDA where the bindings are installed, and gpu-marked runs against the reference."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import CASES, Case, build, quantized_batch
from conftest import relative_error

from pallas_kernels.ragged_paged_attention import ragged_paged_attention, reference, resolve_impl


def _tile_inputs(rng, group, head_dim, kv_heads=2, q_lens=(5, 1, 13, 9, 1, 22), pad_tokens=0,
                 pad_seqs=0):
    """q [T, N, H] and the GPU kernel's tile table for ragged q_lens (starts off the 8-row grid)."""
    from pallas_kernels.ragged_paged_attention import gpu_common
    num_slots = len(q_lens) + pad_seqs
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    num_tokens = sum(q_lens) + pad_tokens
    q = jnp.asarray(rng.standard_normal((num_tokens, kv_heads * group, head_dim)), jnp.float32)
    bt, _ = gpu_common.tile_rows(group)
    max_tiles = num_tokens // bt + num_slots
    num_seqs = jnp.asarray([len(q_lens)], jnp.int32)
    _, tok0, base = gpu_common.tile_table(jnp.asarray(cu), num_seqs, bt, max_tiles)
    return q, jnp.asarray(cu), num_seqs, tok0, base


# (G, H): divisors of 64 (the layouts the kernel always took), and groups that leave rows of the
# 64-row tile without a query (G = 3, 5, 6, 7, 12 use 63, 60, 60, 63, 60 rows) at head dims that are
# not a multiple of 64.
TILE_LAYOUTS = [(1, 8), (4, 8), (8, 8), (3, 80), (5, 96), (6, 80), (12, 96), (16, 80), (7, 64)]


@pytest.mark.parametrize("group,head_dim", TILE_LAYOUTS)
def test_gpu_tile_queries_puts_every_token_at_its_tile_row(rng, group, head_dim):
    """The tile-major q the GPU kernel loads: tile w, kv head k, row g*Bt + t = q[tok0 + t, k*G + g],
    and rows G*Bt .. 63 (no query when G does not divide 64) are zeros.

    Ragged starts that are not multiples of 8 are the case a direct TMA copy out of [T, N, H] got
    wrong (zero-filled rows); the gather must place them exactly.
    """
    from pallas_kernels.ragged_paged_attention import gpu_common
    kv_heads = 2
    q, cu, _, tok0, _ = _tile_inputs(rng, group, head_dim, kv_heads)
    bt, used = gpu_common.tile_rows(group)
    tiles = np.asarray(gpu_common.tile_queries(q, tok0, group, kv_heads))  # [W, K, 64, H]
    assert tiles.shape == (tok0.shape[0], kv_heads, 64, head_dim)
    assert not tiles[:, :, used:].any()
    q_np, tok0, cu = np.asarray(q), np.asarray(tok0), np.asarray(cu)
    checked = 0
    for w in np.flatnonzero(tok0 >= 0):
        seq = np.searchsorted(cu[1:], tok0[w], side="right")
        for t in range(min(bt, int(cu[seq + 1]) - tok0[w])):
            for k in range(kv_heads):
                for g in range(group):
                    np.testing.assert_array_equal(tiles[w, k, g * bt + t],
                                                  q_np[tok0[w] + t, k * group + g])
                    checked += 1
    assert checked == int(cu[-1]) * kv_heads * group


@pytest.mark.parametrize("group", [1, 3, 5, 6, 12, 16])
def test_gpu_gather_rows_inverts_tile_queries(rng, group):
    """Tile-major rows back to [T, N, H]: every real token from its own row, padding tokens zero."""
    from pallas_kernels.ragged_paged_attention import gpu, gpu_common
    q, cu, num_seqs, tok0, base = _tile_inputs(rng, group, 16, pad_tokens=3, pad_seqs=2)
    tiles = gpu_common.tile_queries(q, tok0, group, 2).transpose(1, 0, 2, 3)  # [K, W, 64, H]
    back = np.asarray(gpu._gather_rows(tiles, cu, num_seqs, base, q.shape[0], group))
    real = int(cu[-1])
    np.testing.assert_array_equal(back[:real], np.asarray(q)[:real])
    assert not back[real:].any()


def test_gpu_decode_steps_take_one_token_tiles_of_their_q_heads_only():
    """A decode step (one_token_per_seq): one token a tile, the G q heads' rows stored rounded up to 8 (the 64-row
    tile stays in shared memory); any other call keeps 64 // G tokens a tile and all 64 rows."""
    from pallas_kernels.ragged_paged_attention import gpu
    assert gpu.tile_layout(4, one_token_per_seq=True) == gpu.TileLayout(1, 4, 8)
    assert gpu.tile_layout(3, one_token_per_seq=True) == gpu.TileLayout(1, 3, 8)
    assert gpu.tile_layout(12, one_token_per_seq=True) == gpu.TileLayout(1, 12, 16)
    assert gpu.tile_layout(64, one_token_per_seq=True) == gpu.TileLayout(1, 64, 64)
    assert gpu.tile_layout(4, one_token_per_seq=False) == gpu.TileLayout(16, 64, 64)
    assert gpu.tile_layout(3, one_token_per_seq=False) == gpu.TileLayout(21, 63, 64)


@pytest.mark.parametrize("group,rows", [(1, 8), (4, 8), (8, 8), (12, 16)])
def test_gpu_decode_rows_invert_decode_queries(rng, group, rows):
    """One-token tiles: tile w, kv head k, row g = q[w, k*G + g], rows G.. zero; and back, padding tokens zero."""
    from pallas_kernels.ragged_paged_attention import gpu
    kv_heads, num_tokens, real = 2, 7, 5
    q = jnp.asarray(rng.standard_normal((num_tokens, kv_heads * group, 16)), jnp.float32)
    tiles = np.asarray(gpu.decode_queries(q, kv_heads, rows))  # [T, K, rows, H]
    assert tiles.shape == (num_tokens, kv_heads, rows, 16) and not tiles[:, :, group:].any()
    np.testing.assert_array_equal(tiles[:, 1, group - 1], np.asarray(q)[:, 2 * group - 1])
    cu = jnp.asarray([0, 1, 2, 3, 4, 5, 5, 5], jnp.int32)  # five one-token sequences, two empty slots
    back = np.asarray(gpu._decode_rows(jnp.asarray(tiles).transpose(1, 0, 2, 3), cu, jnp.asarray([5]),
                                       num_tokens, group))
    np.testing.assert_array_equal(back[:real], np.asarray(q)[:real])
    assert not back[real:].any()


def test_gpu_wrapper_metadata_has_no_loop(rng):
    """The GPU kernel's tile table and row gather run loop-free: XLA's GPU runtime reads a while loop's predicate
    back to the host every iteration, so one loop in a step's forward (jnp.searchsorted's default "scan") kept the
    host from launching the step's kernels ahead of the device."""
    from pallas_kernels.ragged_paged_attention import gpu, gpu_common
    q, cu, num_seqs, tok0, base = _tile_inputs(rng, 4, 16)
    tiles = gpu_common.tile_queries(q, tok0, 4, 2).transpose(1, 0, 2, 3)  # [K, W, 64, H]
    table = jax.make_jaxpr(lambda c, n: gpu_common.tile_table(c, n, 16, 12))(cu, num_seqs)
    gather = jax.make_jaxpr(lambda t, c, n, b: gpu._gather_rows(t, c, n, b, q.shape[0], 4))(tiles, cu, num_seqs, base)
    for jaxpr in (table, gather):
        assert "while" not in str(jaxpr) and "scan" not in str(jaxpr)  # a fori_loop traces to a scan


@pytest.mark.parametrize("splits", [2, 5, 16, 33, 70])
def test_gpu_combine_splits_weights_each_split_by_its_share(rng, splits):
    """The flash-decoding merge (elementwise work over the splits, or reductions over a splits axis past 64 of them)
    equals the softmax-weighted sum over the splits; a split that saw no keys (lse far below the rest) gets no
    weight."""
    from pallas_kernels.ragged_paged_attention import gpu
    o = rng.standard_normal((splits, 2, 3, 64, 16)).astype(np.float32)
    lse = (rng.standard_normal((splits, 2, 3, 64)) * 5).astype(np.float32)
    lse[-1] = -1e30  # an empty split
    weights = np.exp2(lse - lse.max(0, keepdims=True))
    want = np.einsum("skwr,skwrh->kwrh", weights / weights.sum(0, keepdims=True), o)
    np.testing.assert_allclose(np.asarray(gpu._combine_splits(jnp.asarray(o), jnp.asarray(lse))), want,
                               rtol=1e-5, atol=1e-5)
    # One-token tiles store 8 of the 64 rows; the kernel still writes a log-sum-exp for all 64.
    short = np.asarray(gpu._combine_splits(jnp.asarray(o[:, :, :, :8]), jnp.asarray(lse)))
    np.testing.assert_allclose(short, want[:, :, :8], rtol=1e-5, atol=1e-5)


def test_gpu_tile_rows_fill_the_64_row_tile():
    from pallas_kernels.ragged_paged_attention import gpu_common
    for group in range(1, 65):
        bt, used = gpu_common.tile_rows(group)
        assert bt >= 1 and used == bt * group and 64 - group < used <= 64


def test_gpu_swizzle_and_shared_memory_of_every_head_dim():
    """Row widths pick the swizzle (80 -> 32 B, 96 -> 64 B); every supported page size and head dim
    fits the shared-memory budget at the pipeline depth the wrapper picks."""
    from pallas_kernels.ragged_paged_attention import gpu, gpu_common
    assert {h: gpu_common.swizzle_bytes(h) for h in gpu.HEAD_DIMS} == {
        64: 128, 80: 32, 96: 64, 128: 128, 192: 128, 256: 128}
    for h in gpu.HEAD_DIMS:
        for r in (8, 16, 32, 64, 128):
            q = jax.ShapeDtypeStruct((8, 4, h), jnp.bfloat16)
            if not gpu.supported_config(q, jax.ShapeDtypeStruct((9, r, 2, h), jnp.bfloat16)):
                assert r == 128 and h > 128  # [128, H] K and V blocks at H > 128: 288+ KB
                continue
            bk = gpu.default_block_kv(r)
            for kv_itemsize in (2, 1):
                assert gpu.smem_bytes(h, bk, gpu._STAGES, 2, kv_itemsize) <= gpu._SMEM_BUDGET
    # The default depth leaves room for two CTAs per SM (docs/KERNELS.md) at 16-bit and 8-bit caches.
    for kv_itemsize in (2, 1):
        assert 2 * gpu.smem_bytes(128, 64, gpu._STAGES, 2, kv_itemsize) <= gpu._SMEM_BUDGET


def test_gpu_supported_config_takes_every_group_and_head_dim():
    from pallas_kernels.ragged_paged_attention import gpu
    for group in range(1, 17):
        for h in (64, 80, 96, 128, 256):
            for r in (8, 16, 64):
                q = jax.ShapeDtypeStruct((4, 2 * group, h), jnp.bfloat16)
                pages = jax.ShapeDtypeStruct((9, r, 2, h), jnp.bfloat16)
                assert gpu.unsupported_reason(q, pages) is None, (group, h, r)


@pytest.mark.parametrize("q_shape,q_dtype,page_shape,kv_dtype,why", [
    # Plain 8-bit pages (one scale per tensor): the kernel reads only QuantizedPages (a scale per token).
    ((4, 8, 128), jnp.bfloat16, (9, 16, 2, 128), jnp.int8, "KV of q's dtype"),
    ((4, 8, 128), jnp.bfloat16, (9, 16, 2, 128), jnp.float8_e4m3fn, "KV of q's dtype"),
    ((4, 8, 128), jnp.float32, (9, 16, 2, 128), jnp.float32, "bf16/f16"),
    ((4, 8, 128), jnp.bfloat16, (9, 24, 2, 128), jnp.bfloat16, "page size"),
    ((4, 8, 128), jnp.bfloat16, (9, 4, 2, 128), jnp.bfloat16, "page size"),
    ((4, 8, 128), jnp.bfloat16, (9, 256, 2, 128), jnp.bfloat16, "page size"),
    ((4, 8, 72), jnp.bfloat16, (9, 16, 2, 72), jnp.bfloat16, "head dim"),
    ((4, 8, 512), jnp.bfloat16, (9, 16, 2, 512), jnp.bfloat16, "head dim"),
    ((4, 8, 256), jnp.bfloat16, (9, 128, 2, 256), jnp.bfloat16, "shared memory"),
    ((4, 65, 64), jnp.bfloat16, (9, 16, 1, 64), jnp.bfloat16, "q heads per kv head"),
    ((4, 6, 64), jnp.bfloat16, (9, 16, 4, 64), jnp.bfloat16, "q heads per kv head"),
])
def test_gpu_supported_config_routes_the_rest_to_the_reference(q_shape, q_dtype, page_shape,
                                                               kv_dtype, why):
    from pallas_kernels.ragged_paged_attention import gpu
    q, pages = jax.ShapeDtypeStruct(q_shape, q_dtype), jax.ShapeDtypeStruct(page_shape, kv_dtype)
    assert not gpu.supported_config(q, pages)
    assert why in gpu.unsupported_reason(q, pages)


def _preset_layouts():
    """(num_heads, num_kv_heads, head_dim, sliding_window) of every model preset, from its YAML."""
    import yaml
    params = []
    for path in sorted((Path(__file__).resolve().parents[2] / "configs" / "models").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        n, k = cfg["num_heads"], cfg["num_kv_heads"]
        h = cfg.get("head_dim") or cfg["hidden_size"] // n
        params.append(pytest.param(n, k, h, cfg.get("sliding_window"), id=path.stem))
    assert params, "no model presets found"
    return params


PRESET_LAYOUTS = _preset_layouts()


@pytest.mark.parametrize("num_heads,kv_heads,head_dim,window", PRESET_LAYOUTS)
def test_every_preset_head_layout_takes_the_gpu_kernel(num_heads, kv_heads, head_dim, window):
    """A new preset whose heads the GPU kernel cannot take would run on the (slow) reference."""
    from pallas_kernels.ragged_paged_attention import gpu
    del window
    q = jax.ShapeDtypeStruct((16, num_heads, head_dim), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((9, 16, kv_heads, head_dim), jnp.bfloat16)
    assert gpu.unsupported_reason(q, pages) is None


def test_auto_on_gpu_falls_back_to_the_reference_and_warns_once_per_reason(rng, monkeypatch):
    """Posing as a GPU: calls the kernel cannot take run on the reference, one warning per reason
    however many layers and steps make the same call; an explicit "pallas_gpu" still refuses."""
    import pallas_kernels.ragged_paged_attention as rpa
    monkeypatch.setattr(rpa, "_backend", lambda: "gpu")
    monkeypatch.setattr(rpa, "_WARNED", set())
    int8 = dataclasses.replace(CASES["int8_kv"], dtype=jnp.bfloat16)
    pages24 = Case(((3, 30), (1, 9)), num_heads=6, kv_heads=2, page_size=24, max_pages=2,
                   dtype=jnp.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for case in (int8, int8, int8, pages24, pages24):
            batch, kwargs = build(rng, case)
            out = ragged_paged_attention(*batch.args(), **kwargs, impl="auto")
            want = reference.ragged_paged_attention(*batch.args(), **kwargs)
            np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                          np.asarray(want.astype(jnp.float32)))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2, messages
    assert "int8" in messages[0] and "page size must be" in messages[1]
    assert all("running the jnp reference" in m for m in messages)
    batch, kwargs = build(rng, int8)
    with pytest.raises(NotImplementedError, match="KV of q's dtype or a quantized"):
        ragged_paged_attention(*batch.args(), **kwargs, impl="pallas_gpu")


# The GPU kernel's own code in Pallas' Mosaic GPU interpreter on CPU (tiny: a few seconds each). It
# runs the real kernel body: tile table, q gather, copies into tiles of each head dim's swizzle,
# the QK^T wgmma, masks, online softmax, splits, the gather back; only PV is a plain dot there
# (gpu_common._pv_accumulate says why). Hardware-only effects (TMA box bounds, shared-memory size,
# registers) are the GPU tests' job.
INTERPRET_CASES = {
    "g3_h80_ragged_mixed": (Case(((5, 5), (11, 30), (1, 7), (3, 17)), num_heads=6, kv_heads=2,
                                 head_dim=80), {}),
    "g5_h96_window_softcap": (Case(((7, 30), (1, 9), (12, 12)), num_heads=5, kv_heads=1,
                                   head_dim=96, sliding_window=5, soft_cap=30.0), {}),
    "g6_h64_pages16_split": (Case(((17, 40), (1, 48)), num_heads=12, kv_heads=2, page_size=16,
                                  max_pages=3), dict(num_splits=2)),
    "g12_h128_padding": (Case(((2, 5), (1, 24), (9, 9)), num_heads=12, kv_heads=1, head_dim=128,
                              pad_tokens=5, pad_seqs=2), {}),
    "g16_h80_decode_split": (Case(((1, 1), (1, 8), (1, 17), (1, 40)), num_heads=16, kv_heads=1,
                                  head_dim=80), dict(num_splits=3)),
    "g4_h64_pages128": (Case(((3, 150), (1, 20)), num_heads=4, kv_heads=1, page_size=128,
                             max_pages=2), {}),
    # One-token tiles (a decode step's one_token_per_seq): G = 4 stored as 8 rows, G = 12 as 16, G = 8 unpadded;
    # empty slots, padding tokens and flash-decoding splits; and a broken promise (a sequence of three new
    # tokens), which must cost only speed.
    "g4_h128_one_token_tiles": (Case(((1, 40), (1, 17), (1, 1), (1, 64)), num_heads=8, kv_heads=2,
                                     head_dim=128, page_size=16, max_pages=4, pad_seqs=3, pad_tokens=2),
                                dict(one_token_per_seq=True)),
    "g12_h64_one_token_tiles_split": (Case(((1, 30), (1, 9)), num_heads=12, kv_heads=1, page_size=16,
                                           max_pages=2, pad_seqs=1), dict(num_splits=2, one_token_per_seq=True)),
    "g8_h80_one_token_tiles_multi": (Case(((3, 20), (1, 33)), num_heads=16, kv_heads=2, head_dim=80,
                                          pad_seqs=3), dict(one_token_per_seq=True)),
    # 128 kv positions a step over 16-token pages (eight page copies per block), three stages deep.
    "g4_h64_block128_stages3": (Case(((2, 150), (1, 300)), num_heads=4, kv_heads=1, page_size=16,
                                     max_pages=20), dict(block_kv=128, stages=3)),
}


@pytest.mark.parametrize("name", list(INTERPRET_CASES))
def test_gpu_kernel_in_interpret_mode_matches_reference(rng, name):
    case, knobs = INTERPRET_CASES[name]
    case = dataclasses.replace(case, dtype=jnp.bfloat16)
    batch, kwargs = build(rng, case)
    from pallas_kernels.ragged_paged_attention import gpu
    out = gpu.ragged_paged_attention(*batch.args(), **kwargs, **knobs, interpret=True)
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert relative_error(out[:real], want[:real].astype(jnp.float32)) < 2e-2
    assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))
    assert not np.asarray(out[real:].astype(jnp.float32)).any()


def test_gpu_kernel_refuses_a_block_that_is_not_whole_pages_of_64_positions(rng):
    batch, kwargs = build(rng, dataclasses.replace(INTERPRET_CASES["g4_h64_pages128"][0], dtype=jnp.bfloat16))
    from pallas_kernels.ragged_paged_attention import gpu
    with pytest.raises(ValueError, match="block_kv 64 must be a multiple of the page size 128"):
        gpu.ragged_paged_attention(*batch.args(), **kwargs, block_kv=64, interpret=True)


# The warp-specialized prefill kernel (gpu_prefill._prefill_kernel: two compute warpgroups and a memory warpgroup, kv
# blocks of 128 positions two stages deep) in the interpreter: kv walks of three or more blocks (the memory
# warpgroup refills released slots), blocks with and without masks (with and without a soft cap), a decode row,
# G not dividing 64, a head dim of 80, window and padding. The interpreter also checks that every barrier phase
# is observed.
WS_INTERPRET_CASES = {
    "g4_h64_refill_fast_and_masked": Case(((40, 300), (1, 9), (23, 150)), num_heads=8, kv_heads=2, head_dim=64,
                                          page_size=16, max_pages=20),
    "g3_h80_window_softcap_padding": Case(((30, 200), (5, 5)), num_heads=6, kv_heads=2, head_dim=80, page_size=32,
                                          max_pages=8, sliding_window=70, soft_cap=30.0, pad_tokens=3, pad_seqs=1),
    "g2_h64_softcap_unmasked_blocks": Case(((20, 280),), num_heads=4, kv_heads=2, head_dim=64, page_size=16,
                                           max_pages=18, soft_cap=20.0),
}


@pytest.mark.parametrize("name", list(WS_INTERPRET_CASES))
def test_gpu_prefill_kernel_in_interpret_mode_matches_reference(rng, name):
    case = dataclasses.replace(WS_INTERPRET_CASES[name], dtype=jnp.bfloat16)
    batch, kwargs = build(rng, case)
    from pallas_kernels.ragged_paged_attention import gpu
    out = gpu.ragged_paged_attention(*batch.args(), **kwargs, warp_specialized=True, interpret=True)
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert relative_error(out[:real], want[:real].astype(jnp.float32)) < 2e-2
    assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))
    assert not np.asarray(out[real:].astype(jnp.float32)).any()


def test_gpu_prefill_kernel_takes_long_prefills_only():
    from pallas_kernels.ragged_paged_attention import gpu_prefill
    takes = gpu_prefill.takes_prefill_kernel
    assert takes(4096, 16, 32, 8, 128, quantized=False)  # Llama-3-8B's 4k prefill: 128 pairs x 8 heads
    assert takes(4096, 256, 32, 4, 128, quantized=False)  # Qwen3-30B-A3B's, in a 256-row bucket
    assert not takes(256, 256, 32, 8, 128, quantized=False)  # a decode batch
    assert not takes(512, 16, 32, 8, 128, quantized=False)  # too few pair tiles to fill the SMs without splits
    assert not takes(4096, 16, 32, 8, 256, quantized=False)  # H = 256: the one-warpgroup kernel
    assert not takes(4096, 16, 32, 8, 128, quantized=True)


def _has_mosaic_gpu_bindings() -> bool:
    try:
        import jax._src.lib.mosaic_gpu  # noqa: F401
    except ImportError:
        return False
    return True


# (G, H, R, T, S): for each head dim, a decode-like batch, a prefill-like one and 128-token pages (128-position kv
# steps) where they fit; the decode-like ones lower with one-token tiles too (one_token_per_seq).
LOWERING_LAYOUTS = [
    (g, h, r, t, s) for h in (64, 80, 96, 128, 192, 256)
    for g, r, t, s in ((3, 16, 64, 64), (16, 64, 512, 2), (1, 128, 64, 64), (5, 8, 64, 64))
    if not (r == 128 and h == 256)]


@pytest.mark.skipif(not _has_mosaic_gpu_bindings(),
                    reason="needs the Mosaic GPU bindings (jax-cuda13-plugin) to lower for CUDA")
@pytest.mark.parametrize("group,head_dim,page_size,num_tokens,num_seqs", LOWERING_LAYOUTS)
def test_gpu_kernel_lowers_for_cuda(group, head_dim, page_size, num_tokens, num_seqs):
    """Lowers the kernel for CUDA without a GPU: Mosaic GPU's own checks run in Python here (wgmma
    operand tiling and swizzle, TMA box ranks and transforms, the shared-memory total against the
    227 KB a block may use). What is left for the GPU: PTX compilation and the run itself.
    On a machine without a GPU: `pip install --no-deps --target DIR jax-cuda13-plugin==<jax's
    version>` and put DIR on PYTHONPATH."""
    import functools

    from pallas_kernels.ragged_paged_attention import gpu
    kv_heads, max_pages = 2, 4
    num_pages = num_seqs * max_pages + 1
    spec = jax.ShapeDtypeStruct
    pages = spec((num_pages, page_size, kv_heads, head_dim), jnp.bfloat16)
    args = (spec((num_tokens, group * kv_heads, head_dim), jnp.bfloat16), pages, pages,
            spec((num_seqs,), jnp.int32), spec((num_seqs, max_pages), jnp.int32),
            spec((num_seqs + 1,), jnp.int32), spec((1,), jnp.int32))
    assert gpu.supported_config(args[0], pages)
    for one_token in (False, True) if num_tokens <= num_seqs else (False,):
        fn = jax.jit(functools.partial(gpu.ragged_paged_attention, sm_scale=0.1, soft_cap=30.0,
                                       sliding_window=100, one_token_per_seq=one_token))
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.skipif(not _has_mosaic_gpu_bindings(),
                    reason="needs the Mosaic GPU bindings (jax-cuda13-plugin) to lower for CUDA")
@pytest.mark.parametrize("group,head_dim,page_size", [(1, 64, 16), (3, 80, 8), (4, 128, 16), (8, 128, 16),
                                                     (5, 96, 128), (16, 64, 64)])
@pytest.mark.parametrize("window", [None, 100])
def test_gpu_prefill_kernel_lowers_for_cuda(group, head_dim, page_size, window):
    """The warp-specialized prefill kernel through Mosaic GPU's lowering (as above), with and without the
    window and soft cap's masks."""
    import functools

    from pallas_kernels.ragged_paged_attention import gpu
    kv_heads, max_pages, num_seqs, num_tokens = 2, 4, 2, 512
    spec = jax.ShapeDtypeStruct
    pages = spec((num_seqs * max_pages + 1, page_size, kv_heads, head_dim), jnp.bfloat16)
    args = (spec((num_tokens, group * kv_heads, head_dim), jnp.bfloat16), pages, pages,
            spec((num_seqs,), jnp.int32), spec((num_seqs, max_pages), jnp.int32),
            spec((num_seqs + 1,), jnp.int32), spec((1,), jnp.int32))
    fn = jax.jit(functools.partial(gpu.ragged_paged_attention, sm_scale=0.1, sliding_window=window,
                                   soft_cap=30.0 if window else None, warp_specialized=True))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# Ragged starts off the 8-row grid at every GQA ratio (the bug fixed in gpu_common.tile_queries), groups
# above 16, and 128-token pages (kv steps of 128 positions, one page per step).
GPU_EXTRA_CASES = {
    "ragged_starts_gqa4_h128": Case(((5, 5), (11, 30), (3, 3), (17, 40), (1, 7)), num_heads=8,
                                    kv_heads=2, head_dim=128),
    "ragged_starts_mha_h128_pages16": Case(((3, 20), (21, 21), (1, 33)), num_heads=2,
                                           kv_heads=2, head_dim=128, page_size=16, max_pages=3),
    "gqa32_h128": Case(((9, 70), (1, 33), (2, 2)), num_heads=32, kv_heads=1, head_dim=128,
                       page_size=16, max_pages=5),
    "gqa64_h64_softcap": Case(((3, 40), (1, 9)), num_heads=64, kv_heads=1, page_size=16,
                              max_pages=3, soft_cap=20.0),
    "pages128_gqa3_h128": Case(((40, 200), (1, 130), (5, 5)), num_heads=6, kv_heads=2,
                               head_dim=128, page_size=128, max_pages=2),
    "pages128_gqa5_h80_window": Case(((33, 250), (1, 129)), num_heads=10, kv_heads=2,
                                     head_dim=80, page_size=128, max_pages=2, sliding_window=70),
}


def _gpu_auto_matches_reference(rng, case: Case) -> None:
    """impl="auto" on the GPU vs the reference on fresh random bf16 inputs; the kernel must take it."""
    from pallas_kernels.ragged_paged_attention import gpu
    batch, kwargs = build(rng, dataclasses.replace(case, dtype=jnp.bfloat16))
    assert resolve_impl("auto") == "pallas_gpu"
    assert gpu.unsupported_reason(batch.q, batch.k_pages) is None  # no fallback to the reference
    out = ragged_paged_attention(*batch.args(), **kwargs, impl="auto")
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert relative_error(out[:real], want[:real].astype(jnp.float32)) < 2e-2
    assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))


@pytest.mark.gpu
@pytest.mark.parametrize("name", [
    "decode_gqa4_h128", "chunked_prefill_window", "bf16_padding", "prefill_mha_h64",
    "mixed_mqa8_h256", "mixed_softcap_gqa4", "window_softcap_pages16", *GPU_EXTRA_CASES])
def test_gpu_kernel_matches_reference(rng, name):
    case = dataclasses.replace({**CASES, **GPU_EXTRA_CASES}[name], dtype=jnp.bfloat16)
    batch, kwargs = build(rng, case)
    from pallas_kernels.ragged_paged_attention import gpu
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    # One-token tiles on every case too: the decode loop's promise, and a broken one costs only speed.
    for one_token in (False, True):
        out = gpu.ragged_paged_attention(*batch.args(), **kwargs, one_token_per_seq=one_token)
        assert relative_error(out[:real], want[:real].astype(jnp.float32)) < 2e-2, one_token
        assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))


# The prefill kernel on the GPU, forced (warp_specialized=True) on small ragged batches and taken by default
# on a 4k-token prefill at Llama-3-8B's and Qwen3-30B-A3B's head layouts (the engine's page size, 16).
WS_GPU_CASES = {
    **WS_INTERPRET_CASES,
    "g8_h128_ragged_starts": Case(((5, 5), (11, 300), (3, 3), (170, 400), (1, 7)), num_heads=16, kv_heads=2,
                                  head_dim=128, page_size=16, max_pages=30),
    "g1_h96_pages128": Case(((40, 300), (1, 130), (5, 5)), num_heads=2, kv_heads=2, head_dim=96, page_size=128,
                            max_pages=3),
    "g16_h64_softcap_window": Case(((60, 260), (1, 9)), num_heads=32, kv_heads=2, head_dim=64, page_size=64,
                                   max_pages=5, soft_cap=20.0, sliding_window=100),
    "g7_h128_pages8": Case(((33, 140), (2, 2)), num_heads=14, kv_heads=2, head_dim=128, page_size=8,
                           max_pages=20, pad_tokens=4),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(WS_GPU_CASES))
def test_gpu_prefill_kernel_matches_reference(rng, name):
    case = dataclasses.replace(WS_GPU_CASES[name], dtype=jnp.bfloat16)
    batch, kwargs = build(rng, case)
    from pallas_kernels.ragged_paged_attention import gpu
    out = gpu.ragged_paged_attention(*batch.args(), **kwargs, warp_specialized=True)
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert relative_error(out[:real], want[:real].astype(jnp.float32)) < 2e-2
    assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,kv_heads", [(32, 8), (32, 4)])
def test_gpu_long_prefill_takes_the_prefill_kernel_and_matches(rng, num_heads, kv_heads):
    from pallas_kernels.ragged_paged_attention import gpu, gpu_prefill
    case = Case(((4096, 4096),), num_heads=num_heads, kv_heads=kv_heads, head_dim=128, page_size=16,
                max_pages=256, dtype=jnp.bfloat16)
    batch, kwargs = build(rng, case)
    assert gpu_prefill.takes_prefill_kernel(4096, 1, num_heads, kv_heads, 128, quantized=False)
    out = ragged_paged_attention(*batch.args(), **kwargs, impl="auto")
    one_wg = gpu.ragged_paged_attention(*batch.args(), **kwargs, warp_specialized=False)
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    assert relative_error(out, want.astype(jnp.float32)) < 2e-2
    # The two kernels sum the same blocks in another order (128- vs 64-position steps): bf16 rounding apart.
    assert relative_error(out, one_wg.astype(jnp.float32)) < 1e-2


# A ragged prefill + decode batch (starts off the 8-row grid, kv over several 64-position steps,
# padding tokens and a padding sequence) for every G in 1..16 at every head dim; the page size and
# window / soft-cap rotate with G so that each head dim meets each of them.
SWEEP_SEQS = ((5, 5), (11, 75), (1, 7), (17, 100), (1, 128), (3, 20))
GROUP_SWEEP = [(g, h) for h in (64, 80, 96, 128, 256) for g in range(1, 17)] + [
    (g, 192) for g in (1, 3, 4, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("group,head_dim", GROUP_SWEEP, ids=[f"G{g}-H{h}" for g, h in GROUP_SWEEP])
def test_gpu_auto_matches_reference_for_every_group_and_head_dim(rng, group, head_dim):
    page_size = (16, 64, 8)[group % 3]
    case = Case(SWEEP_SEQS, num_heads=2 * group, kv_heads=2, head_dim=head_dim,
                page_size=page_size, max_pages=128 // page_size,
                sliding_window=40 if group % 2 else None,
                soft_cap=30.0 if group % 4 in (0, 1) else None, pad_tokens=3, pad_seqs=1)
    _gpu_auto_matches_reference(rng, case)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,kv_heads,head_dim,window", PRESET_LAYOUTS)
def test_gpu_auto_matches_reference_on_every_preset_head_layout(rng, num_heads, kv_heads,
                                                                head_dim, window):
    """The head layout of each configs/models preset (read from its YAML) on a ragged prefill +
    decode batch; a preset with a sliding window gets one of 24 positions so that it masks here."""
    case = Case(((37, 37), (1, 70), (13, 90), (1, 1), (6, 50)), num_heads=num_heads,
                kv_heads=kv_heads, head_dim=head_dim, page_size=16, max_pages=8,
                sliding_window=24 if window else None)
    _gpu_auto_matches_reference(rng, case)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,kv_heads,head_dim", [(32, 8, 128), (9, 3, 64), (10, 2, 80)])
def test_gpu_decode_splits_long_context(rng, num_heads, kv_heads, head_dim):
    """Few sequences with long contexts take the flash-decoding split + combine path."""
    case = Case(((1, 1000), (1, 517), (3, 700)), num_heads=num_heads, kv_heads=kv_heads,
                head_dim=head_dim, page_size=16, max_pages=64, dtype=jnp.bfloat16)
    batch, kwargs = build(rng, case)
    from pallas_kernels.ragged_paged_attention import gpu
    out = gpu.ragged_paged_attention(*batch.args(), **kwargs, num_splits=4)
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    assert relative_error(out[:5], want[:5].astype(jnp.float32)) < 2e-2


@pytest.mark.gpu
def test_gpu_auto_routes_soft_cap_and_mha_to_the_kernel(rng):
    """impl="auto" on the GPU takes every bf16 configuration, soft-cap and G = 1 included."""
    case = dataclasses.replace(CASES["prefill_mha_h64"], dtype=jnp.bfloat16)
    batch, kwargs = build(rng, case)
    kwargs["soft_cap"] = 5.0
    assert resolve_impl("auto") == "pallas_gpu"
    out = ragged_paged_attention(*batch.args(), **kwargs, impl="auto")
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert relative_error(out[:real], want[:real].astype(jnp.float32)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dataclasses.replace(CASES["int8_kv"], dtype=jnp.bfloat16),
    CASES["fp8_kv_bf16_q"],
    Case(((3, 30), (1, 9)), num_heads=6, kv_heads=2, page_size=24, max_pages=2,
         dtype=jnp.bfloat16),
    Case(((3, 30), (1, 9)), num_heads=6, kv_heads=2, head_dim=72, dtype=jnp.bfloat16),
    Case(((3, 30), (1, 9)), num_heads=6, kv_heads=2, dtype=jnp.float32),
], ids=["int8_kv", "fp8_kv", "pages24", "h72", "fp32"])
def test_gpu_auto_falls_back_to_the_reference_instead_of_raising(rng, case):
    batch, kwargs = build(rng, case)
    out = ragged_paged_attention(*batch.args(), **kwargs, impl="auto")
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert relative_error(out[:real], want[:real].astype(jnp.float32)) < 1e-5


# A quantized cache in the GPU kernel: codes streamed as stored, widened to bf16 in shared memory, each
# position's scale on the logits (K) and on the probabilities (V).
QUANTIZED_GPU_CASES = [(jnp.int8, 64, 32, 2), (jnp.float8_e4m3fn, 128, 32, 1), (jnp.int8, 96, 64, 3),
                       (jnp.float8_e4m3fn, 64, 128, 4), (jnp.float8_e4m3fn, 256, 32, 8)]


def _quantized_gpu_case(rng, kv_dtype, head_dim, page_size, group):
    batch = quantized_batch(rng, kv_dtype, num_heads=2 * group, kv_heads=2, head_dim=head_dim,
                             page_size=page_size, max_pages=max(2, 128 // page_size), dtype=jnp.bfloat16,
                             pad_tokens=2)
    return batch, dict(sm_scale=head_dim ** -0.5, soft_cap=30.0 if group % 2 else None,
                       sliding_window=20 if group == 3 else None)


@pytest.mark.parametrize("kv_dtype,head_dim,page_size,group", QUANTIZED_GPU_CASES[:3])
def test_gpu_kernel_in_interpret_mode_takes_quantized_pages(rng, kv_dtype, head_dim, page_size, group):
    from pallas_kernels.ragged_paged_attention import gpu
    batch, kwargs = _quantized_gpu_case(rng, kv_dtype, head_dim, page_size, group)
    assert gpu.unsupported_reason(batch.q, batch.k_pages) is None
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    for one_token in (False, True):  # the decode loop's one-token tiles, here over a mixed batch
        out = gpu.ragged_paged_attention(*batch.args(), **kwargs, one_token_per_seq=one_token, interpret=True)
        assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
        assert relative_error(out[:real], want[:real].astype(jnp.float32)) < 2e-2, one_token


def test_gpu_kernel_refuses_quantized_layouts_it_cannot_tile(rng):
    from pallas_kernels.ragged_paged_attention import gpu
    batch = quantized_batch(rng, jnp.int8, num_heads=4, kv_heads=2, head_dim=80, page_size=16, max_pages=3,
                             dtype=jnp.bfloat16)
    assert "multiple of 32" in gpu.unsupported_reason(batch.q, batch.k_pages)
    batch = quantized_batch(rng, jnp.int8, num_heads=4, kv_heads=2, head_dim=64, page_size=16, max_pages=3,
                             dtype=jnp.float32)
    assert "bf16/f16 q" in gpu.unsupported_reason(batch.q, batch.k_pages)
    batch = quantized_batch(rng, jnp.int8, num_heads=4, kv_heads=2, head_dim=64, page_size=16, max_pages=3,
                             dtype=jnp.bfloat16)
    assert "at least 32 tokens" in gpu.unsupported_reason(batch.q, batch.k_pages)


@pytest.mark.skipif(not _has_mosaic_gpu_bindings(),
                    reason="needs the Mosaic GPU bindings (jax-cuda13-plugin) to lower for CUDA")
@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("head_dim,page_size,num_tokens,num_seqs", [(64, 32, 64, 64), (128, 32, 64, 64),
                                                                   (96, 64, 512, 2), (256, 32, 64, 64),
                                                                   (128, 128, 64, 64)])
def test_gpu_kernel_lowers_for_cuda_with_quantized_pages(kv_dtype, head_dim, page_size, num_tokens, num_seqs):
    """As test_gpu_kernel_lowers_for_cuda, for an int8 / e4m3 cache (8-bit TMA boxes and swizzles, the
    widening's layouts, the scales' copies and broadcasts, the shared-memory total)."""
    import functools

    from pallas_kernels.ragged_paged_attention import gpu
    kv_heads, max_pages = 2, 4
    num_pages = num_seqs * max_pages + 1
    spec = jax.ShapeDtypeStruct
    pages = reference.QuantizedPages(spec((num_pages, page_size, kv_heads, head_dim), kv_dtype),
                                     spec((num_pages, kv_heads, page_size), jnp.float32))
    args = (spec((num_tokens, 4 * kv_heads, head_dim), jnp.bfloat16), pages, pages,
            spec((num_seqs,), jnp.int32), spec((num_seqs, max_pages), jnp.int32),
            spec((num_seqs + 1,), jnp.int32), spec((1,), jnp.int32))
    assert gpu.supported_config(args[0], pages)
    for one_token in (False, True) if num_tokens <= num_seqs else (False,):
        fn = jax.jit(functools.partial(gpu.ragged_paged_attention, sm_scale=0.1, soft_cap=30.0,
                                       one_token_per_seq=one_token))
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,head_dim,page_size,group", QUANTIZED_GPU_CASES)
def test_gpu_kernel_takes_quantized_pages(rng, kv_dtype, head_dim, page_size, group):
    """impl="auto" on a GPU runs the kernel on an int8 / e4m3 cache (no fallback) and equals the reference."""
    from pallas_kernels.ragged_paged_attention import gpu
    batch, kwargs = _quantized_gpu_case(rng, kv_dtype, head_dim, page_size, group)
    assert gpu.unsupported_reason(batch.q, batch.k_pages) is None
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    for one_token in (False, True):
        out = ragged_paged_attention(*batch.args(), **kwargs, impl="auto", one_token_per_seq=one_token)
        assert relative_error(out[:real], want[:real].astype(jnp.float32)) < 2e-2, one_token
        assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))


def _check_copy_kernels(run):
    """scripts/attention_access_ceiling.py's copy-only kernels (the decode kernel's reads without its math): each
    writes the block its pipeline slot 0 held last, so the reads are checked to land where the kernel's would."""
    from model_helpers import load_script
    script = load_script("attention_access_ceiling")
    num_seqs, ctx, page = 3, 256, 16  # 4 blocks of 64 positions, 16 pages a sequence
    rng = np.random.default_rng(0)
    k_pages = jnp.asarray(rng.standard_normal((num_seqs * ctx // page + 1, page, 2, 64)), jnp.bfloat16)
    v_pages = -k_pages
    table = jnp.asarray(rng.permutation(np.arange(1, k_pages.shape[0])).reshape(num_seqs, -1), jnp.int32)
    for stages in (2, 3):
        boxes = run(lambda k, v, t, s=stages: script._boxes_copy(k, v, t, stages=s), k_pages, v_pages, table)
        pages = run(lambda k, v, t, s=stages: script._pages_copy(k, v, t, stages=s), k_pages, v_pages, table)
        if boxes is None:
            continue
        block = max(b for b in range(ctx // 64) if b % stages == 0)  # the last block slot 0 held
        by_seq = np.asarray(k_pages)[np.asarray(table)]  # [S, pages, R, K, H]
        positions = by_seq.reshape(num_seqs, ctx, 2, 64)[:, block * 64:(block + 1) * 64]  # [S, 64, K, H]
        np.testing.assert_array_equal(np.asarray(boxes), positions.transpose(0, 2, 1, 3))  # [S, K, 64, H]
        last_page = max(p for p in range(ctx // page) if p % stages == 0)
        np.testing.assert_array_equal(np.asarray(pages), by_seq[:, last_page])  # [S, R, K, H]


@pytest.mark.skipif(not _has_mosaic_gpu_bindings(),
                    reason="needs the Mosaic GPU bindings (jax-cuda13-plugin) to lower for CUDA")
def test_attention_access_ceiling_copy_kernels_lower_for_cuda():
    def lower(fn, *args):
        assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    _check_copy_kernels(lower)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_attention_access_ceiling_copy_kernels_read_the_decode_kernels_blocks():
    _check_copy_kernels(lambda fn, *args: jax.jit(fn)(*args))
