"""HF transformers beam-search goldens for jaxinfer's `LLM.beam_search` parity test.

How to rerun (from the repository root, with the interpreter described in scripts/make_golden.py)::

    HF_HUB_OFFLINE=1 /work/golden-venv/bin/python scripts/make_beam_golden.py

It writes tests/golden/smollm2-135m-instruct-beam.json: for each case, the prompt ids, the beam-search
settings (num_beams, max_new_tokens, length_penalty, early_stopping) and every returned beam best first
(num_return_sequences = num_beams), each with its generated token ids (EOS included when it ended on one),
HF's `sequences_scores` (the length-penalised score beam search ranks by) and the sum of the raw token
logprobs along the beam. Generation is float32 on CPU from the bundled Q4_1 GGUF, dequantized by
transformers, with `do_sample=False` and no logits processors beyond what beam search itself does.
This script never imports jaxinfer.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden  # noqa: E402  (same folder; shares the model loading and the offline env settings)

OUT = make_golden.DEFAULT_OUT / "smollm2-135m-instruct-beam.json"

# (name, prompt or chat messages, max_new_tokens, length_penalty, early_stopping). The chat cases end on EOS
# (<|im_end|>) well before max_new_tokens, so finished-beam bookkeeping and the length penalty of short
# hypotheses are exercised; the plain-text ones run to max_new_tokens.
CASES = [
    ("recipe", "A recipe for lentil soup begins with", 12, 1.0, True),
    ("yes_no", [{"role": "user", "content": "Is water wet? Answer with one word."}], 16, 1.0, True),
    ("capital", [{"role": "user", "content": "What is the capital of France? Reply in three words."}], 16, 1.0,
     True),
    ("lagoon", "Once upon a time, in a village built on stilts above a quiet lagoon,", 10, 0.6, False),
    ("primes", "The first five prime numbers are", 10, 2.0, "never"),
]
NUM_BEAMS = 4


def prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return make_golden.as_id_list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return make_golden.as_id_list(tokenizer(text, add_special_tokens=False)["input_ids"])


def beam_case(model, tokenizer, name, prompt, new, length_penalty, early_stopping) -> dict:
    ids = prompt_ids(tokenizer, prompt)
    inputs = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            inputs, attention_mask=torch.ones_like(inputs), do_sample=False, num_beams=NUM_BEAMS,
            num_return_sequences=NUM_BEAMS, max_new_tokens=new, length_penalty=length_penalty,
            early_stopping=early_stopping, return_dict_in_generate=True, output_scores=True,
            output_logits=True,
        )
    # out.beam_indices [num_beams, generated]: -1 past a beam's end, so it gives each beam's true length
    # (the sequences are padded with the pad id, which for SmolLM2 is also the EOS id).
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    logprobs = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices, normalize_logits=False)
    beams = []
    for b in range(NUM_BEAMS):
        gen = out.sequences[b, len(ids): len(ids) + lengths[b]].tolist()
        beams.append({
            "token_ids": gen,
            "text": tokenizer.decode(gen, skip_special_tokens=True),
            "score": float(out.sequences_scores[b]),
            "cum_logprob": float(logprobs[b, : lengths[b]].sum()),
        })
    print(f"[{name}] {len(ids)} prompt tokens; best: {beams[0]['text']!r} score {beams[0]['score']:.5f}",
          flush=True)
    return {"name": name, "prompt": prompt, "prompt_ids": ids, "num_beams": NUM_BEAMS, "max_new_tokens": new,
            "length_penalty": length_penalty, "early_stopping": early_stopping, "beams": beams}


def main() -> None:
    torch.manual_seed(0)
    tokenizer, model = make_golden.load_model(make_golden.locate_smollm2(), {"attn_implementation": "sdpa"})
    print(f"generation config: {model.generation_config.to_diff_dict()}", flush=True)
    golden = {
        "model": "smollm2-135m-instruct",
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "transformers_version": make_golden.transformers.__version__,
        "torch_version": torch.__version__,
        "eos_token_id": make_golden.eos_ids(model, tokenizer),
        "cases": [beam_case(model, tokenizer, *case) for case in CASES],
    }
    OUT.write_text(json.dumps(golden, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes); numpy {np.__version__}")


if __name__ == "__main__":
    main()
