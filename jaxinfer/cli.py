"""Command line: `jaxinfer generate | batch | bench | convert | serve | bench-serve`.

Every user mistake (a bad argument, job file, record section, checkpoint or path) ends the command with one
line on stderr naming what is wrong, and exit code 2; bad records inside a batch job do not end it (they go
to the job's error file)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jaxinfer.checkpoint import CheckpointError
from jaxinfer.config import ConfigError
from jaxinfer.llm_args import ATTENTION_IMPLS


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="GGUF file, HF/orbax directory or preset alias")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on GPU/TPU, float32 on CPU")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--expert-parallel-size", type=int, default=1)
    p.add_argument("--sequence-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the platform's (jaxinfer.platform)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the platform's")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV page (default 16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of each device's memory the engine may use (vLLM's meaning)")
    p.add_argument("--attention-impl", default="auto", choices=ATTENTION_IMPLS)
    _quantization_args(p)


def _quantization_args(p: argparse.ArgumentParser) -> None:
    """The weight and KV formats (docs/QUANTIZATION.md); checked by LLM's argument table, not argparse, so a
    bad value gets the same sentence here as from Python."""
    p.add_argument("--quantization", default=None,
                   help="unset: auto, except on CPU, where a .gguf whose float weights take at most 1/8 of the "
                        "memory is dequantized at load | auto (a .gguf keeps its quantization) | none | int8 | int4 | "
                        "fp8; int8:G / int4:G set the group size G")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | bfloat16 | float16 | float32 | fp8 | int8")


def _distributed_args(p: argparse.ArgumentParser) -> None:
    """Joining a multi-host run (jaxinfer.distributed.initialize); the JAX_* environment variables, or on a
    TPU pod nothing at all, work too."""
    p.add_argument("--coordinator-address", default=None, help="host:port of process 0 (JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, default=None, help="JAX_NUM_PROCESSES")
    p.add_argument("--process-id", type=int, default=None, help="JAX_PROCESS_ID")


def _join(args: argparse.Namespace) -> None:
    """Join a multi-process run when the command line or the environment asks for one."""
    import os

    from jaxinfer import distributed

    if args.coordinator_address or args.num_processes or os.environ.get(distributed.ENV_ADDRESS):
        distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference on JAX/XLA.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate continuations for prompts")
    _engine_args(gen)
    _distributed_args(gen)
    _sampling_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated (one prompt)")
    batch = sub.add_parser("batch", help="run a YAML or gin batch job (resumable)")
    batch.add_argument("job", help="path to JOB.yaml or JOB.gin")
    _distributed_args(batch)
    bench = sub.add_parser("bench", help="end-to-end benchmark: throughput grid, concurrency sweep, MBU/MFU, HF baseline")
    from jaxinfer.bench.main import add_arguments

    add_arguments(bench)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the `serve` extra)",
                           description=_serve_doc())
    from jaxinfer.serve.main import add_arguments as add_serve_arguments

    add_serve_arguments(serve)
    bench_serve = sub.add_parser("bench-serve", help="load generator against an OpenAI-compatible server")
    from jaxinfer.bench.serve_bench import add_arguments as add_bench_serve_arguments

    add_bench_serve_arguments(bench_serve)
    conv = sub.add_parser("convert", help="convert a checkpoint to an orbax directory")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    conv.add_argument("--quantization", default=None,
                      help="write the weights quantized: int8 | int4 | fp8 (int8:G / int4:G: group size G), or "
                           "auto / unset (a .gguf keeps its quantization, other checkpoints stay float), none")
    return parser


def _llm(args: argparse.Namespace):  # noqa: ANN202 - imported lazily: JAX start-up is slow for --help
    from jaxinfer import LLM
    from jaxinfer.describe import format_description

    _join(args)
    llm = LLM(
        args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size, expert_parallel_size=args.expert_parallel_size,
        sequence_parallel_size=args.sequence_parallel_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, attention_impl=args.attention_impl,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
    )
    print(format_description(llm.describe()), file=sys.stderr)  # the mesh and memory, once, at start
    return llm


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxinfer import SamplingParams
    from jaxinfer.chat import chat_prompts

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)  # checked before the model loads
    llm = _llm(args)
    prompts = args.prompt
    if args.chat:
        prompts = chat_prompts(llm.tokenizer, [[{"role": "user", "content": p}] for p in prompts])
    if args.stream:
        for out in llm.stream(prompts[:1], params):
            print(out.outputs[0].delta_text, end="", flush=True)
        print()
        return 0
    for prompt, out in zip(args.prompt, llm.generate(prompts, params)):
        print(f"--- prompt: {prompt!r}")
        print(out.text)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxinfer.llm import LLM
    from jaxinfer.checkpoint.orbax import save_checkpoint

    # The weights are quantized as they load (one weight at a time through the host), so what is saved is
    # exactly what LLM(..., quantization=...) would hold; the plan goes beside them to restore them as such.
    # Unset means 'auto' here on every platform: a converted .gguf keeps its blocks (a CPU's float default is for
    # running, not for what is written).
    llm = LLM(args.src, dtype=args.dtype, quantization=args.quantization or "auto", warmup=False, num_pages=2,
              use_tqdm=False)
    path = save_checkpoint(args.dst, llm.model_config, llm.weights, llm.tokenizer, llm.quant_plan)
    print(f"wrote {path}")
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    from jaxinfer.batch import run_job

    _join(args)
    run_job(args.job)
    return 0


def cmd_bench(args: argparse.Namespace, argv: list[str]) -> int:
    from jaxinfer.bench.main import execute

    return execute(args, argv[argv.index("bench") + 1 :])


def _serve_doc() -> str:
    from jaxinfer.serve import main as serve_main

    return serve_main.__doc__ or ""


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxinfer.serve.main import serve

    return serve(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from jaxinfer.bench.serve_bench import execute

    return execute(args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "convert": cmd_convert, "batch": cmd_batch,
                "bench": lambda a: cmd_bench(a, argv), "serve": cmd_serve,
                "bench-serve": cmd_bench_serve}
    try:
        return handlers[args.command](args)
    except (ConfigError, CheckpointError, ValueError, OSError) as e:  # user mistakes: one line, no traceback
        print(f"jaxinfer {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"jaxinfer {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
