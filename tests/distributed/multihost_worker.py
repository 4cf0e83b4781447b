"""One process of the multi-host test (tests/distributed/test_multihost.py); not collected by pytest.

Joins the run through the JAX_* environment variables, loads the bundled Gemma-3-270M with its single KV
head replicated over a 4-device tensor axis that spans both processes, generates the golden greedy cases,
then runs the same cases as a batch job (every process runs them; only process 0 writes). Process 0 writes
the tokens and the engine's description as JSON to argv[1].
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from jaxinfer import LLM, SamplingParams, distributed
from jaxinfer.batch import run_job

ENGINE = dict(dtype="float32", tensor_parallel_size=4, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              num_pages=16, attention_impl="reference", use_tqdm=False)
NEW = 6


def batch_job(out_dir: Path, cases: list[dict]) -> Path:
    """A job over the same cases, written by process 0 (every process reads the same files)."""
    job = out_dir / "job.yaml"
    if distributed.is_writer():
        rows = [{"id": i, "prompt": c["prompt_ids"]} for i, c in enumerate(cases)]
        (out_dir / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        # Without warmup: the Python API's engine above warms up over the two processes; the job's point is that
        # process 0 alone writes, and its engine compiles only the programs these two cases run.
        engine = {**{k: v for k, v in ENGINE.items() if k != "use_tqdm"}, "warmup": False}
        sampling = {"max_tokens": NEW, "min_tokens": NEW, "temperature": 0.0, "ignore_eos": True,
                    "stop_token_ids": cases[0]["suppressed_token_ids"]}
        job.write_text(yaml.safe_dump({"model": "gemma3-270m", "engine": engine, "sampling": sampling,
                                       "input": {"path": str(out_dir / "in.jsonl")},
                                       "output": {"path": str(out_dir / "out.jsonl")}}))
    distributed.broadcast_json(0)  # a barrier: the files exist before anyone reads them
    return job


def main(out_path: str) -> None:
    distributed.initialize()
    golden = json.loads((Path(__file__).parents[1] / "golden" / "gemma3-270m.json").read_text())
    cases = [c for c in golden["greedy"] if len(c["prompt_ids"]) < 32][:2]
    llm = LLM("gemma3-270m", **ENGINE)
    params = [SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0.0, ignore_eos=True,
                             stop_token_ids=tuple(c["suppressed_token_ids"])) for c in cases]
    outs = llm.generate([c["prompt_ids"] for c in cases], params)
    desc = llm.describe()
    del llm
    out_dir = Path(out_path).parent
    summary = run_job(batch_job(out_dir, cases), use_tqdm=False)
    if distributed.is_writer():
        job_tokens = [json.loads(line)["token_ids"] for line in (out_dir / "out.jsonl").read_text().splitlines()]
        Path(out_path).write_text(json.dumps({
            "tokens": [o.token_ids for o in outs], "want": [c["output_ids"][:NEW] for c in cases],
            "job_tokens": job_tokens, "job_completed": summary["requests_completed"],
            "process_count": desc["process_count"], "devices": desc["devices"], "mesh": desc["mesh"]}))


if __name__ == "__main__":
    main(sys.argv[1])
