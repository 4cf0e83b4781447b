"""`jaxinfer bench` (also `python scripts/bench.py`): the end-to-end benchmark on one device.

One command measures, in this order and in one process (the HF baseline in a subprocess before JAX takes
the GPU):
  HF transformers  the same 1000/1000 workload (and batch-1/64 decode) through torch on the same GPU;
  ceilings         copy bandwidth (best of JAX passes and the baseline's torch copy) and bf16 matmul rate;
  warmup           seconds to build the engine and compile every bucket; compiles after warmup (must be 0);
  decode MBU       batch 1 and 64; prefill MFU at 4k tokens;
  offline grid     128/128, 1000/1000, 2048/2048 and a ShareGPT-like mix, each beside its workload limit;
  sweep            serving at concurrency 1, 8, 32, 128, 256 (TTFT, TPOT, ITL, throughput), closed loop or, with
                   --sweep-request-rate, Poisson arrivals capped at each concurrency;
and writes latest.json (headline keys first) and a PNG plot. On the GPU machine:

    PYTHONPATH=$PWD python3 -m jaxinfer.cli bench --out $OUT/latest.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jaxinfer.bench import report
from jaxinfer.bench.limits import ModelCost, workload_limit
from jaxinfer.bench.workloads import Workload, fixed, parse

DEFAULT_GRID = ["128x128:1024", "1000x1000:256", "2048x2048:128", "sharegpt:512"]
HF_SCRIPT = Path(__file__).with_name("hf_baseline.py")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3-8b", help="preset alias (random weights) or a checkpoint")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="devices per engine replica")
    p.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas")
    p.add_argument("--expert-parallel-size", type=int, default=1, help="MoE experts split over this many devices")
    p.add_argument("--sequence-parallel-size", type=int, default=1, help="each step's tokens split this many ways")
    p.add_argument("--sections", nargs="*", default=None,
                   help="run only these sections (decode, decode_streamed, decode_device, prefill, grid, "
                        "hf_comparison, sweep)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the longest request benchmarked")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--memory-fraction", type=float, default=0.9, help="of free device memory, for the KV cache")
    p.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from --memory-fraction)")
    p.add_argument("--decode-steps-per-call", type=int, default=8)
    p.add_argument("--compile-threads", type=int, default=None)
    p.add_argument("--compilation-cache", default="auto",
                   help='persistent XLA cache directory; "auto" (~/.cache/jaxinfer/xla on GPU), or "none"')
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="prefill at most this many tokens of a prompt per step (0: no limit but the step's budget)")
    p.add_argument("--mixed-prefill-token-cap", type=int, default=0,
                   help="prompt tokens a step that decodes 1-16 rows may prefill in all (0: no cap)")
    p.add_argument("--no-overlap-decode", dest="overlap_decode", action="store_false",
                   help="read every decode call back before launching the next (the engine overlaps by default)")
    p.add_argument("--grid", nargs="*", default=DEFAULT_GRID, help="INxOUT:N or sharegpt:N workloads")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32, 128, 256])
    p.add_argument("--sweep-workload", default="1024x128", help="INxOUT of every sweep request")
    p.add_argument("--sweep-requests-per-slot", type=int, default=2, help="requests = max(4, this x concurrency)")
    p.add_argument("--sweep-request-rate", type=_positive_float, default=None,
                   help="sweep requests arrive as a Poisson process of this many a second, each concurrency a cap on "
                        "those in flight (default: closed loop, the next request as soon as one finishes)")
    p.add_argument("--decode-batches", type=int, nargs="*", default=[1, 64])
    p.add_argument("--decode-ctx", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=4096, help="0 skips the prefill MFU")
    p.add_argument("--copy-gib", type=float, default=4.0)
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--hf", choices=["run", "skip"], default="run", help="run the HF transformers baseline")
    p.add_argument("--hf-json", default=None, help="reuse a baseline result from an earlier run on this device")
    p.add_argument("--hf-only", default=None, metavar="JSON", help="run only the HF baseline and write it here")
    p.add_argument("--hf-prompts", type=int, default=64, help="1000/1000 prompts both stacks run for the ratio")
    p.add_argument("--hf-time-limit", type=float, default=240.0, help="seconds per HF mode before it is skipped")
    p.add_argument("--start-times", action="store_true",
                   help="first run a cold and a warm start, each in its own process (warm_start_s)")
    p.add_argument("--defaults-check", action="store_true",
                   help="first run the 1000/1000 workload with LLM(model) and no engine settings (defaults_fraction_of_tuned)")
    p.add_argument("--device", choices=["accelerator", "cpu"], default="accelerator",
                   help="cpu: the bundled SmolLM2-135M against HF transformers on this CPU (cpu_ratio_vs_hf_b*)")
    p.add_argument("--hf-python", default=sys.executable,
                   help="--device cpu: an interpreter with torch, transformers and gguf for the HF side")
    p.add_argument("--cpu-batches", type=int, nargs="*", default=[1, 32])
    p.add_argument("--cpu-new-tokens", type=int, default=64,
                   help="--device cpu: tokens each row generates (1 times the prefill and one sample)")
    p.add_argument("--carry", nargs="*", default=[], metavar="JSON",
                   help="earlier results (a --device cpu run, a --start-times or --defaults-check run) whose "
                        "start, defaults and CPU figures this run did not measure: carried into its headline, with their file")
    p.add_argument("--stack-dump-every", type=float, default=0, help="seconds between Python stack dumps (0: off)")
    p.add_argument("--out", default="bench_results/latest.json")
    p.add_argument("--plot", default=None, help="PNG path (default: beside --out); 'none' skips it")
    p.add_argument("--plot-only", default=None, metavar="JSON", help="only draw the plot of an existing result")


def _command(argv: list[str]) -> str:
    return "jaxinfer bench " + " ".join(argv)


def _workloads(specs: list[str]) -> list[Workload]:
    out = []
    for spec in specs:
        name, _, n = spec.partition(":")
        out.append(parse(name, int(n) if n else 256))
    return out


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def _max_model_len(args: argparse.Namespace, workloads: list[Workload], sweep: Workload) -> int:
    if args.max_model_len:
        return args.max_model_len
    need = [w.max_len for w in [*workloads, sweep]] + [args.decode_ctx + args.decode_steps + 16, args.prefill_tokens + 16]
    return -(-max(need) // args.page_size) * args.page_size


def _cache_entries(setting: str | None) -> int:
    """Files in the compilation cache directory `setting` resolves to (0 when off or absent)."""
    import jax

    from jaxinfer.llm import default_compilation_cache_dir

    if setting is None or (setting == "auto" and jax.default_backend() == "cpu"):
        return 0
    path = default_compilation_cache_dir() if setting == "auto" else Path(setting).expanduser()
    return sum(1 for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def hf_spec(cfg: Any, args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    """What the HF baseline runs: the same shape, random weights, the comparison workload and decode."""
    return {
        "architecture": cfg.architecture,
        "model": {
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_size, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
            "tie_word_embeddings": cfg.tie_word_embeddings,
        },
        "dtype": args.dtype,
        "device": "cuda",
        "seed": 0,
        "decode": {"ctx": args.decode_ctx, "steps": args.decode_steps, "batches": args.decode_batches},
        "throughput": [{"name": workload.name, "input_len": workload.input_lens[0],
                        "output_len": workload.output_lens[0], "num_prompts": workload.num_prompts}],
        "modes": ["static", "generate_batch"],
        "time_limit_s": args.hf_time_limit,
    }


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    """The baseline in its own process, so torch and JAX never hold the GPU at once."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "hf.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(HF_SCRIPT), "--spec", str(spec_path), "--out", str(out_path)]
        print("running the HF transformers baseline:", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, check=False)
        if proc.returncode != 0 or not out_path.exists():
            return {"error": f"HF baseline exited with {proc.returncode}"}
        return json.loads(out_path.read_text())


def run_baseline(args: argparse.Namespace) -> dict[str, Any]:
    """HF transformers on --model's preset shape and the 1000/1000 comparison workload of --hf-prompts."""
    from jaxinfer.presets import load_preset

    return run_hf(hf_spec(load_preset(str(args.model)), args, fixed(1000, 1000, args.hf_prompts)))


def hf_comparison(ours: dict[str, Any], hf: dict[str, Any], workload: Workload) -> dict[str, Any]:
    best = (hf.get("best_output_tok_s") or {}).get(workload.name)
    comparison = {"workload": workload.name, "num_prompts": workload.num_prompts,
                  "ours_output_tok_s": ours["output_tok_s"], "hf_output_tok_s": best,
                  "hf_best_mode": (hf.get("best_mode") or {}).get(workload.name), "hf_device": hf.get("device"),
                  "prefix_cache_hit_tokens": ours.get("prefix_cache_hit_tokens")}
    if best:
        comparison["ratio"] = ours["output_tok_s"] / best
    return comparison


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from jaxinfer.presets import BUNDLED, is_alias

    workloads = _workloads(args.grid)
    sweep_in, sweep_out = (int(x) for x in args.sweep_workload.split("x"))
    sweep_shape = fixed(sweep_in, sweep_out, 1)
    hf_workload = fixed(1000, 1000, args.hf_prompts)
    model_name = args.model if isinstance(args.model, str) else f"{args.model.architecture} (custom config)"
    result: dict[str, Any] = {"command": _command(argv), "model": model_name, "dtype": args.dtype,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    hf: dict[str, Any] | None = None
    if args.hf_json:
        hf = json.loads(Path(args.hf_json).read_text())
        ran = [w for w in (hf.get("spec") or {}).get("throughput", []) if w.get("name") == hf_workload.name]
        if ran:  # compare on the prompts the baseline actually ran, whatever --hf-prompts says
            hf_workload = fixed(1000, 1000, int(ran[0]["num_prompts"]))
    elif args.hf == "run" and isinstance(args.model, str) and args.model not in BUNDLED and is_alias(args.model):
        hf = run_baseline(args)
    result["hf"] = hf
    _child_sections(args, result, workloads)

    # JAX touches the device only from here on (jaxinfer asks its allocator for 92% of it: jaxinfer/__init__.py).
    import jax

    from jaxinfer import LLM
    from jaxinfer.bench import measure

    result["device"] = jax.devices()[0].device_kind
    result["jax"] = jax.__version__
    copies = measure.copy_bandwidth(args.copy_gib)
    if hf and hf.get("copy_bw_gbs") and hf.get("device") == result["device"]:
        copies["torch_copy"] = hf["copy_bw_gbs"] * 1e9
    copy_bw = max(copies.values())
    rate = measure.matmul_rate(args.matmul_n)
    result["ceilings"] = {"copy_bw_gbs": copy_bw / 1e9, "copy_methods_gbs": {k: v / 1e9 for k, v in copies.items()},
                          "matmul_tflops": rate / 1e12}
    print(json.dumps(result["ceilings"]), flush=True)

    def save() -> None:  # after every measurement: a run cut short keeps what it measured
        report.write({**result, "partial": True}, args.out)

    max_len = _max_model_len(args, workloads, sweep_shape)
    cache_dir = None if args.compilation_cache == "none" else args.compilation_cache
    cached_before = _cache_entries(cache_dir)
    t = time.perf_counter()
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    llm = LLM(args.model, random_weights=True, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              tensor_parallel_size=tp, data_parallel_size=dp, expert_parallel_size=args.expert_parallel_size,
              sequence_parallel_size=args.sequence_parallel_size,
              max_model_len=max_len, max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
              memory_fraction=args.memory_fraction, num_pages=args.num_pages, decode_steps_per_call=args.decode_steps_per_call,
              overlap_decode=args.overlap_decode, compile_threads=args.compile_threads, use_tqdm=False,
              compilation_cache_dir=cache_dir, long_prefill_token_threshold=args.long_prefill_token_threshold,
              mixed_prefill_token_cap=args.mixed_prefill_token_cap)
    result["warmup_s"] = time.perf_counter() - t
    t = time.perf_counter()  # measurements start once nothing is left compiling in the background (Engine.warmup)
    llm.engine.wait_for_background_compile()
    result["background_compile_s"] = time.perf_counter() - t
    replica = ReplicaView(llm)  # decode, prefill and profile sections measure one replica
    result["slow_steps"] = watch_slow_steps(replica.engine)
    result["mesh"] = _mesh_summary(llm)
    print(json.dumps(result["mesh"]), flush=True)
    cost = ModelCost.of(llm.model_config, llm.dtype)
    kv_tokens = replica.engine.scheduler.stats()["total_pages"] * args.page_size
    # One replica of n devices reads and computes at n times one device's measured rates.
    per_replica = tp * args.expert_parallel_size * args.sequence_parallel_size
    replica_bw, replica_rate = copy_bw * per_replica, rate * per_replica
    result["engine"] = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                        "max_model_len": max_len, "page_size": args.page_size, "kv_capacity_tokens": kv_tokens,
                        "decode_steps_per_call": args.decode_steps_per_call,
                        "overlap_decode": args.overlap_decode,
                        "long_prefill_token_threshold": args.long_prefill_token_threshold,
                        "mixed_prefill_token_cap": replica.engine.scheduler.mixed_prefill_token_cap,
                        "attention_impl": replica.engine.runner.attention_impl,
                        "weight_bytes_per_step": cost.weight_bytes_per_step,
                        "warmup_breakdown": replica.engine.runner.precompile_times,
                        # A warmup that found executables in the cache did not compile them: say which it was.
                        "compilation_cache": {"dir": str(llm.compilation_cache_dir or ""), "entries_before": cached_before,
                                              "entries_after": _cache_entries(cache_dir)}}
    print(json.dumps({"warmup_s": result["warmup_s"], **result["engine"]}), flush=True)

    def limit(w: Workload) -> dict[str, Any]:
        return workload_limit(cost, w, kv_capacity_tokens=kv_tokens, max_num_seqs=args.max_num_seqs,
                              copy_bw=replica_bw, matmul_rate=replica_rate, replicas=dp)

    def offline(w: Workload) -> dict[str, Any]:
        r = {"workload": w.name, **measure.offline_throughput(llm, w), "limit": limit(w)}
        return {**r, "fraction_of_limit": r["output_tok_s"] / r["limit"]["output_tok_s"]}

    def compare_hf() -> dict[str, Any]:
        return {**hf_comparison(measure.offline_throughput(llm, hf_workload), hf, hf_workload), "limit": limit(hf_workload)}

    sections: list[tuple[str, Any]] = [
        *[("decode", lambda b=b: measure.decode_mbu(replica, cost, b, args.decode_ctx, args.decode_steps, replica_bw))
          for b in args.decode_batches],
        # Small streamed batches decode in single steps (Engine.decodes_singly); the decode rows above are
        # `generate`'s requests, which return only when finished: where the two differ, measure both.
        *[("decode_streamed", lambda b=b: measure.decode_mbu(replica, cost, b, args.decode_ctx, args.decode_steps,
                                                             replica_bw, streamed=True))
          for b in args.decode_batches if b <= replica.engine.single_step_max_rows],
        *[("decode_device", lambda b=b: measure.decode_device_profile(replica, cost, b, args.decode_ctx, replica_bw))
          for b in args.decode_batches],
        *([("prefill", lambda: measure.prefill_mfu(replica, cost, args.prefill_tokens, replica_rate))]
          if args.prefill_tokens > 0 else []),
        *[("grid", lambda w=w: offline(w)) for w in workloads],
        *([("hf_comparison", compare_hf)] if hf is not None else []),
        *[("sweep", lambda c=c: {"workload": sweep_shape.name, **measure.serve_at_concurrency(
            llm, fixed(sweep_in, sweep_out, max(4, args.sweep_requests_per_slot * c)), c,
            request_rate=args.sweep_request_rate)}) for c in args.concurrency],
    ]
    for name, fn in sections:
        if args.sections is not None and name not in args.sections:
            continue
        # Every section starts from an empty prefix cache: workloads are drawn from one seed, so two of one input
        # length (the HF comparison's and the grid's 1000/1000, a sweep's and the grid's shape) begin with the same
        # prompts, and any two begin with the same first prompt's leading tokens (workloads.prompts).
        llm.reset_prefix_cache()
        try:
            value = fn()
        except Exception as e:  # one failed measurement must not cost the others
            result.setdefault("errors", []).append({"section": name, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"{name}: FAILED: {type(e).__name__}: {e}", flush=True)
            for engine in replica.all_engines:  # leave every replica empty for the next section
                for rid in list(engine.requests):
                    engine.abort(rid)
            continue
        if name in ("prefill", "hf_comparison"):
            result[name] = value
        else:
            result.setdefault(name, []).append(value)
        print(json.dumps({name: _brief(value)}), flush=True)
        save()

    stats = llm.engine_stats()
    result["recompiles_after_warmup"] = stats["num_compiles_after_warmup"]
    result["engine_stats"] = stats
    return result


def _child_sections(args: argparse.Namespace, result: dict[str, Any], workloads: list[Workload]) -> None:
    """The measurements that need processes of their own, run before this process's JAX takes the device."""
    from jaxinfer.bench import children

    if args.start_times:
        engine = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
                  "max_num_batched_tokens": args.max_num_batched_tokens, "memory_fraction": args.memory_fraction,
                  "decode_steps_per_call": args.decode_steps_per_call}
        result["start_times"] = children.start_times(args.model, engine)
        print(json.dumps({"start_times": result["start_times"]}), flush=True)
    if args.defaults_check:
        main = next((w for w in workloads if w.name == report.HEADLINE_WORKLOAD), fixed(1000, 1000, 256))
        spec = {"model": args.model, "workload": {"input_len": main.input_lens[0], "output_len": main.output_lens[0],
                                                  "num_prompts": main.num_prompts}}
        result["defaults_run"] = children.run_child("defaults", spec)
        print(json.dumps({"defaults_run": result["defaults_run"]}), flush=True)
    result["carried"] = carried_figures(args.carry)


def carried_figures(paths: list[str]) -> dict[str, tuple[Any, str]]:
    """The carriable headline figures (report.CARRIABLE) of earlier results, each with the file it came from;
    the first file that has a figure wins."""
    carried: dict[str, tuple[Any, str]] = {}
    for path in paths:
        for key, value in json.loads(Path(path).read_text()).items():
            if key in report.CARRIABLE and value is not None and key not in carried:
                carried[key] = (value, str(path))
    return carried


class ReplicaView:
    """One engine replica seen the way the measurements see an LLM (engine, model_config, engine_stats,
    generate): with data parallelism, latency figures (decode steps, prefill) are one replica's."""

    def __init__(self, llm: Any) -> None:
        self.all_engines = list(getattr(llm.engine, "engines", [llm.engine]))
        self.engine = self.all_engines[0]
        self.model_config = llm.model_config

    def engine_stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def generate(self, prompts: Any, params: Any, use_tqdm: bool = False) -> Any:
        return self.engine.generate(prompts, params, use_tqdm=use_tqdm)


def _mesh_summary(llm: Any) -> dict[str, Any]:
    """The parts of llm.describe() a benchmark result should carry."""
    desc = llm.describe()
    keep = ("mesh", "data_parallel_size", "process_count", "weight_bytes_per_device", "kv_cache_bytes_per_device",
            "num_pages", "collectives_per_decode_step")
    return {k: desc[k] for k in keep} | {"num_devices": sum(len(r) for r in desc["replica_devices"])}


def watch_slow_steps(engine: Any, threshold_s: float = 2.0) -> list[dict[str, Any]]:
    """Log every engine step slower than `threshold_s` (with the compiles it triggered and the queue
    sizes) into the returned list, which the result keeps: a stall shows where it happened."""
    slow: list[dict[str, Any]] = []
    step = engine.step

    def timed_step() -> Any:
        start, compiles = time.perf_counter(), engine.runner.num_compiles
        out = step()
        seconds = time.perf_counter() - start
        if seconds > threshold_s:
            stats = engine.scheduler.stats()
            slow.append({"step": engine.num_steps, "seconds": seconds, "compiles": engine.runner.num_compiles - compiles,
                         "running": stats["num_running"], "waiting": stats["num_waiting"]})
            print("slow engine step:", json.dumps(slow[-1]), flush=True)
        return out

    engine.step = timed_step
    return slow


def _brief(value: dict[str, Any]) -> dict[str, Any]:
    """The scalar fields of a section, for the progress log."""
    return {k: v for k, v in value.items() if isinstance(v, int | float | str)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxinfer bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    return execute(parser.parse_args(argv), argv)


def execute(args: argparse.Namespace, argv: list[str]) -> int:
    if args.stack_dump_every > 0:
        import faulthandler

        faulthandler.dump_traceback_later(args.stack_dump_every, repeat=True)
    if args.plot_only:
        result = json.loads(Path(args.plot_only).read_text())
        print(report.table(result))
        print("wrote", report.plot(result, args.plot or Path(args.plot_only).with_suffix(".png")))
        return 0
    if args.hf_only:
        hf = run_baseline(args)
        hf["command"] = _command(argv)
        Path(args.hf_only).parent.mkdir(parents=True, exist_ok=True)
        Path(args.hf_only).write_text(json.dumps(hf, indent=1) + "\n")
        print(json.dumps({k: hf.get(k) for k in ("device", "copy_bw_gbs", "best_output_tok_s", "best_mode", "error")}))
        return 0 if "error" not in hf else 1
    if args.device == "cpu":
        from jaxinfer.bench import cpu_vs_hf

        result = cpu_vs_hf.run(args.hf_python, args.cpu_batches, new_tokens=args.cpu_new_tokens)
        result["command"] = _command(argv)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k.startswith(("cpu_ratio", "same_first", "hf_error"))}))
        print("wrote", args.out)
        return 0 if all(f"cpu_ratio_vs_hf_b{b}" in result for b in args.cpu_batches) else 1
    result = run(args, argv)
    report.write(result, args.out)
    if args.plot != "none":
        try:
            print("wrote", report.plot(result, args.plot or Path(args.out).with_suffix(".png")))
        except ImportError:
            print("matplotlib is not installed: no plot (jaxinfer bench --plot-only JSON draws it later)")
    print(report.table(result))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
