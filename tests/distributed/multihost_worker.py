"""One process of the multi-host test (tests/distributed/test_multihost.py); not collected by pytest.

Joins the run through the JAX_* environment variables, loads the bundled Gemma-3-270M with its single KV
head replicated over a 4-device tensor axis that spans both processes, generates the golden greedy cases
and, on process 0 only, writes the tokens and the engine's description as JSON to argv[1].
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxinfer import LLM, SamplingParams, distributed


def main(out_path: str) -> None:
    distributed.initialize()
    golden = json.loads((Path(__file__).parents[1] / "golden" / "gemma3-270m.json").read_text())
    cases = [c for c in golden["greedy"] if len(c["prompt_ids"]) < 32][:2]
    llm = LLM("gemma3-270m", dtype="float32", tensor_parallel_size=4, max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=32, num_pages=16, attention_impl="reference", use_tqdm=False)
    params = [SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0, ignore_eos=True,
                             stop_token_ids=tuple(c["suppressed_token_ids"])) for c in cases]
    outs = llm.generate([c["prompt_ids"] for c in cases], params)
    if distributed.is_writer():
        desc = llm.describe()
        Path(out_path).write_text(json.dumps({
            "tokens": [o.token_ids for o in outs], "want": [c["output_ids"][:6] for c in cases],
            "process_count": desc["process_count"], "devices": desc["devices"], "mesh": desc["mesh"]}))


if __name__ == "__main__":
    main(sys.argv[1])
