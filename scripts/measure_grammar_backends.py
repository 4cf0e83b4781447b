"""Measure the two structured-output backends, llguidance and xgrammar, on a real tokenizer.

For each named case of jaxinfer.bench.schemas (12 JSON schemas, a regex, a choice list, a Lark grammar):
  compile_ms      the grammar compiled cold (llguidance: a new LLMatcher; xgrammar: compile_* on a compiler
                  whose cache is cleared);
  matcher_ms      a matcher for one more request from the cached compiled grammar (llguidance: deep_copy of
                  the cached matcher; xgrammar: GrammarMatcher(compiled));
  token_us        per generated token, the mask fill of one row plus the advance by the token, walking the
                  tokens of the case's valid example (each token is checked to be allowed by the mask);
and for a batch of 64 rows at once, the mask fill of the whole [64, V/32] bitmask with each library's parallel
fill (llguidance LLExecutor, xgrammar BatchGrammarMatcher), per step.

    python scripts/measure_grammar_backends.py --out docs/benchmarks/grammar_backends.json

xgrammar imports torch: on a machine without it, install both in a side directory and put it on PYTHONPATH
(`pip install --target /tmp/xgr xgrammar torch`); the numbers are written as JSON and summarized on stdout.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxinfer.bench.schemas import CHOICES, EXAMPLES, LARK_EXAMPLE, LARK_GRAMMAR, REGEX, REGEX_EXAMPLE, SCHEMAS

SEPARATORS = (", ", ": ")  # json.dumps' own, and what the engine asks both libraries for


def cases() -> list[tuple[str, str, Any, str]]:
    """(name, kind, spec, example text)."""
    out = [(name, "json", SCHEMAS[name], json.dumps(EXAMPLES[name], separators=SEPARATORS)) for name in SCHEMAS]
    out.append(("regex", "regex", REGEX, REGEX_EXAMPLE))
    out.append(("choice", "choice", CHOICES, CHOICES[1]))
    out.append(("lark", "lark", LARK_GRAMMAR, LARK_EXAMPLE))
    return out


def _ms(t: float) -> float:
    return (time.perf_counter() - t) * 1e3


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.numpy

        self.ll = llguidance
        t = time.perf_counter()
        hf = tokenizer._backend.tok  # the HF `tokenizers` object behind a byte-level BPE tokenizer
        self.tok = llguidance.LLTokenizer(hf.to_str(), eos_token=sorted(tokenizer.eos_token_ids))
        self.setup_ms = _ms(t)
        self.executor = llguidance.LLExecutor()

    def grammar(self, kind: str, spec: Any) -> str:
        m = self.ll.LLMatcher
        if kind == "json":
            options = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}
            return m.grammar_from_json_schema(json.dumps(spec), overrides=options)
        if kind == "regex":
            return m.grammar_from_regex(spec)
        if kind == "choice":
            return self.ll.grammar_from("choice", spec)
        return m.grammar_from_lark(spec)

    def compile(self, kind: str, spec: Any) -> Any:
        matcher = self.ll.LLMatcher(self.tok, self.grammar(kind, spec), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, mask: np.ndarray) -> None:
        self.ll.numpy.fill_next_token_bitmask(matcher, mask, 0)

    def advance(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def fill_batch(self, matchers: list[Any], mask: np.ndarray) -> None:
        self.ll.numpy.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar

        self.xgr = xgrammar
        t = time.perf_counter()
        vocab = [tokenizer._backend.id_to_token(i) for i in range(tokenizer.vocab_size)]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=tokenizer.vocab_size,
                                      stop_token_ids=sorted(tokenizer.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info)
        self.setup_ms = _ms(t)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, kind: str, spec: Any) -> Any:
        self.compiler.clear_cache()
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=SEPARATORS)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in spec))
        return c.compile_lark(spec) if hasattr(c, "compile_lark") else c.compile_grammar(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, mask: np.ndarray) -> None:
        import torch

        matcher.fill_next_token_bitmask(torch.from_numpy(mask), 0)

    def advance(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def fill_batch(self, matchers: list[Any], mask: np.ndarray) -> None:
        import torch

        self.batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(mask))


def allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def measure_case(backend: Any, tokenizer: Any, kind: str, spec: Any, example: str) -> dict[str, Any]:
    t = time.perf_counter()
    compiled = backend.compile(kind, spec)
    compile_ms = _ms(t)
    t = time.perf_counter()
    for _ in range(10):
        backend.matcher(compiled)
    matcher_ms = _ms(t) / 10
    tokens = tokenizer.encode(example, add_special_tokens=False) + [min(tokenizer.eos_token_ids)]
    matcher = backend.matcher(compiled)
    mask = np.zeros((1, -(-tokenizer.vocab_size // 32)), np.int32)
    per_token = []
    for token in tokens:
        t = time.perf_counter()
        backend.fill(matcher, mask)
        ok = allowed(mask, token) and backend.advance(matcher, token)
        per_token.append((time.perf_counter() - t) * 1e6)
        if not ok:
            raise AssertionError(f"{backend.name}: token {token} of {example!r} refused")
    return {"compile_ms": compile_ms, "matcher_ms": matcher_ms, "tokens": len(tokens),
            "token_us_mean": statistics.mean(per_token), "token_us_max": max(per_token)}


def measure_batch(backend: Any, tokenizer: Any, rows: int, steps: int) -> dict[str, Any]:
    """`rows` matchers of the nested schema, stepped together along its example: batch fill per step."""
    compiled = backend.compile("json", SCHEMAS["nested"])
    example = json.dumps(EXAMPLES["nested"], separators=SEPARATORS)
    tokens = tokenizer.encode(example, add_special_tokens=False)[:steps]
    matchers = [backend.matcher(compiled) for _ in range(rows)]
    mask = np.zeros((rows, -(-tokenizer.vocab_size // 32)), np.int32)
    times = []
    for token in tokens:
        t = time.perf_counter()
        backend.fill_batch(matchers, mask)
        times.append(_ms(t))
        for m in matchers:
            backend.advance(m, token)
    return {"rows": rows, "steps": len(tokens), "fill_ms_mean": statistics.mean(times), "fill_ms_max": max(times)}


def run(model: str, rows: int) -> dict[str, Any]:
    from jaxinfer.presets import bundled_checkpoint
    from jaxinfer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(bundled_checkpoint(model))
    result: dict[str, Any] = {"tokenizer": model, "vocab_size": tokenizer.vocab_size, "machine": platform.processor()
                              or platform.machine(), "backends": {}}
    for cls in (LLGuidance, XGrammar):
        try:
            backend = cls(tokenizer)
        except ImportError as e:
            result["backends"][cls.name] = {"error": f"not importable: {e}"}
            continue
        per_case = {name: measure_case(backend, tokenizer, kind, spec, ex) for name, kind, spec, ex in cases()}
        json_cases = [v for k, v in per_case.items() if k in SCHEMAS]
        result["backends"][cls.name] = {
            "tokenizer_setup_ms": backend.setup_ms,
            "json_compile_ms_mean": statistics.mean(c["compile_ms"] for c in json_cases),
            "json_compile_ms_max": max(c["compile_ms"] for c in json_cases),
            "matcher_from_cache_ms_mean": statistics.mean(c["matcher_ms"] for c in per_case.values()),
            "token_us_mean": statistics.mean(c["token_us_mean"] for c in per_case.values()),
            "token_us_max": max(c["token_us_max"] for c in per_case.values()),
            "batch": measure_batch(backend, tokenizer, rows, steps=24),
            "cases": per_case,
        }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="bundled checkpoint whose tokenizer is used")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = run(args.model, args.rows)
    for name, r in result["backends"].items():
        if "error" in r:
            print(f"{name}: {r['error']}")
            continue
        print(f"{name}: tokenizer {r['tokenizer_setup_ms']:.0f} ms, JSON compile mean {r['json_compile_ms_mean']:.1f} ms"
              f" (max {r['json_compile_ms_max']:.1f}), matcher from cache {r['matcher_from_cache_ms_mean']:.3f} ms,"
              f" fill+advance {r['token_us_mean']:.0f} us/token (max {r['token_us_max']:.0f}),"
              f" batch {r['batch']['rows']} fill {r['batch']['fill_ms_mean']:.2f} ms/step")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
