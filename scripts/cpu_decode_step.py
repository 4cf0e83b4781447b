"""Where a CPU decode step of the bundled SmolLM2-135M goes (docs/PERFORMANCE.md, "CPU").

Times `LLM.generate` of B random 32-token prompts for 2 and for 34 new tokens (greedy, EOS ignored; best of
`--rounds` after a warmup) and prints the decode time per step, their difference over 32 steps. Then, with
`--floor`, the model's matmuls alone: the same [B, 576] x weight shapes of all 30 layers and the lm_head,
chained in one XLA program with nothing else (random weights), the floor a decode step cannot go under.

    PYTHONPATH=$PWD python scripts/cpu_decode_step.py --batch 32 --floor
    PYTHONPATH=$PWD python scripts/cpu_decode_step.py --batch 32 --no-attention      # attention's share
    PYTHONPATH=$PWD python scripts/cpu_decode_step.py --batch 32 --attention-impl reference --quantization auto
"""

from __future__ import annotations

import argparse
import time


def decode_ms_per_step(batch: int, rounds: int, llm_kwargs: dict) -> float:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.bench.cpu_vs_hf import MODEL, prompts

    llm = LLM(MODEL, max_num_seqs=batch, use_tqdm=False, **llm_kwargs)
    rows = prompts(llm.model_config.vocab_size, batch, 32)
    best = {}
    for new in (2, 34):
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        llm.generate(rows, params, use_tqdm=False)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            llm.generate(rows, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        best[new] = min(times)
    return (best[34] - best[2]) / 32 * 1e3


def matmul_floor_ms(batch: int, rounds: int = 20) -> float:
    """The decode step's matmuls only (SmolLM2-135M's shapes), in one jitted program."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.presets import load_preset

    cfg = load_preset("smollm2-135m")
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_size
    rng = np.random.default_rng(0)
    weight = lambda k, n: jnp.asarray(rng.standard_normal((k, n), np.float32) / np.sqrt(k))
    layers = [(weight(d, qkv), weight(d, d), weight(d, 2 * f), weight(f, d)) for _ in range(cfg.num_layers)]
    head = weight(d, v)

    def step(x, layers, head):
        for w_qkv, w_o, w_gate_up, w_down in layers:
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True))  # [B, D], values kept O(1)
            a = x @ w_qkv  # [B, qkv]
            gate_up = x @ w_gate_up  # [B, 2F]
            x = x + (gate_up[:, :f] * gate_up[:, f:]) @ w_down + x @ w_o + a[:, :d]  # [B, D]
        return x @ head  # [B, V]

    fn = jax.jit(step)
    x = jnp.asarray(rng.standard_normal((batch, d), np.float32))
    fn(x, layers, head).block_until_ready()
    start = time.perf_counter()
    for _ in range(rounds):
        fn(x, layers, head).block_until_ready()
    return (time.perf_counter() - start) / rounds * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--attention-impl", default=None, help="LLM attention_impl (default: the platform's)")
    ap.add_argument("--quantization", default=None, help="LLM quantization (default: the platform's)")
    ap.add_argument("--no-attention", action="store_true",
                    help="replace the CPU attention by an identity on the queries, to see what it costs")
    ap.add_argument("--floor", action="store_true", help="also time the matmuls alone")
    args = ap.parse_args()
    if args.no_attention:
        from pallas_kernels.ragged_paged_attention import xla

        xla.ragged_paged_attention = lambda q, *_, **__: q * 1.0
    kwargs = {k: getattr(args, k) for k in ("attention_impl", "quantization") if getattr(args, k) is not None}
    step = decode_ms_per_step(args.batch, args.rounds, kwargs)
    print(f"batch {args.batch}: decode {step:.1f} ms per step ({args.batch / step * 1e3:.0f} tok/s)"
          f"{' without attention' if args.no_attention else ''}")
    if args.floor:
        floor = matmul_floor_ms(args.batch)
        print(f"batch {args.batch}: the matmuls alone {floor:.1f} ms per step; the step is {step / floor:.2f}x that")


if __name__ == "__main__":
    main()
