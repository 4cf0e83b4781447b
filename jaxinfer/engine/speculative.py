"""Speculative decoding in the engine: which rows speculate, their proposals, one verification step, rollback.

Where each piece lives (DESIGN.md: proposals are host-side plans that become arrays of the same step):
  * the plan: after `Scheduler.schedule`, `Speculator.run` picks the decodes that speculate, asks the
    scheduler for pages for their k proposals (`reserve_draft_slots`, never preempting) and appends the
    proposals to those rows (`ScheduledSeq.num_draft`); plain decodes, prefill chunks and speculating rows
    share one ragged batch;
  * proposals: n-gram lookup on the host (jaxinfer.engine.ngram), or a draft model's k steps in one device
    call (jaxinfer.engine.draft) whose proposals go straight into the verification step as device arrays;
  * verification: one target step over k + 1 query tokens per speculating row (`ModelRunner.verify`,
    acceptance rules in jaxinfer.engine.verify), read back once;
  * rollback: `OutputPath.apply_verified` hands the emitted tokens to the requests (a stop drops the rest)
    and `Scheduler.update` advances each row by what it kept, freeing pages that hold only rejected KV.

When to speculate (`SpecCostModel`): a step that speculates generates, per row with k proposals, E(a, k) =
1 + a + ... + a^k tokens on average (a: acceptance rate of one proposal, tracked as a running average) instead
of 1, and costs t_spec(T + sum k) instead of t_step(T), both measured: the wall time of every step and every
verification step is kept per token bucket. Speculation runs when (rows + sum (E - 1)) / t_spec >=
rows / t_step. On GPU and TPU small batches are memory bound (t_spec ~ t_step) and speculation wins at any
useful acceptance; large batches are compute bound (t_spec ~ t_step * (T + sum k) / T) and it loses. Buckets
not measured yet default to speculating (so they get measured), and one refused step in 32 speculates anyway
so a stale estimate can recover. `disable_by_batch_size` forces it off from that many running decodes.
docs/PERFORMANCE.md has the measured curve and the modelled speedups.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxinfer.engine.batcher import BatchShape, SeqChunk, pack
from jaxinfer.engine.draft import DraftInputs, DraftRunner
from jaxinfer.engine.ngram import propose_ngram
from jaxinfer.engine.page_copies import page_copy_call
from jaxinfer.engine.step_plan import ScheduledSeq, StepPlan
from jaxinfer.engine.sequence import SeqKey
from jaxinfer.engine.verify import VerifyInputs
from jaxinfer.outputs import RequestOutput
from jaxinfer.sharding import replicated
from jaxinfer.spec_config import SpecMethod, SpeculativeConfig

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine

NGRAM_WINDOW = 4096  # n-gram lookup searches at most the last this many tokens of a sequence
EXPLORE_EVERY = 32  # one step in this many speculates although the cost model says no


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a row with k proposals emits on average when each is accepted with probability alpha
    (independently): 1 + alpha + ... + alpha^k."""
    return float(sum(alpha**i for i in range(k + 1)))


class SpecCostModel:
    """Measured seconds per step kind ("step": plain, "spec": proposals + verification) and token bucket,
    as running averages, and the running acceptance rate of one proposal."""

    def __init__(self, alpha: float = 0.5, weight: float = 0.2) -> None:
        self.alpha, self.weight = alpha, weight
        self.seconds: dict[tuple[str, int], float] = {}
        self._seen: dict[tuple[str, int], int] = {}
        self._refused = 0

    def record(self, kind: str, tokens: int, seconds: float) -> None:
        """A measured step; the first of each kind and bucket is dropped (first calls pay for allocation)."""
        key = (kind, tokens)
        self._seen[key] = self._seen.get(key, 0) + 1
        if self._seen[key] == 1:
            return
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + self.weight * (seconds - old)

    def record_acceptance(self, accepted: int, proposed: int) -> None:
        if proposed:
            self.alpha += self.weight * (accepted / proposed - self.alpha)

    def estimate(self, kind: str, tokens: int) -> float | None:
        """The measured time, or the other kind's at the same bucket (same forward pass), or None."""
        other = "spec" if kind == "step" else "step"
        return self.seconds.get((kind, tokens), self.seconds.get((other, tokens)))

    def worth(self, rows: int, ks: Sequence[int], plain_tokens: int, spec_tokens: int) -> bool:
        """Whether a step whose `rows` sampling rows include speculating ones with `ks` proposals generates
        more tokens per second than the plain step (token buckets `plain_tokens`, `spec_tokens`)."""
        t_step, t_spec = self.estimate("step", plain_tokens), self.estimate("spec", spec_tokens)
        if t_step is None or t_spec is None or t_spec <= 0:
            return True
        gain = sum(expected_tokens(self.alpha, k) - 1 for k in ks)
        if (rows + gain) / t_spec >= rows / t_step:
            return True
        self._refused += 1
        return self._refused % EXPLORE_EVERY == 0


@dataclasses.dataclass
class SpecStats:
    draft_tokens: int = 0  # proposals verified
    accepted_tokens: int = 0  # proposals accepted
    verified_rows: int = 0  # (step, row) pairs that had proposals
    steps: int = 0  # verification steps
    refused_steps: int = 0  # steps with candidates where the cost model (or disable_by_batch_size) said no

    def as_dict(self) -> dict[str, Any]:
        """engine_stats() keys. Mean accepted length: tokens a speculating row emitted per verification
        (accepted proposals + the token after them), vLLM's "mean acceptance length"."""
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        mean = (self.accepted_tokens + self.verified_rows) / self.verified_rows if self.verified_rows else 0.0
        return {"spec_draft_tokens": self.draft_tokens, "spec_accepted_tokens": self.accepted_tokens,
                "spec_acceptance_rate": rate, "spec_mean_accepted_length": mean, "spec_steps": self.steps,
                "spec_refused_steps": self.refused_steps}


class Speculator:
    """The engine's speculative steps (see the module doc); one per engine."""

    def __init__(self, engine: Engine, cfg: SpeculativeConfig, draft: DraftRunner | None = None) -> None:
        if (cfg.method is SpecMethod.DRAFT) != (draft is not None):
            raise ValueError("a draft runner is needed exactly for method 'draft'")
        self.engine, self.cfg, self.draft = engine, cfg, draft
        self.k = cfg.num_speculative_tokens
        self.cost = SpecCostModel()
        self.stats = SpecStats()
        self._drafted: dict[SeqKey, int] = {}  # draft method: leading tokens whose draft KV is written

    # ---------------------------------------------------------------------------------------- the step

    def run(self, plan: StepPlan) -> list[RequestOutput] | None:
        """Run `plan` as a speculative step if any row speculates; None hands it back to the ordinary path
        (n-gram). A draft engine runs every step here, so the draft's cache stays in step with the target's."""
        for key in plan.preempted:
            self._drafted.pop(key, None)
        chosen = self._choose(plan)
        if chosen:
            plain = self.engine.batch_shape(plan.num_batched_tokens).tokens
            spec = self.engine.batch_shape(plan.num_batched_tokens + sum(k for k, _ in chosen.values())).tokens
            if not self.cost.worth(sum(e.sample for e in plan.seqs), [k for k, _ in chosen.values()], plain, spec):
                self.stats.refused_steps += 1
                chosen = {}
        spec_plan = self._with_proposals(plan, chosen) if chosen else plan
        if not any(e.num_draft for e in spec_plan.seqs):
            return None if self.draft is None else self._plain_with_draft(plan)
        try:
            return self._verify(spec_plan)
        except Exception as e:  # noqa: BLE001 - a failed device call fails its requests alone
            return self.engine._device_failed(spec_plan, e)

    def _choose(self, plan: StepPlan) -> dict[int, tuple[int, list[int]]]:
        """Plan rows that speculate -> (k, n-gram proposal or []): decodes of requests that did not opt out,
        k bounded by the request's remaining tokens, max_model_len and the step's token budget."""
        engine = self.engine
        decodes = [i for i, e in enumerate(plan.seqs) if e.sample and e.num_new_tokens == 1]
        limit = self.cfg.disable_by_batch_size
        if not decodes or (limit is not None and len(decodes) >= limit) or self._wants_prompt_logprobs(plan):
            self.stats.refused_steps += bool(decodes)
            return {}
        budget = engine.scheduler.max_num_batched_tokens - plan.num_batched_tokens
        chosen: dict[int, tuple[int, list[int]]] = {}
        for i in decodes:
            e = plan.seqs[i]
            state = engine.requests.get(e.key[0])
            if budget < 1 or state is None or state.error is not None or not _may_speculate(state.params):
                continue
            generated = len(state.seqs[e.key[1]].token_ids)
            room = min(self.k, state.max_tokens - generated - 1, engine.max_model_len - e.kv_len - 1, budget)
            if room < 1:
                continue
            proposal: list[int] = []
            if self.draft is None:
                seq = engine.scheduler.live(e.key)
                c = self.cfg
                proposal = propose_ngram(seq.token_ids, room, c.prompt_lookup_min, c.prompt_lookup_max, NGRAM_WINDOW)
                if not proposal:
                    continue
            k = len(proposal) or room
            chosen[i] = (k, proposal)
            budget -= k
        return chosen

    def _wants_prompt_logprobs(self, plan: StepPlan) -> bool:
        """The verification step computes no prompt logprobs: a step that needs them runs plainly."""
        for e in plan.seqs:
            state = self.engine.requests.get(e.key[0])
            if state is not None and state.params.prompt_logprobs is not None and not state.prompt_logprobs_done:
                return True
        return False

    def _with_proposals(self, plan: StepPlan, chosen: dict[int, tuple[int, list[int]]]) -> StepPlan:
        """The plan with proposals appended to the chosen rows that got pages for them."""
        entries, copies, extra = list(plan.seqs), list(plan.page_copies), 0
        for i, (k, proposal) in chosen.items():
            e = entries[i]
            got = self.engine.scheduler.reserve_draft_slots(e.key, e.kv_len, k)
            if got is None:
                continue
            pages, new_copies = got
            copies.extend(new_copies)
            tokens = (*e.token_ids, *(proposal or [0] * k))  # a draft model's proposals replace the zeros on device
            entries[i] = e._replace(token_ids=tokens, page_ids=pages, kv_len=e.kv_len + k, num_draft=k)
            extra += k
        return StepPlan(tuple(entries), tuple(copies), plan.preempted, plan.num_batched_tokens + extra)

    def _verify(self, plan: StepPlan) -> list[RequestOutput]:
        engine = self.engine
        t = time.perf_counter()
        slots = engine._slot_rows(plan)
        lags = self._lags(plan)
        shape = engine.batch_shape(max(plan.num_batched_tokens, self._draft_tokens(plan, lags)))
        batch, inputs = engine._step_args(shape, plan.seqs, slots)
        spec = self.verify_inputs(shape, plan.seqs)
        if self.draft is not None:
            drafts, probs = self.draft.propose(self._draft_batch(shape, plan, lags), self._draft_inputs(inputs, plan),
                                               plan.page_copies)
            # The draft may live on other devices (a degree-1 draft on the replica's first one) or leave its
            # outputs split by vocabulary; the verification step was compiled for replicated proposals.
            drafts, probs = jax.device_put((drafts, probs), replicated(engine.runner.mesh))
            spec = dataclasses.replace(spec, draft_tokens=drafts, draft_probs=probs)
        t = engine.times.add("prepare", t)
        engine.penalties, out = engine.runner.verify(engine.penalties, batch, inputs, spec, plan.page_copies)
        sampled, emitted, counts = jax.device_get((out.sampled, out.num_emitted, out.expert_counts))
        engine.expert_counts += counts
        self.cost.record("spec", shape.tokens, time.perf_counter() - t)
        t = engine.times.add("device", t)
        self._count(plan, emitted)
        touched = engine.out.apply_verified(plan, sampled, emitted, range(len(plan.seqs)))
        self._advance_draft(plan, emitted, lags)
        engine.num_steps += 1
        outputs = engine.out.emit(touched)
        engine.times.add("apply", t)
        return outputs

    def _count(self, plan: StepPlan, emitted: np.ndarray) -> None:
        drafted = accepted = rows = 0
        for row, e in enumerate(plan.seqs):
            if e.num_draft:
                drafted, rows = drafted + e.num_draft, rows + 1
                accepted += int(emitted[row]) - 1
        self.stats.draft_tokens += drafted
        self.stats.accepted_tokens += accepted
        self.stats.verified_rows += rows
        self.stats.steps += 1
        self.cost.record_acceptance(accepted, drafted)

    def verify_inputs(self, shape: BatchShape, entries: Sequence[ScheduledSeq]) -> VerifyInputs:
        """Host arrays of the proposals (n-gram proposals are in the rows' tokens; a draft model's are zeros
        there until its device arrays replace `draft_tokens`)."""
        s, k, t = shape.seqs, self.k, shape.tokens
        draft_tokens = np.zeros((s, k), np.int32)
        num_draft = np.zeros(s, np.int32)
        draft_rows = np.full((s, k), t, np.int32)  # out of range: the scatter drops it
        logits_rows = np.zeros((s, k + 1), np.int32)
        offset = 0
        for row, e in enumerate(entries):
            n, d = len(e.token_ids), e.num_draft
            first = offset + n - 1 - d  # the row's last real token; its proposals follow it
            logits_rows[row] = first + np.minimum(np.arange(k + 1), d)
            if d:
                draft_rows[row, :d] = first + 1 + np.arange(d)
                draft_tokens[row, :d] = e.token_ids[n - d :]
            num_draft[row] = d
            offset += n
        probs = None
        if self.draft is not None and self.draft.sampling:
            probs = np.zeros((s, k, self.draft.vocab_size), np.float32)
        return VerifyInputs(draft_tokens, num_draft, draft_rows, logits_rows, probs)

    # ---------------------------------------------------------------------------------- the draft model

    def _lags(self, plan: StepPlan) -> list[tuple[int, ...]]:
        """Per row, the tokens before its new ones that the draft has not run yet (at most one or two: the
        last proposal when all were accepted). Dropped when they do not fit the token buckets."""
        if self.draft is None:
            return [() for _ in plan.seqs]
        lags = []
        for e in plan.seqs:
            seq = self.engine.scheduler.live(e.key)
            done = min(self._drafted.get(e.key, e.start_pos), e.start_pos)
            lags.append(tuple(seq.token_ids[done : e.start_pos]) if seq is not None else ())
        room = self.engine.token_buckets[-1] - plan.num_batched_tokens + sum(e.num_draft for e in plan.seqs)
        if sum(map(len, lags)) > room:
            return [() for _ in plan.seqs]  # rare (a full budget): the draft's KV there stays stale
        return lags

    @staticmethod
    def _draft_tokens(plan: StepPlan, lags: list[tuple[int, ...]]) -> int:
        return plan.num_batched_tokens - sum(e.num_draft for e in plan.seqs) + sum(map(len, lags))

    def _draft_batch(self, shape: BatchShape, plan: StepPlan, lags: list[tuple[int, ...]]) -> Any:
        chunks = [SeqChunk((*lag, *e.token_ids[: len(e.token_ids) - e.num_draft]), e.start_pos - len(lag), e.page_ids)
                  for e, lag in zip(plan.seqs, lags)]
        return pack(chunks, shape, self.engine.page_size)

    def _draft_inputs(self, inputs: Any, plan: StepPlan) -> DraftInputs:
        num_draft = np.zeros(inputs.sampling.step.shape[0], np.int32)
        num_draft[: len(plan.seqs)] = [e.num_draft for e in plan.seqs]
        sampling = inputs.sampling
        return DraftInputs(num_draft, sampling.temperature, sampling.key_data, sampling.step)

    def _advance_draft(self, plan: StepPlan, emitted: np.ndarray | None, lags: list[tuple[int, ...]]) -> None:
        """Record how far each row's draft KV is valid: its new tokens, and the proposals it both ran and
        had accepted (proposal j sits at start + j; the draft ran proposals 1..k-1)."""
        if self.draft is None:
            return
        for row, e in enumerate(plan.seqs):
            if e.num_draft and emitted is not None:
                self._drafted[e.key] = e.start_pos + 1 + min(int(emitted[row]) - 1, e.num_draft - 1)
            else:
                self._drafted[e.key] = e.kv_len
        live = self.engine.scheduler.live
        for key in [k for k in self._drafted if live(k) is None]:
            del self._drafted[key]

    def _plain_with_draft(self, plan: StepPlan) -> list[RequestOutput]:
        """No row speculates: the draft runs the step's tokens (keeping its cache in step), then the plain
        step (which computes prompt logprobs when asked)."""
        engine = self.engine
        try:
            lags = self._lags(plan)
            shape = engine.batch_shape(self._draft_tokens(plan, lags))
            _, inputs = engine._step_args(shape, plan.seqs, [0] * len(plan.seqs))
            self.draft.propose(self._draft_batch(shape, plan, lags), self._draft_inputs(inputs, plan), plan.page_copies)
        except Exception as e:  # noqa: BLE001
            return engine._device_failed(plan, e)
        self._advance_draft(plan, None, lags)
        return engine.pipeline.run(plan, engine._slot_rows(plan))

    # ------------------------------------------------------------------------------------ engine hooks

    def warmup_calls(self) -> tuple[list[Any], list[Any]]:
        """(target calls, draft calls) to compile ahead of time: one verification step per token bucket,
        and the draft's proposal call per token bucket."""
        engine, target, drafts = self.engine, [], []
        for tokens in engine.token_buckets:
            shape = engine.batch_shape(tokens)
            batch, inputs = engine._step_args(shape, [], [])
            target.append(("verify", (engine.penalties, batch, inputs, self.verify_inputs(shape, [])), {}))
            if self.draft is not None:
                empty = StepPlan((), (), (), 0)
                drafts.append(("draft", (self._draft_batch(shape, empty, []), self._draft_inputs(inputs, empty)), {}))
        if self.draft is not None:
            drafts.append(page_copy_call())
        return target, drafts

    def reset(self) -> None:
        """The device state was rebuilt after a failed call: the draft's cache too, and nothing is drafted."""
        self._drafted.clear()
        if self.draft is not None:
            import jax.numpy as jnp

            runner = self.draft.runner
            cache = runner.kv_cache
            for leaf in jax.tree.leaves(cache):
                if not leaf.is_deleted():
                    leaf.delete()
            runner.kv_cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), cache)


def speculator_for(engine: Any, cfg: SpeculativeConfig | None, draft_runner: Any) -> Speculator | None:
    """The engine's Speculator for a SpeculativeConfig (None: no speculation); `draft_runner` (a ModelRunner)
    holds the draft model of method 'draft' (its cache as many pages as the target's, see jaxinfer.engine.draft)."""
    if cfg is None:
        return None
    draft = None if draft_runner is None else DraftRunner(draft_runner, cfg.num_speculative_tokens, cfg.draft_sampling)
    return Speculator(engine, cfg, draft)


def _may_speculate(params: Any) -> bool:
    """The request did not opt out (SamplingParams.speculative), and asks for nothing that changes its
    distribution with each token in a way the verification cannot follow: a structured-output grammar's mask
    for proposal j depends on the tokens before it, and the host walks the grammar one token per call)."""
    return params.speculative and params.structured is None
