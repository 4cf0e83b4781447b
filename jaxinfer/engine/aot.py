"""The compiled programs of a `ModelRunner`: kept by entry point and input shapes, dispatched, and compiled ahead
of time (`precompile`), now or on a thread of their own after the engine starts serving
(`precompile_in_background`). A mixin of `ModelRunner`, whose constructor sets the attributes used here:
`_executables`, `_entry_points`, `_own_args`, `_deferred`, `_in_background`, `precompile_times`,
`export_directory`, `program_identity`, `_recipe_kinds`, and the weights, cache, mesh and transfer."""

from __future__ import annotations

import atexit
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.engine import export_cache, export_recipes
from jaxinfer.sharding import replicated

BACKGROUND_EXIT_WAIT_S = 60.0  # at exit, how long to wait for the background compiles already running


def _timed(compile_fn: Any, kind: str, times: list[tuple[str, float]]) -> Any:
    start = time.perf_counter()
    try:
        return compile_fn()
    finally:
        times.append((kind, time.perf_counter() - start))  # list.append is atomic: the pool's threads share it


class CompiledPrograms:
    """Executables by (entry point, input shapes, static arguments); see the module docstring."""

    def register_entry_point(self, kind: str, jitted: Any) -> None:
        """Another jitted function over (weights, kv_cache, ...) that `_dispatch`/`precompile` serve like
        the built-in kinds (a draft model registers its proposal loop on its own runner)."""
        self._entry_points[kind] = jitted

    def _jitted(self, kind: str) -> Any:
        return self._entry_points[kind]

    def _key(self, kind: str, args: tuple[Any, ...], static: dict[str, Any]) -> tuple[Any, ...]:
        # Weights and cache (args 0, 1 of the stateful kinds) never change shape; the rest is small leaves.
        shapes = tuple((a.shape, a.dtype) for a in jax.tree.leaves(args[self._own_args.get(kind, 2):]))
        return (kind, shapes, tuple(sorted(static.items())))

    def _dispatch(self, kind: str, args: tuple[Any, ...], static: dict[str, Any]) -> Any:
        exe = self._executables.get(self._key(kind, args, static))
        if exe is not None:
            return exe(*args)
        return self._jitted(kind)(*args, **static)  # traces and compiles a shape warmup did not cover

    def precompile(self, calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]], threads: int | None = None,
                   stop: threading.Event | None = None, background: bool = False) -> None:
        """Compile every (kind, example args after weights and cache, static args) ahead of time.

        Tracing and lowering hold the GIL, so they run in turn; XLA compilation (or loading from the persistent
        cache) releases it, so each program goes to a pool of `threads` as soon as it is lowered and compiles
        while the next ones are traced (on a GPU host most of a cold warmup is XLA compile time). Each executable
        is kept and used by `step`/`decode_steps` for inputs of the same shapes. With a persistent compilation
        cache, lowering goes through jaxinfer.engine.export_cache (a warm start reads the lowered programs).
        `precompile_times`: `trace_s` the tracing loop, `compile_s` the compiles still running after it,
        `programs_read` / `programs_read_untraced` / `programs_exported` / `programs_lowered` where each program's
        lowering came from (read_untraced: found by its recipe, export_recipes, and not traced).
        """
        start = time.perf_counter()
        # One thread per core: on a 16-core H100 host a cold start of the bench's engine took 52.6 s to its first
        # token with 16 threads against 63-67 s with 8 (docs/PERFORMANCE.md, "Start").
        threads = threads or max(1, os.cpu_count() or 1)
        with ThreadPoolExecutor(threads) as pool, ThreadPoolExecutor(1) as in_order:
            # Placing for real (below) runs programs. With several processes each must run the same programs in
            # the same order, so there the placements keep to one thread in call order (on the pool, gloo's
            # collectives mismatched in tests/distributed/test_multihost.py); one process may use the pool.
            placer = pool if jax.process_count() == 1 else in_order
            pending, lowered_keys, sources = [], set(), []
            compile_times: list[tuple[str, float]] = []  # (kind, seconds) of each compile, in the order they ended
            # Lowered programs from an earlier start, or written now for the next (jaxinfer.engine.export_cache).
            exports = (export_cache.default_directory() if self.export_directory == "auto"
                       else None if self.export_directory is None else Path(self.export_directory))
            # Taken before anything is traced: tracing imports modules, which a start that reads recipes never does.
            environment = export_recipes.environment_digest() if exports is not None else None
            for kind, rest, static in calls:
                if stop is not None and stop.is_set():  # the process is exiting (precompile_in_background)
                    break
                # Lowered for the host inputs as `place` puts them at run time: left to the compiler, an input
                # used under a shard_map (the structured-output bitmask) would be compiled for a split layout
                # that the replicated arguments of a real step then fail to match. Placing them for real also
                # compiles the transfers' unpacking programs (dozens of small compiles on a cold start), so that
                # runs beside the tracing.
                pending.append((None, placer.submit(self.place, tuple(rest), background)))
                args = (self.weights, self.kv_cache)[: self._own_args.get(kind, 2)] + self.transfer.abstract(rest)
                key = self._key(kind, args, static)
                if key in self._executables or key in lowered_keys:
                    continue
                lowered = [(key, export_cache.lower(self._jitted(kind), args, static, exports,
                                                    self._recipe(kind, environment)))]
                if kind in ("forward", "small_forward"):  # and the prompt-logprob program over its hidden states
                    lowered.extend(self._lower_prompt(lowered[0][1].out_info[1].hidden, exports, environment))
                lowered_keys.update(k for k, _ in lowered)
                sources.extend(getattr(low, "source", "lowered") for _, low in lowered)
                pending.extend((k, pool.submit(_timed, low.compile, kind, compile_times)) for k, low in lowered)
            traced = time.perf_counter()
            done = [(key, future.result()) for key, future in pending]  # a placement's error surfaces here too
            self._executables.update((key, exe) for key, exe in done if key is not None)  # None: a placement
        if lowered_keys:
            self.precompile_times = {"executables": len(lowered_keys), "threads": threads,
                                     "trace_s": traced - start, "compile_s": time.perf_counter() - traced,
                                     **{f"programs_{s}": sources.count(s) for s in sorted(set(sources))},
                                     "compile_s_by_program": [[k, round(t, 3)] for k, t in compile_times]}

    def precompile_in_background(self, calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]],
                                 threads: int | None = None) -> threading.Thread:
        """`precompile(calls)` on a thread of its own, for programs that only make some calls faster (the
        branch-free decode loop): the engine serves meanwhile, and `decode_steps` keeps to the other build until
        each is handed over, so serving never waits for one or compiles one. Its traces count in
        `num_background_compiles`, not `num_compiles`, and `precompile_times` keeps warmup's."""
        keys = {self._key(kind, (self.weights, self.kv_cache)[: self._own_args.get(kind, 2)]
                          + self.transfer.abstract(rest), static) for kind, rest, static in calls}
        self._deferred |= keys - set(self._executables)
        stop = threading.Event()

        def work() -> None:
            self._in_background.on = True
            foreground = self.precompile_times
            try:
                self.precompile(calls, threads, stop=stop, background=True)
            except Exception as e:  # noqa: BLE001 - those calls then compile when first made, as without warmup
                warnings.warn(f"compiling in the background failed ({type(e).__name__}: {e}); the programs it "
                              "was compiling will compile when first used", stacklevel=1)
            finally:
                self.precompile_times = foreground
                self._deferred -= keys

        thread = threading.Thread(target=work, name="jaxinfer-background-compile", daemon=True)
        thread.start()

        def at_exit() -> None:  # a process that ends first stops tracing and lets the compiles in flight finish
            stop.set()
            thread.join(BACKGROUND_EXIT_WAIT_S)

        atexit.register(at_exit)
        return thread

    def _recipe(self, kind: str, environment: str | None) -> tuple[str, str] | None:
        """The export cache's recipe identity of an entry point (export_recipes), or None where it has none."""
        if environment is None or self.program_identity is None or kind not in self._recipe_kinds:
            return None
        return f"{kind} of {self.program_identity}", environment

    def _lower_prompt(self, hidden: jax.ShapeDtypeStruct, exports: Path | None,
                      environment: str | None) -> list[tuple[tuple[Any, ...], Any]]:
        """The prompt-logprob program lowered for a forward's hidden states [T, D], unless compiled already."""
        t = hidden.shape[0]
        args = (self.weights, jax.ShapeDtypeStruct(hidden.shape, hidden.dtype, sharding=self.hidden_sharding(t)),
                jax.ShapeDtypeStruct((t,), jnp.int32, sharding=replicated(self.mesh)))
        key = self._key("prompt", args, {})
        if key in self._executables:
            return []
        return [(key, export_cache.lower(self._prompt_step, args, {}, exports, self._recipe("prompt", environment)))]
