"""Build tiny random-weight Qwen3, Qwen3-MoE and Mixtral checkpoints with HF transformers, and their goldens.

No MoE checkpoint small enough to ship exists offline, so this script makes them: each model is built by
transformers from a tiny config, given deterministic random weights, saved with `save_pretrained`, loaded
back in float32, and run greedily. jaxinfer's parity tests (tests/test_parity_moe.py) load the saved
directories exactly as they are and must reproduce HF's tokens and log-probabilities.

How to rerun (from the repository root)::

    python3.11 -m venv /work/golden-venv
    /work/golden-venv/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl \
        transformers accelerate safetensors numpy
    HF_HUB_OFFLINE=1 /work/golden-venv/bin/python scripts/make_moe_golden.py

(transformers 5.23.0 and torch 2.13.0+cpu made the committed files.) `--models qwen3-moe-tiny` regenerates
one; `--data DIR` / `--golden DIR` write elsewhere. It never imports jaxinfer.

What it writes, per model NAME (qwen3-tiny, qwen3-moe-tiny, mixtral-tiny):

  tests/data/NAME/         `save_pretrained` as transformers 5 writes it by default: the published layout,
                           one tensor per expert (`mlp.experts.{e}.gate_proj` / `block_sparse_moe.experts.{e}.w1`).
  tests/data/NAME-fused/   (MoE models) `save_pretrained(save_original_format=False)`: transformers 5's own
                           fused layout, `mlp.experts.gate_up_proj` [E, 2F, D] and `mlp.experts.down_proj`
                           [E, D, F] (Mixtral's router then sits at `mlp.gate` too).
  tests/golden/NAME.json   the config, 4 token-id prompts (1 to 23 tokens) and for each the 12 greedy tokens
                           of HF's float32 forward with the per-step log-probability of each chosen token,
                           plus the margins that make greedy decisions safe to compare (below).

Weights: every matrix N(0, 1/fan_in) (the embedding N(0, 1)), norm weights 1 + N(0, 0.2) so a wrong norm
convention shows, all rounded to bfloat16 and saved as bfloat16 (half the bytes; float32 compute on
bf16-valued weights is exact on both sides, and real Qwen3/Mixtral checkpoints are bf16 too). The router
is scaled by ROUTER_SCALE and the lm_head by HEAD_SCALE so that neither expert choice nor the greedy
token hangs on a near-tie: a seed is kept only when, over every forward of the golden run, the gap between
the k-th and (k+1)-th router logit of every token is at least MIN_ROUTER_GAP and the gap between the best
and second-best output logit at every greedy step is at least MIN_TOKEN_GAP (both recorded in the JSON).

Greedy decoding is a plain loop of full forwards (use_cache=False, no EOS: the configs have no eos id), the
model in float32 with eager attention and the eager expert loop.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
ROUTER_SCALE = 4.0
HEAD_SCALE = 6.0
NORM_SPREAD = 0.2
MIN_ROUTER_GAP = 2e-3
MIN_TOKEN_GAP = 2e-2
NEW_TOKENS = 12
PROMPT_LENGTHS = (1, 5, 12, 23)
MAX_SEEDS = 50

COMMON = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
              max_position_embeddings=2048, bos_token_id=None, eos_token_id=None, pad_token_id=None)

MODELS = {
    # Dense Qwen3: QK-norm, head_dim 32 (4 x 32 != 64, like Qwen3-30B-A3B), tied embeddings (as Qwen3 <= 4B).
    "qwen3-tiny": (Qwen3Config, Qwen3ForCausalLM, dict(
        COMMON, num_hidden_layers=2, head_dim=32, intermediate_size=128, tie_word_embeddings=True,
        rope_theta=1_000_000.0)),
    # Qwen3-MoE: 6 layers, decoder_sparse_step 2 -> layers 1, 3, 5 are candidates, mlp_only_layers [3] keeps
    # 3 dense, so 1 and 5 are MoE (8 experts, top-2, not renormalized: HF's default; Mixtral covers the other).
    "qwen3-moe-tiny": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        COMMON, num_hidden_layers=6, head_dim=16, intermediate_size=64, moe_intermediate_size=24, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False,
        tie_word_embeddings=False, rope_theta=1_000_000.0)),
    # Mixtral: 3 layers, 8 experts of width 32, top-2 renormalized.
    "mixtral-tiny": (MixtralConfig, MixtralForCausalLM, dict(
        COMMON, num_hidden_layers=3, head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        tie_word_embeddings=False, sliding_window=None, rope_theta=1_000_000.0)),
}


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic weights as the module docstring describes, rounded to bfloat16 values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if "norm" in name:
                value = 1.0 + NORM_SPREAD * noise
            elif name.endswith("embed_tokens.weight"):
                value = noise
            else:
                scale = ROUTER_SCALE if name.endswith("mlp.gate.weight") else 1.0
                scale = HEAD_SCALE if name == "lm_head.weight" else scale
                value = noise * scale / np.sqrt(p.shape[-1])  # [.., out, in]: fan_in is the last axis
            p.copy_(value.to(torch.bfloat16).to(p.dtype))
        if model.config.tie_word_embeddings:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]


class RouterGaps:
    """Forward hooks on every router: the smallest gap between the k-th and (k+1)-th logit of any token."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.top_k = getattr(model.config, "num_experts_per_tok", 0)
        self.min_gap = float("inf")
        self.handles = [r.register_forward_hook(self._hook) for r in routers(model)]

    def _hook(self, module, inputs, output) -> None:
        logits = output[0] if isinstance(output, tuple) else output  # [tokens, E]
        top = torch.topk(logits.double(), self.top_k + 1, dim=-1).values
        self.min_gap = min(self.min_gap, float((top[:, -2] - top[:, -1]).min()))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float], float]:
    """NEW_TOKENS greedy tokens by full forwards; their log-probabilities; the smallest top-2 logit gap."""
    ids, logprobs, min_gap = list(prompt), [], float("inf")
    for _ in range(NEW_TOKENS):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].double()  # [V]
        top2 = torch.topk(logits, 2).values
        min_gap = min(min_gap, float(top2[0] - top2[1]))
        token = int(torch.argmax(logits))
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return ids[len(prompt):], logprobs, min_gap


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1234)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in PROMPT_LENGTHS]


def load(directory: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager")
    return model.eval()


def run_cases(model: torch.nn.Module) -> tuple[list[dict], dict]:
    gaps = RouterGaps(model)
    cases, token_gap = [], float("inf")
    for prompt in prompts(model.config.vocab_size):
        out, logprobs, gap = greedy(model, prompt)
        token_gap = min(token_gap, gap)
        cases.append({"prompt_ids": prompt, "output_ids": out, "logprobs": logprobs, "max_new_tokens": NEW_TOKENS})
    gaps.close()
    return cases, {"min_top2_logit_gap": token_gap, "min_router_logit_gap": gaps.min_gap}


def margins_ok(margins: dict, moe: bool) -> bool:
    router_ok = not moe or margins["min_router_logit_gap"] >= MIN_ROUTER_GAP
    return router_ok and margins["min_top2_logit_gap"] >= MIN_TOKEN_GAP


def save(model: torch.nn.Module, directory: Path, original_format: bool) -> None:
    if directory.exists():
        shutil.rmtree(directory)
    model.to(torch.bfloat16).save_pretrained(directory, save_original_format=original_format)
    model.to(torch.float32)


def build(name: str, data_dir: Path, golden_dir: Path, command: str) -> None:
    config_cls, model_cls, kwargs = MODELS[name]
    moe = model_cls is not Qwen3ForCausalLM
    published, fused = data_dir / name, data_dir / f"{name}-fused"
    for seed in range(MAX_SEEDS):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**kwargs))
        init_weights(model, seed)
        save(model, published, original_format=True)
        model = load(published)  # the golden comes from the checkpoint exactly as saved
        cases, margins = run_cases(model)
        print(f"[{name}] seed {seed}: {margins}", flush=True)
        if margins_ok(margins, moe):
            break
    else:
        raise SystemExit(f"[{name}] no seed below {MAX_SEEDS} clears the margins")
    if moe:
        save(model, fused, original_format=False)
        check_same_logits(published, fused, cases[-1]["prompt_ids"])
    golden = {
        "model": name, "hf_class": model_cls.__name__, "seed": seed, "command": command,
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "weights_dtype": "bfloat16", "compute_dtype": "float32",
        "checkpoints": {"published": os.path.relpath(published, REPO_ROOT)}
        | ({"fused": os.path.relpath(fused, REPO_ROOT)} if moe else {}),
        "config": json.loads((published / "config.json").read_text()),
        "margins": margins, "greedy": cases,
    }
    target = golden_dir / f"{name}.json"
    target.write_text(json.dumps(golden, sort_keys=True, indent=1) + "\n")
    sizes = {p.name: sum(f.stat().st_size for f in p.iterdir()) for p in (published, fused) if p.exists()}
    print(f"[{name}] wrote {target} and {sizes}", flush=True)


@torch.no_grad()
def check_same_logits(a: Path, b: Path, prompt: list[int]) -> None:
    """Both layouts must hold the same model: HF loads each and gets bit-identical logits."""
    la = load(a)(torch.tensor([prompt]), use_cache=False).logits
    lb = load(b)(torch.tensor([prompt]), use_cache=False).logits
    if not torch.equal(la, lb):
        raise SystemExit(f"{a} and {b} give different logits (max diff {float((la - lb).abs().max())})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--data", type=Path, default=REPO_ROOT / "tests" / "data")
    parser.add_argument("--golden", type=Path, default=REPO_ROOT / "tests" / "golden")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    args.data.mkdir(parents=True, exist_ok=True)
    args.golden.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        build(name, args.data.resolve(), args.golden.resolve(), command)


if __name__ == "__main__":
    main()
