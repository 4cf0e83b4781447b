"""Lowered programs kept beside the compilation cache, so that a warm start does not lower them again.

Why: a second start of the bench's engine (Llama-3-8B shape, one H100) spent 16.3 of its 21.0 s tracing and
lowering the 36 warmup programs before XLA's persistent cache could even be asked for them (its key is the
lowered module): 5.9 s building jaxprs, 10.7 s lowering them to StableHLO, about half of that in Mosaic GPU
lowering the attention kernel once per program (docs/PERFORMANCE.md, "Start"). XLA's cache then returns each
executable in a fraction of a second.

What: each program is traced as before (that gives the output tree and the cache key), and its lowering is taken
from `jax.export` (a serialized StableHLO module, flatbuffers, no pickle): written on the first start, read on later
ones. A traced program also leaves a recipe (export_recipes.py) that later starts find from the program's inputs
alone, so that they read its file without tracing it. The program compiled is the exported module called on the
flattened arguments, on both starts, so the second start's XLA module is the first's and hits XLA's cache.

The key is a SHA-256 of everything the lowered module depends on: the jaxpr's text (every primitive, shape,
static parameter, nested jaxpr and Pallas kernel body), the bytes of its closed-over constants, the argument
shardings and donations, the compiler options, the JAX and jaxlib versions and the backend's devices. A
program that changes in any of these gets a new file; stale files are never read (they can be deleted).

Not used with several processes (each would need the same files at the same moment) or without a persistent
compilation cache directory. Anything that cannot be exported or read back falls back to lowering as before,
with one warning naming the program.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxinfer.engine import export_recipes

SUFFIX = ".jaxexport"
_WARNED: set[str] = set()


def default_directory() -> Path | None:
    """`jaxinfer_exports/` inside JAX's persistent compilation cache directory, when one is set and one process
    runs (`directory_for` with this process's settings)."""
    return directory_for(jax.config.jax_compilation_cache_dir, jax.process_count())


def directory_for(compilation_cache_dir: str | None, process_count: int) -> Path | None:
    if not compilation_cache_dir or process_count > 1:
        return None
    return Path(compilation_cache_dir) / "jaxinfer_exports"


class FlatCompiled:
    """A compiled exported program behind the calling convention of the jitted original: pytrees in and out."""

    def __init__(self, compiled: Any, in_tree: Any, out_tree: Any):
        self._compiled, self._in_tree, self._out_tree = compiled, in_tree, out_tree

    def __call__(self, *args: Any) -> Any:
        leaves, tree = jax.tree.flatten(args)
        if tree != self._in_tree:
            raise TypeError(f"exported program called with {tree}, compiled for {self._in_tree}")
        return jax.tree.unflatten(self._out_tree, self._compiled(*leaves))

    def __getattr__(self, name: str) -> Any:
        # The rest of jax.stages.Compiled (as_text, cost_analysis, ...) is the compiled module's: llm.describe()
        # counts the collectives in a decode program's HLO text.
        return getattr(self._compiled, name)


class FlatLowered:
    """`jax.stages.Lowered`'s part that precompile uses: `compile()` and `out_info` (shapes and dtypes)."""

    def __init__(self, lowered: Any, in_tree: Any, out_tree: Any, out_info: Any, source: str):
        self._lowered, self._in_tree, self._out_tree, self.out_info = lowered, in_tree, out_tree, out_info
        # "read" (traced for its key, then read from a file), "read_untraced" (found by its recipe, not traced:
        # export_recipes) or "exported" (written now)
        self.source = source

    def compile(self) -> FlatCompiled:
        return FlatCompiled(self._lowered.compile(), self._in_tree, self._out_tree)


def program_key(traced: Any, leaves: list[Any], options: dict[str, Any]) -> str:
    """The SHA-256 that names a program's file (module docstring: what goes in and why)."""
    h = hashlib.sha256()
    devices = jax.devices()
    for part in (jax.__version__, jax.lib.__version__, jax.default_backend(), devices[0].device_kind, len(devices),
                 sorted(options.items()), [info.donated for info in jax.tree.leaves(traced.args_info)],
                 export_recipes.leaf_signature(leaves)):
        h.update(repr(part).encode())
    h.update(str(traced.jaxpr).encode())
    for const in traced.jaxpr.consts:
        value = np.asarray(const)
        h.update(repr((value.shape, str(value.dtype))).encode())
        h.update(value.tobytes())
    return h.hexdigest()


def _compiler_options(traced: Any) -> dict[str, Any]:
    # jax.stages.Traced keeps the jit's compiler options only in its private parameters (jax 0.11.2); without
    # them the exported program would compile with XLA's defaults (on GPU, command buffers back on).
    return dict(getattr(traced, "_params", {}).get("compiler_options_kvs", ()))


def _export(traced: Any, leaves: list[Any]) -> Any:
    """The traced program as a `jax.export.Exported` over the flat argument list.

    `jax.export.export` would trace the program again; a cold start already spends minutes of CPU in tracing and
    lowering, so the program is lowered for export from the trace in hand, through the two private steps
    `jax.export.export` itself takes (jax 0.11.2, pinned), and its argument and result trees are made flat lists
    (the runner's pytrees hold classes JAX cannot serialize; FlatCompiled restores them). Where those steps are
    missing, the public route: export a function that evaluates the jaxpr.

    JAX's custom-call check refuses targets it does not promise to keep stable across versions (XLA's GPU
    library calls, for one). It is off here for every target ("ALL"): a file is only ever read by the JAX that
    wrote it, since the key holds the JAX and jaxlib versions."""
    checks = [jax.export.DisabledSafetyCheck.custom_call("ALL")]
    try:
        from jax._src.export import _export as impl
        from jax._src.interpreters import mlir
    except ImportError:
        impl = None
    if impl is not None and hasattr(impl, "_export_lowered"):
        params = mlir.LoweringParameters(
            for_export=True, hoist_constants_as_args=False,
            export_ignore_forward_compatibility=impl.config.export_ignore_forward_compatibility.value)
        lowered = traced.lower(lowering_platforms=(impl.default_export_platform(),), _private_parameters=params)
        exported = impl._export_lowered(lowered, traced.jaxpr, traced.fun_name, disabled_checks=checks)
        return dataclasses.replace(exported, in_tree=jax.tree.structure((tuple(leaves), {})),
                                   out_tree=jax.tree.structure([0] * len(exported.out_avals)))
    closed = traced.jaxpr

    def flat(*args: Any) -> list[Any]:
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)

    return jax.export.export(jax.jit(flat), disabled_checks=checks)(*leaves)


def _write(path: Path, blob: bytes) -> None:
    """Atomically: a reader sees the whole file or none (two processes may write the same key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)


def _warn_once(name: str, what: str, error: BaseException) -> None:
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"export cache: {what} program {name!r} failed ({type(error).__name__}: {error}); it is "
                      "lowered as usual instead. This is reported once per program.", RuntimeWarning, stacklevel=3)


def _flat_lowered(exported: Any, leaves: list[Any], in_tree: Any, out_tree: Any, out_info: Any,
                  donated: tuple[int, ...], options: dict[str, Any], source: str) -> FlatLowered:
    flat = jax.jit(exported.call, donate_argnums=donated, compiler_options=options or None)
    return FlatLowered(flat.lower(*leaves), in_tree, out_tree, out_info, source)


def _deserialize(path: Path) -> Any:
    return jax.export.deserialize(bytearray(path.read_bytes()))


def _untraced(directory: Path, key: str, leaves: list[Any], in_tree: Any) -> tuple[Any, FlatLowered] | None:
    """(recipe, lowered program) from the recipe named `key` and the file it names, or None (no recipe, no file,
    or a file that does not fit the arguments: the caller traces)."""
    recipe = export_recipes.read(directory, key)
    if recipe is None:
        return None
    try:
        exported = _deserialize(directory / (recipe.program + SUFFIX))
        out_tree = export_recipes.tree_from_json(recipe.out_tree)
        fits = (len(exported.in_avals) == len(leaves) and out_tree.num_leaves == len(exported.out_avals)
                and all(a.shape == tuple(x.shape) and a.dtype == x.dtype for a, x in zip(exported.in_avals, leaves)))
        if not fits:
            return None
        info = jax.tree.unflatten(out_tree, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.out_avals])
        return recipe, _flat_lowered(exported, leaves, in_tree, out_tree, info, recipe.donated, recipe.options,
                                     "read_untraced")
    except Exception as e:  # noqa: BLE001 - traced as before
        _warn_once(recipe.name, "reading the recipe of", e)
        return None


def lower(jitted: Any, args: tuple[Any, ...], static: dict[str, Any], directory: Path | None,
          recipe: tuple[str, str] | None = None) -> Any:
    """`jitted.lower(*args, **static)`, through the export cache in `directory` (None: plain lowering).

    `recipe`: (the program's identity, the start's export_recipes.environment_digest()), for programs whose
    trace those two and the arguments determine (the runner's own entry points): a recipe from an earlier start
    then names the program's file without a trace, and a traced program leaves one for the next start."""
    if directory is None:
        return jitted.lower(*args, **static)
    leaves, in_tree = jax.tree.flatten(args)
    rkey = None if recipe is None else export_recipes.recipe_key(*recipe, leaves, in_tree, static)
    found = None if rkey is None else _untraced(directory, rkey, leaves, in_tree)
    if found is not None and not export_recipes.check_requested():
        return found[1]
    traced = jitted.trace(*args, **static)
    options = _compiler_options(traced)
    key = program_key(traced, leaves, options)
    if found is not None and found[0].program != key:
        raise RuntimeError(f"export cache: the recipe of program {traced.fun_name!r} names {found[0].program}, its "
                           f"trace {key}: something the program depends on is missing from "
                           "jaxinfer.engine.export_recipes.recipe_key")
    path = directory / (key + SUFFIX)
    exported, source = None, "read"
    if path.exists():
        try:
            exported = _deserialize(path)
        except Exception as e:  # noqa: BLE001 - an unreadable file is written again below
            _warn_once(traced.fun_name, "reading", e)
    if exported is None:
        source = "exported"
        try:
            exported = _export(traced, leaves)
            _write(path, bytes(exported.serialize()))
        except Exception as e:  # noqa: BLE001 - the program still runs, lowered as before
            _warn_once(traced.fun_name, "exporting", e)
            return traced.lower()
    donated = tuple(i for i, info in enumerate(jax.tree.leaves(traced.args_info)) if info.donated)
    if rkey is not None and found is None:
        blob = export_recipes.encode(key, donated, options, traced.out_tree, traced.fun_name)
        if blob is not None:
            _write(export_recipes.recipe_path(directory, rkey), blob)
    return _flat_lowered(exported, leaves, in_tree, traced.out_tree, traced.out_info, donated, options, source)


__all__ = ["FlatCompiled", "FlatLowered", "default_directory", "directory_for", "lower", "program_key"]
