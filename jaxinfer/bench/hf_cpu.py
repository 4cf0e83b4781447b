"""HF transformers side of `jaxinfer bench --device cpu`: greedy decode of a GGUF checkpoint on the CPU.

Runs under any interpreter with torch, transformers and gguf (`--hf-python`); reads a spec with the GGUF
path, the prompts (token ids, all the same length, so no padding changes the work) and the batch sizes, and
prints one JSON record: per batch size the best of `rounds` timed `generate` calls after one warmup call.

    python jaxinfer/bench/hf_cpu.py SPEC.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(spec.get("threads") or os.cpu_count() or 1)
    path = Path(spec["gguf"])
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    new = spec["new_tokens"]
    record = {"torch": torch.__version__, "threads": torch.get_num_threads(), "batches": {}}
    for batch in spec["batches"]:
        ids = torch.tensor(spec["prompts"][:batch], dtype=torch.long)  # [B, L]
        kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                      attention_mask=torch.ones_like(ids), pad_token_id=0)
        with torch.inference_mode():
            model.generate(ids, **kwargs)  # warmup
            times = []
            for _ in range(spec["rounds"]):
                t = time.perf_counter()
                out = model.generate(ids, **kwargs)
                times.append(time.perf_counter() - t)
        produced = int((out.shape[1] - ids.shape[1]) * batch)
        record["batches"][str(batch)] = {"best_s": min(times), "times_s": times, "output_tokens": produced,
                                         "tok_s": produced / min(times),
                                         "first_row": out[0, ids.shape[1]:].tolist()}
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
