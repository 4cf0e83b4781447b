"""The accuracy table of docs/QUANTIZATION.md: each quantization mode of the bundled real models against
the float model, on CPU.

    PYTHONPATH=$PWD python scripts/measure_quantization.py --out docs/benchmarks/quantization_accuracy_cpu.json

Per model and mode: teacher-forced top-1 agreement with the float model and mean |logprob difference|
over jaxinfer.bench.accuracy.HELD_TEXTS, device bytes of the weights and the KV cache
(engine_stats()), and greedy tokens/s of a small batch on this machine (CPU: a relative figure only).
Prints a Markdown table (the one in docs/QUANTIZATION.md) and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jaxinfer import LLM, SamplingParams
from jaxinfer.bench.accuracy import HELD_TEXTS, compare, teacher_forced

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
# (label, LLM arguments): the float model first; every other row is compared with it. "bf16 compute" quantizes
# nothing: the float model's weights and activations in bfloat16, a reference for how far the metric moves under
# the smallest change a GPU user makes anyway.
MODES = (
    ("float32", dict(quantization="none")),
    ("bf16 compute", dict(quantization="none", dtype="bfloat16")),
    ("gguf (auto)", dict(quantization="auto")),
    ("int8", dict(quantization="int8")),
    ("int8 g128", dict(quantization="int8:128")),
    ("int8 g64", dict(quantization="int8:64")),
    ("int8 g32", dict(quantization="int8:32")),
    ("int4", dict(quantization="int4")),
    ("fp8", dict(quantization="fp8")),
    ("int8 KV", dict(quantization="none", kv_cache_dtype="int8")),
    ("fp8 KV", dict(quantization="none", kv_cache_dtype="fp8")),
)
ENGINE = dict(dtype="float32", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, num_pages=160,
              page_size=16, attention_impl="reference", use_tqdm=False)


def tokens_per_second(llm: LLM, n_tokens: int = 32) -> float:
    """Greedy output tokens/s of 4 short prompts (after a first run that compiles)."""
    prompts = [t[:80] for t in HELD_TEXTS[:4]]
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def measure(model: str, modes: tuple = MODES) -> list[dict]:
    rows, reference = [], None
    for label, kwargs in modes:
        llm = LLM(model, **{**ENGINE, **kwargs})
        run = teacher_forced(llm)
        reference = reference or run
        stats = llm.engine_stats()
        rows.append({"model": model, "mode": label, **kwargs, **compare(reference, run),
                     "weight_bytes": stats["weight_bytes"], "kv_cache_bytes": stats["kv_cache_bytes"],
                     "tok_s": round(tokens_per_second(llm), 1)})
        print(json.dumps(rows[-1]), flush=True)
        del llm
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | mode | top-1 agreement | mean abs logprob diff | weight MB | KV cache MB | tok/s (CPU) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {100 * r['top1_agreement']:.1f}% | "
                     f"{r['mean_abs_logprob_diff']:.4f} | {r['weight_bytes'] / 1e6:.1f} | "
                     f"{r['kv_cache_bytes'] / 1e6:.1f} | {r['tok_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,gemma3", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--modes", default=None, help="comma-separated labels of MODES (the float model always "
                                                        "runs first, as the reference); default: all")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    wanted = None if args.modes is None else set(args.modes.split(","))
    modes = tuple(m for i, m in enumerate(MODES) if i == 0 or wanted is None or m[0] in wanted)
    rows = [row for name in args.models.split(",") for row in measure(MODELS[name], modes)]
    print(markdown(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"positions_per_model": rows[0]["positions"], "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
