"""Host timeline of pipelined single steps (jaxinfer/engine/pipeline.py) at batch 64 under a JSON schema: the
engine and launcher threads' timestamps around the forward, the sampler and the token read-back, wrapped
around the runner's methods from outside. Prints the wall time, the median step period and the median time
from a forward's dispatch to its return (on a GPU the forward's `lax.cond` makes the call return only near
its end, so this is about the forward's wall time).

    PYTHONPATH=$PWD python3 scripts/pipeline_timeline.py serve_wheels/tokenizer
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxinfer.engine import pipeline, runner

LOG: list[tuple[float, str, str]] = []


def _stamped(cls: Any, name: str, tag: str) -> None:
    inner = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        LOG.append((time.perf_counter(), threading.current_thread().name, f"{tag}_call"))
        out = inner(*args, **kwargs)
        LOG.append((time.perf_counter(), threading.current_thread().name, f"{tag}_ret"))
        return out

    setattr(cls, name, wrapper)


def main() -> None:
    _stamped(runner.ModelRunner, "forward", "fwd")
    _stamped(runner.ModelRunner, "sample", "smp")
    _stamped(pipeline.StepPipeline, "_sample", "step")

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.bench.measure import fixed, prompts
    from jaxinfer.bench.serve_bench import LONG_LIST

    llm = LLM("llama-3-8b", random_weights=True, tokenizer=sys.argv[1], dtype="bfloat16", max_num_seqs=64,
              max_num_batched_tokens=4096, max_model_len=2048, decode_steps_per_call=8, memory_fraction=0.9,
              use_tqdm=False)
    params = [SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, structured={"json": LONG_LIST})
              for _ in range(64)]
    vocab = llm.model_config.vocab_size
    llm.generate(prompts(fixed(1024, 1, 64), vocab, 1), params, use_tqdm=False)  # warm: the grammar's compile
    LOG.clear()
    t = time.perf_counter()
    llm.generate(prompts(fixed(1024, 1, 64), vocab, 2), params, use_tqdm=False)
    wall = time.perf_counter() - t
    steps = [t for t, _, tag in LOG if tag == "step_call"]
    fwd = [(t, tag) for t, _, tag in LOG if tag in ("fwd_call", "fwd_ret")]
    spans = [(b - a) * 1e3 for (a, x), (b, y) in zip(fwd, fwd[1:]) if x == "fwd_call" and y == "fwd_ret"]
    print({"backend": jax.default_backend(), "wall_s": wall,
           "step_period_ms_median": float(np.median(np.diff(steps[10:60]) * 1e3)),
           "forward_call_ms_median": float(np.median(spans))})


if __name__ == "__main__":
    main()
