"""The export cache (jaxinfer.engine.export_cache): a second start reads every lowered program the first one
wrote, runs exactly what a start without the cache runs, and a program that differs in anything gets a file
of its own."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import CacheConfig, EngineConfig, SamplingParams
from jaxinfer.engine import export_cache, export_recipes
from jaxinfer.engine.engine import Engine
import model_helpers
from model_helpers import run_to_completion

CFG = model_helpers.tiny_config(tie_word_embeddings=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 2], list(range(1, 30)), [7] * 11]


@pytest.fixture(autouse=True)
def no_recipe_check(monkeypatch):
    """These tests say where each program came from: a suite run with JAXINFER_EXPORT_RECIPE_CHECK set (every program
    traced anyway, to check the recipes everywhere else) leaves them to set it themselves."""
    monkeypatch.delenv(export_recipes.CHECK_ENV, raising=False)


@pytest.fixture
def cache_dir(tmp_path):
    """The export cache's directory for one test, given to the runner: JAX's own compilation cache stays as the
    process has it (turning it on here would leave it on for the tests after this one in the same worker)."""
    return tmp_path / "exports"


def start(directory, cfg=CFG, **runner_kwargs) -> Engine:
    """A fresh runner and engine (what a new process builds), warmed up: single and multi-step programs."""
    runner = model_helpers.build_runner(cfg, seed=0, num_pages=48, page_size=16, **runner_kwargs)
    runner.export_directory = directory
    engine = Engine(runner, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128),
                    CacheConfig(page_size=16), use_tqdm=False, decode_steps_per_call=4)
    engine.warmup()
    return engine


def greedy(engine: Engine) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    final = run_to_completion(engine)
    return [list(final[i].outputs[0].token_ids) for i in ids]


def test_second_start_reads_every_program_and_generates_the_same_tokens(cache_dir) -> None:
    check_second_start(cache_dir)


@pytest.mark.gpu
def test_second_start_on_gpu_with_the_attention_kernel(cache_dir) -> None:
    """The same with the Mosaic GPU attention kernel (its custom call goes through export and back), bf16."""
    cfg = CFG.replace(head_dim=64, num_heads=4, num_kv_heads=2)
    check_second_start(cache_dir, cfg=cfg, attention_impl="pallas_gpu", dtype=jnp.bfloat16)


# A start in a process of its own (as a user's second start is): tokens and precompile_times as one JSON line.
_CHILD = """
import json, sys
sys.path[:0] = [{tests!r}, {here!r}]
import jax.numpy as jnp
import test_export_cache as t
cfg = t.CFG.replace(**{cfg!r})
engine = t.start({directory!r}, cfg=cfg, **{{k: getattr(jnp, v) if k == "dtype" else v for k, v in {kwargs!r}.items()}})
print(json.dumps({{"tokens": t.greedy(engine), "times": engine.runner.precompile_times}}))
"""


def start_in_a_process(cache_dir, cfg: dict, **kwargs) -> dict:
    here = Path(__file__).resolve().parent
    code = _CHILD.format(tests=str(here.parent), here=str(here), cfg=cfg, directory=str(cache_dir), kwargs=kwargs)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_a_second_process_reads_every_program_untraced(tmp_path, backend) -> None:
    """What a user's second start does: a new process, where nothing has been traced or imported lazily yet. On a
    GPU with the Mosaic GPU attention kernel, whose runtime such a process must load before it compiles."""
    cfg, kwargs = {}, {}
    if backend == "gpu":
        cfg, kwargs = {"head_dim": 64, "num_heads": 4, "num_kv_heads": 2}, {"attention_impl": "pallas_gpu",
                                                                             "dtype": "bfloat16"}
    first = start_in_a_process(tmp_path, cfg, **kwargs)
    assert first["times"]["programs_exported"] == first["times"]["executables"]
    second = start_in_a_process(tmp_path, cfg, **kwargs)
    assert second["times"]["programs_read_untraced"] == first["times"]["executables"]
    assert second["tokens"] == first["tokens"]


def check_second_start(cache_dir, **kwargs) -> None:
    first = start(cache_dir, **kwargs)
    times = first.runner.precompile_times
    assert times["programs_exported"] == times["executables"] >= 4 and "programs_read" not in times
    files = sorted(cache_dir.glob("*" + export_cache.SUFFIX))
    assert len(files) == times["executables"]
    tokens = greedy(first)

    assert len(list((cache_dir / export_recipes.RECIPE_DIR).glob("*.json"))) == times["executables"]

    # The second start finds every program by its recipe and traces none.
    second = start(cache_dir, **kwargs)
    assert second.runner.precompile_times["programs_read_untraced"] == times["executables"]
    assert "programs_exported" not in second.runner.precompile_times
    assert greedy(second) == tokens
    assert second.stats()["num_compiles_after_warmup"] == 0
    # What else reads the executables (llm.describe() counts the collectives in a decode program's HLO).
    exe = next(iter(second.runner._executables.values()))
    assert isinstance(exe, export_cache.FlatCompiled) and "HloModule" in exe.as_text()

    # Traced anyway, each recipe names the program its trace names (otherwise the start raises).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(export_recipes.CHECK_ENV, "1")
        checked = start(cache_dir, **kwargs)
    assert checked.runner.precompile_times["programs_read"] == times["executables"]

    plain = start(None, **kwargs)
    assert plain.runner.precompile_times.get("programs_lowered") == times["executables"]
    assert greedy(plain) == tokens


def test_the_directory_follows_the_compilation_cache(tmp_path) -> None:
    """Beside JAX's persistent compilation cache when one is set, in one process; otherwise no export cache."""
    assert export_cache.directory_for(str(tmp_path), 1) == tmp_path / "jaxinfer_exports"
    assert export_cache.directory_for(None, 1) is None and export_cache.directory_for("", 1) is None
    assert export_cache.directory_for(str(tmp_path), 2) is None  # several processes
    f = jax.jit(lambda x: x * 2)
    assert not isinstance(export_cache.lower(f, (jnp.ones(3),), {}, None), export_cache.FlatLowered)


def _lowered(fn, *args, directory, **static):
    return export_cache.lower(jax.jit(fn, static_argnames=tuple(static)), args, static, directory)


def test_key_follows_constants_statics_shapes_and_donation(tmp_path) -> None:
    x = jnp.ones((4,), jnp.float32)

    def key(fn, *args, donate=(), **static):
        traced = jax.jit(fn, static_argnames=tuple(static), donate_argnums=donate).trace(*args, **static)
        leaves = jax.tree.leaves(args)
        return export_cache.program_key(traced, leaves, {})

    table_a, table_b = np.arange(4, dtype=np.float32), np.arange(4, dtype=np.float32) + 1
    base = key(lambda v: v + table_a, x)
    assert key(lambda v: v + table_a, x) == base  # the same program: the same file
    assert key(lambda v: v + table_b, x) != base  # a closed-over constant's value
    assert key(lambda v, n: v * n, x, n=2) != key(lambda v, n: v * n, x, n=3)  # a static argument
    assert key(lambda v: v + table_a, jnp.ones((5,), jnp.float32)[:4]) == base
    assert key(lambda v: v + table_a, jnp.ones((4,), jnp.bfloat16)) != base  # a dtype
    assert key(lambda v: v + table_a, x, donate=(0,)) != base  # a donation


def test_an_unreadable_file_is_written_again_and_the_program_still_runs(tmp_path) -> None:
    fn = lambda v: jnp.sin(v) * 3  # noqa: E731
    x = jnp.linspace(0, 1, 8)
    first = _lowered(fn, x, directory=tmp_path)
    assert first.source == "exported"
    (path,) = tmp_path.glob("*" + export_cache.SUFFIX)
    path.write_bytes(b"not a flatbuffer")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = _lowered(fn, x, directory=tmp_path)
    assert again.source == "exported" and any("export cache" in str(w.message) for w in caught)
    np.testing.assert_allclose(again.compile()(x), fn(x), rtol=1e-6)
    assert _lowered(fn, x, directory=tmp_path).source == "read"


def test_pytrees_in_and_out_and_donation_survive(tmp_path) -> None:
    """The compiled program takes and returns the original's pytrees, and a donated argument is donated."""

    def step(state, x):
        return {"total": state["total"] + x.sum(), "count": state["count"] + 1}, x * 2

    state = {"total": jnp.zeros(()), "count": jnp.zeros((), jnp.int32)}
    x = jnp.arange(6.0)
    jitted = jax.jit(step, donate_argnums=(0,))
    for source in ("exported", "read"):
        lowered = export_cache.lower(jitted, (state, x), {}, tmp_path)
        assert lowered.source == source
        new_state, y = lowered.compile()(state, x)
        assert state["total"].is_deleted()  # donated
        np.testing.assert_allclose(y, x * 2)
        assert float(new_state["total"]) == 15.0 and int(new_state["count"]) == 1
        state = {"total": jnp.zeros(()), "count": jnp.zeros((), jnp.int32)}


def test_a_changed_module_constant_or_function_is_traced_again(cache_dir, monkeypatch) -> None:
    """A recipe is only found while everything the trace reads is as it was: a tuning constant or a function of a
    loaded module swapped at run time gives every program a new recipe name, so the start traces them all."""
    from jaxinfer.engine import sampling

    times = start(cache_dir).runner.precompile_times
    monkeypatch.setattr(sampling, "_RECIPE_PROBE", 1, raising=False)  # any module-level value counts
    again = start(cache_dir).runner.precompile_times
    assert "programs_read_untraced" not in again and again["programs_read"] == times["executables"]
    monkeypatch.setattr(sampling, "_RECIPE_PROBE", lambda: None, raising=False)
    assert "programs_read_untraced" not in start(cache_dir).runner.precompile_times
    monkeypatch.delattr(sampling, "_RECIPE_PROBE")
    assert start(cache_dir).runner.precompile_times["programs_read_untraced"] == times["executables"]


def test_the_check_names_a_recipe_that_leads_to_another_program(tmp_path, monkeypatch) -> None:
    """The guard against a recipe key that misses something: with JAXINFER_EXPORT_RECIPE_CHECK set, a recipe whose
    program is not the one the trace names stops the start."""
    x = jnp.arange(4.0)
    recipe = ("probe", "environment")
    first = export_cache.lower(jax.jit(lambda v: v * 2), (x,), {}, tmp_path, recipe)
    assert first.source == "exported"
    other = export_cache.lower(jax.jit(lambda v: v + 1), (x,), {}, tmp_path)  # same signature, another program
    assert other.source == "exported"
    found = export_cache.lower(jax.jit(lambda v: v * 2), (x,), {}, tmp_path, recipe)
    assert found.source == "read_untraced"
    np.testing.assert_allclose(found.compile()(x), x * 2)
    (path,) = (tmp_path / export_recipes.RECIPE_DIR).glob("*.json")
    programs = {p.name.removesuffix(export_cache.SUFFIX) for p in tmp_path.glob("*" + export_cache.SUFFIX)}
    text = path.read_text()
    (mine,) = [p for p in programs if p in text]
    (theirs,) = programs - {mine}
    path.write_text(text.replace(mine, theirs))
    monkeypatch.setenv(export_recipes.CHECK_ENV, "1")
    with pytest.raises(RuntimeError, match="recipe of program"):
        export_cache.lower(jax.jit(lambda v: v * 2), (x,), {}, tmp_path, recipe)


def test_a_recipe_that_does_not_fit_the_arguments_is_traced(tmp_path) -> None:
    x = jnp.arange(4.0)
    recipe = ("probe", "environment")
    export_cache.lower(jax.jit(lambda v: v * 2), (x,), {}, tmp_path, recipe)
    (path,) = (tmp_path / export_recipes.RECIPE_DIR).glob("*.json")
    path.write_text("{not json")
    assert export_cache.lower(jax.jit(lambda v: v * 2), (x,), {}, tmp_path, recipe).source == "read"


def test_output_trees_round_trip_through_json() -> None:
    from jaxinfer.engine.step_io import MultiStepOutput, StepOutput
    from pallas_kernels.ragged_paged_attention.reference import QuantizedPages

    a = jnp.zeros(2)
    trees = [
        (a, {"b": None, "a": [a, (a,)]}),
        StepOutput(*([a] * len(StepOutput._fields))),
        MultiStepOutput(*([None] * len(MultiStepOutput._fields))),
        {"cache": QuantizedPages(values=a, scales=a), "rows": {3: a, 1: None}},
    ]
    for tree in trees:
        treedef = jax.tree.structure(tree)
        encoded = export_recipes.tree_to_json(treedef)
        assert export_recipes.tree_from_json(json.loads(json.dumps(encoded))) == treedef


def test_values_describe_the_same_in_every_process_or_not_at_all() -> None:
    import functools
    import threading

    describe = export_recipes.describe
    assert describe({"b": 1, "a": (2.5, None)}) == describe({"a": (2.5, None), "b": 1})
    assert describe(functools.partial(np.add, 1)) == describe(functools.partial(np.add, 1))
    assert describe(export_cache.lower) == "jaxinfer.engine.export_cache.lower"
    assert describe(threading.Lock()) is None  # its repr holds an address
    assert describe(np.arange(3)) != describe(np.arange(3) + 1)
