"""Which int8 layout of the bundled models agrees with their float model, tensor class by tensor class.

    PYTHONPATH=$PWD python scripts/int8_layouts.py --out docs/benchmarks/int8_layouts_cpu.json

quantization="int8" is symmetric per output channel. This study swaps the plan's formats (the kernels take every
layout below: GGUF's Q5_1 blocks are int8 with zero points) to see where its disagreement with the float model
comes from: the layout of the body's matrices or of the embedding / LM head. The float model of both bundled
files is itself a GGUF dequantized, i.e. values on 4-bit (Q4_1, Q4_K) or 6-bit (Q6_K) grids per block, and on
8-bit Q8_0 grids for SmolLM2's tied embedding; a layout whose groups line up with those blocks reproduces them.
Teacher-forced over every held text of jaxinfer.bench.accuracy (CPU; a few seconds a layout).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jaxinfer.quantization as quantization
from jaxinfer import LLM
from jaxinfer.bench.accuracy import HELD_TEXTS, compare, teacher_forced

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256, num_pages=48,
              page_size=16, attention_impl="reference", use_tqdm=False, warmup=False)
# (body, embedding / LM head): "pc" per output channel or a group size; "sym" or "zp" (zero points); "float".
LAYOUTS = (("pc/sym", "pc/sym"), ("32/sym", "32/sym"), ("64/sym", "64/sym"), ("32/zp", "32/zp"),
           ("64/zp", "64/zp"), ("pc/sym", "float"), ("32/zp", "float"), ("32/zp", "32/sym"))


def qformat(layout: str) -> quantization.QFormat | None:
    if layout == "float":
        return None
    group, kind = layout.split("/")
    return quantization.QFormat(8, None if group == "pc" else int(group), zeros=kind == "zp")


def with_layout(body: str, head: str):
    """A method_plan that gives int8 weights `body`'s format and the embedding / LM head `head`'s."""
    plain = quantization.method_plan

    def plan(specs, config):
        heads = quantization._head_paths(specs)
        formats = {path: qformat(head if path in heads else body) for path in plain(specs, config)}
        return {path: fmt for path, fmt in formats.items() if fmt is not None}
    return plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2,gemma3")
    p.add_argument("--out", default="int8_layouts_cpu.json")
    args = p.parse_args()
    rows, plain = [], quantization.method_plan
    for name in args.models.split(","):
        reference = teacher_forced(LLM(MODELS[name], quantization="none", **ENGINE), HELD_TEXTS)
        for body, head in LAYOUTS:
            quantization.method_plan = with_layout(body, head)
            try:
                run = teacher_forced(LLM(MODELS[name], quantization="int8", **ENGINE), HELD_TEXTS)
            finally:
                quantization.method_plan = plain
            rows.append({"model": MODELS[name], "body": body, "head": head, **compare(reference, run)})
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
