"""What an engine compiles before it serves, and what it leaves to the background (a collaborator of `Engine`).

`plan(engine)` lists the programs as `ModelRunner.precompile` takes them, (kind, example arguments after the
weights and cache, static arguments):
* the forward of every token bucket, and the sampler of every row count it produces (on a GPU also its build
  without `lax.cond`, for the pipelined single steps);
* speculative decoding's verify programs (and, apart, the draft model's);
* the copy-on-write page copy program (and the draft model's);
* with multi-step decode, the decode loop of every row bucket (not with a draft model, whose engine never runs it).

The small buckets of decode-only single steps (`Engine.small_step_buckets`, 2, 4 and 8 tokens on a GPU or TPU)
compile in the background too: until they are handed over, such steps run in the 16-token bucket.

On a GPU each decode bucket also has a build without conds (`ModelRunner.takes_branch_free`). It only makes some
calls faster, so it is compiled after the first token, in the background (`ModelRunner.precompile_in_background`):
with both builds at warmup an H100's cold start of Llama-3-8B took 70.5 s and its warm start 15.8 s (each decode
program costs ~3 s to trace and lower); with the second in the background, 59.8 and 14.5 s on a machine where the
tree before either took 64.1 and 16.9 s. With several processes every one must run the same programs in the same
order, so there it is compiled at warmup with the rest.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax

from jaxinfer.engine.batcher import MIN_TOKEN_BUCKET
from jaxinfer.engine.page_copies import page_copy_call
from jaxinfer.engine.runner import decode_kind, forward_kind

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine

Call = tuple[str, tuple[Any, ...], dict[str, Any]]  # ModelRunner.precompile's (kind, arguments, static arguments)


@dataclasses.dataclass(frozen=True)
class WarmupPlan:
    now: list[Call]  # compiled before the engine serves
    draft: list[Call]  # the draft model's, on its own runner
    later: list[Call]  # compiled in the background once the engine serves


def plan(engine: Engine) -> WarmupPlan:
    runner = engine.runner
    now: list[Call] = []
    sampler_rows = set()
    later: list[Call] = []
    for shape in [engine.batch_shape(t) for t in engine.token_buckets] + engine.small_step_shapes():
        calls = now if shape.tokens >= MIN_TOKEN_BUCKET else later  # the small ones serve only once compiled
        batch, inputs = engine._step_args(shape, [], [])
        calls.append((forward_kind(shape.tokens), (batch,), {}))
        if shape.seqs not in sampler_rows:  # the sampler's shapes depend on the rows only
            sampler_rows.add(shape.seqs)
            logits = runner.example_logits(shape.seqs)
            args = (engine.penalties, logits, inputs.sampling, inputs.slots, inputs.sample_mask)
            calls.append(("sample", args, {}))
            if runner.branch_free_sampler:
                calls.append(("sample", args, {"branch_free": True}))
    draft: list[Call] = []
    if engine.spec is not None:
        verify_calls, draft = engine.spec.warmup_calls()
        now.extend(verify_calls)
    if engine.decode_steps_per_call > 1 and not runs_every_step_speculatively(engine):
        for rows in engine.decode_row_buckets:
            args = (engine.penalties, *engine._decode_args(engine.decode_shape(rows), [], [], 0))
            kind = decode_kind(rows)
            now.append((kind, args, {"max_steps": engine.decode_steps_per_call}))
            if runner.branch_free_sampler:
                (now if jax.process_count() > 1 else later).append(
                    (kind, args, {"max_steps": engine.decode_steps_per_call, "branch_free": True}))
    now.append(page_copy_call())  # copy-on-write page copies, before any step that has some
    return WarmupPlan(now, draft, later)


def runs_every_step_speculatively(engine: Engine) -> bool:
    """A draft model's engine hands every step to the speculator (`Speculator.run`), which keeps the draft's
    cache in step with the target's: it never runs the multi-step decode loop, whose programs (the model and the
    sampler in a loop, one per row bucket) are among the costliest an engine compiles. N-gram speculation hands
    steps without proposals back to the ordinary path, loop included."""
    return engine.spec is not None and engine.spec.draft is not None
