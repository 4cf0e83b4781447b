"""Issue 17's speculative-decoding measurements in one command (jaxinfer.bench.spec does the measuring):

  1. measured: a real model (--real-model, SmolLM2's GGUF by default) at batch 1 on a prompt whose answer
     copies long spans of it: plain decoding, then n-gram speculation, same prompt and length, in this one
     run; speedup, identical output, acceptance. Acceptance: speedup >= 1.8 with identical tokens.
  2. shapes: --target (Llama-3-8B shape) with random weights and a small Llama-shaped draft of the same
     vocabulary (Llama-3.2-1B shape): seconds per plain decode iteration and per speculative step at each
     batch and k (the verify-step cost curve), and the speedup that curve models per acceptance rate
     (random weights accept nothing, so the speedup itself is modelled from the measured costs).

Writes --out (docs/benchmarks/spec.json in the repo) with both parts and the command line.

    # one H100 (the GGUF joined from two carried halves, see DESIGN.md):
    PYTHONPATH=$PWD python3 scripts/bench_spec.py --real-model /tmp/smollm2.gguf --out $OUT/spec.json
    # CPU smoke test (tiny random shapes, a few tokens): tests/test_bench_spec.py
    PYTHONPATH=$PWD python3 scripts/bench_spec.py --smoke --out /tmp/spec.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

from jaxinfer import LLM
from jaxinfer.bench import spec as bench

REQUIRED_SPEEDUP = 1.8
NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# Llama-3.2-1B's shape with Llama-3's vocabulary: a plausible draft for a Llama-3-8B target.
DRAFT_SHAPE = {"architecture": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
               "num_layers": 16, "num_heads": 32, "num_kv_heads": 8, "head_dim": 64, "rms_norm_eps": 1.0e-5,
               "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
               "bos_token_id": 128000, "eos_token_id": 128001}
SMOKE_TARGET = {**DRAFT_SHAPE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
                "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "bos_token_id": 1, "eos_token_id": 2}
SMOKE_DRAFT = {**SMOKE_TARGET, "num_layers": 1}
# Page counts fixed (not a memory fraction) so an LLM not yet released by Python cannot shrink the next one's.
ENGINE = {"dtype": "bfloat16", "max_model_len": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 1024,
          "num_pages": 3072, "page_size": 16}
SMOKE_ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 32,
                "num_pages": 64, "page_size": 16, "attention_impl": "reference",
                "warmup": False}  # compiles only what the few smoke calls use


def write_yaml(shape: dict[str, Any], folder: Path, name: str) -> str:
    path = folder / f"{name}.yaml"
    # JSON scalars are YAML, except floats: YAML 1.1 reads 1e-05 as a string, 1.000000e-05 as a number.
    path.write_text("".join(f"{k}: {f'{v:.6e}' if isinstance(v, float) else json.dumps(v)}\n" for k, v in shape.items()))
    return str(path)


def measured(args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any]:
    """Part 1: the plain LLM, then the n-gram one over the same weights file (the first released), batch 1."""
    model_kw: dict[str, Any] = {"random_weights": True} if args.smoke else {}
    model = args.smoke_target if args.smoke else args.real_model
    plain = LLM(model, **model_kw, **engine, use_tqdm=False)
    if args.smoke:  # token ids that repeat: the n-gram lookup finds them whatever the random weights say
        prompt = [(5 * i) % 97 + 3 for i in range(24)] * 2
    else:
        prompt = plain.tokenizer.encode(bench.copy_prompt(args.copy_repeat))
    baseline = bench.best_greedy(plain, prompt, args.max_tokens, args.repeats)
    del plain
    gc.collect()
    spec = LLM(model, **model_kw, **engine, speculative=NGRAM, use_tqdm=False)
    result = bench.measure_copy(baseline, spec, prompt, args.max_tokens, args.repeats)
    result.update(model=str(model), speculative=NGRAM, required_speedup=REQUIRED_SPEEDUP)
    result["passed"] = bool(result["identical"] and result["speedup"] >= REQUIRED_SPEEDUP)
    del spec
    gc.collect()
    return result


def shapes(args: argparse.Namespace, engine: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Part 2: the cost curve of --target with the draft shape, and the speedups it models."""
    draft = args.smoke_draft if args.smoke else write_yaml(DRAFT_SHAPE, folder, "draft")

    def make(k: int | None) -> Any:
        gc.collect()
        spec = None if k is None else {"method": "draft", "model": draft, "num_speculative_tokens": k}
        return LLM(args.smoke_target if args.smoke else args.target, random_weights=True, speculative=spec,
                   **engine, use_tqdm=False)

    vocab = SMOKE_TARGET["vocab_size"] if args.smoke else 128256
    curve = bench.cost_curve(make, args.batches, args.ks, args.prompt_len, args.steps, vocab)
    alphas = [0.0, 0.2, 0.4, 0.6, 0.8, 0.9]
    return {"target": args.target if not args.smoke else "smoke", "draft_shape": DRAFT_SHAPE if not args.smoke else
            SMOKE_DRAFT, "prompt_len": args.prompt_len, "seconds_per_step": curve,
            "modelled_speedup": bench.modelled_speedup(curve, alphas), "alphas": alphas}


def merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`old` updated by a later run `new` on the same device: parts `new` measured replace, the cost curve's
    k values are added (the plain curve keeps the earlier run's points and gains missing batches), and the
    modelled speedups are recomputed from the merged curve. Both command lines are kept."""
    if old.get("device") != new["device"]:
        raise SystemExit(f"--update: {old.get('device')!r} results cannot be merged with {new['device']!r} ones")
    out = {**old, **{k: v for k, v in new.items() if k != "shapes"}}
    out["command"] = [*(old["command"] if isinstance(old["command"], list) else [old["command"]]), new["command"]]
    if "shapes" in new:
        shapes_out = dict(old.get("shapes") or new["shapes"])
        curve = {"plain": {**new["shapes"]["seconds_per_step"]["plain"],
                           **(old.get("shapes") or {}).get("seconds_per_step", {}).get("plain", {})},
                 "spec": {**(old.get("shapes") or {}).get("seconds_per_step", {}).get("spec", {}),
                          **new["shapes"]["seconds_per_step"]["spec"]}}
        shapes_out.update(seconds_per_step=curve, modelled_speedup=bench.modelled_speedup(curve, shapes_out["alphas"]))
        out["shapes"] = shapes_out
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real-model", default="smollm2-135m-instruct", help="checkpoint path or bundled alias")
    p.add_argument("--target", default="llama-3-8b", help="preset of the cost curve's target (random weights)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--copy-repeat", type=int, default=2, help="copies of the text in the copying prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=32, help="decode iterations timed per curve point")
    p.add_argument("--parts", nargs="+", default=["measured", "shapes"], choices=["measured", "shapes"])
    p.add_argument("--smoke", action="store_true", help="tiny random shapes on CPU, a few tokens")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks/spec.json"))
    p.add_argument("--update", action="store_true",
                   help="merge into an existing --out: this run's parts replace, its curve points (k values, or "
                        "batches of the plain curve not there yet) are added; for runs split over several calls")
    args = p.parse_args(argv)
    if args.smoke:
        args.max_tokens, args.repeats, args.batches, args.ks = 12, 1, [1, 2], [2]
        args.prompt_len, args.steps = 8, 4
    return args


def main(argv: list[str]) -> dict[str, Any]:
    args = parse(argv)
    engine = SMOKE_ENGINE if args.smoke else ENGINE
    result: dict[str, Any] = {"command": "python3 scripts/bench_spec.py " + " ".join(argv),
                              "device": str(jax.devices()[0].device_kind), "engine": engine,
                              "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.smoke:
            args.smoke_target = write_yaml(SMOKE_TARGET, folder, "target")
            args.smoke_draft = write_yaml(SMOKE_DRAFT, folder, "draft")
        if "measured" in args.parts:
            result["measured"] = measured(args, engine)
            print(json.dumps(result["measured"]), flush=True)
        if "shapes" in args.parts:
            result["shapes"] = shapes(args, engine, folder)
            print(json.dumps(result["shapes"]["seconds_per_step"]), flush=True)
    if args.update and args.out.is_file():
        result = merged(json.loads(args.out.read_text()), result)
    if "measured" in result:
        result["passed"] = result["measured"]["passed"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}; passed: {result.get('passed')}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
