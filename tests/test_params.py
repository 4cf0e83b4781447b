"""Random weights drawn on device (the path full-size presets take): sharded as declared, deterministic
per key, scaled by fan-in, and compiled once per distinct spec rather than once per weight."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import params
from jaxinfer.config import MeshConfig
from jaxinfer.models import family_for_config
from jaxinfer.sharding import make_mesh, tensor_parallel_rules
from tests.model_helpers import tiny_config


def test_on_device_init_is_sharded_deterministic_and_compiled_per_distinct_spec(monkeypatch):
    monkeypatch.setattr(params, "HOST_INIT_LIMIT_BYTES", 0)  # force the on-device path for a tiny model
    params._drawer.cache_clear()
    cfg = tiny_config(intermediate_size=256)
    specs = family_for_config(cfg).param_specs(cfg, jnp.float32)
    mesh, rules = make_mesh(MeshConfig(tensor=2)), tensor_parallel_rules(cfg, 2)
    w = params.init_params(specs, jax.random.key(0), mesh, rules)
    again = params.init_params(specs, jax.random.key(0), mesh, rules)
    leaves = jax.tree.leaves(w)
    assert all(np.array_equal(a, b) for a, b in zip(leaves, jax.tree.leaves(again)))
    assert [a.sharding for a in leaves] == params.sharding_of(specs, mesh, rules)
    distinct = len({(s, sh) for s, sh in zip(jax.tree.leaves(specs, is_leaf=params.is_spec), params.sharding_of(specs, mesh, rules))})
    assert params._drawer.cache_info().currsize == distinct < len(leaves)
    assert not np.array_equal(np.asarray(w.layers[0].wq), np.asarray(w.layers[1].wq))  # a key per weight
    assert np.array_equal(np.asarray(w.layers[0].attn_norm), np.ones(cfg.hidden_size))
    wq = np.asarray(w.layers[0].wq)  # [D, N, H], fan-in D
    assert abs(wq.std() * np.sqrt(cfg.hidden_size) - 1) < 0.1
