"""Config dataclasses and strict YAML loading."""

from __future__ import annotations

import pytest

from jaxinfer.config import ConfigError, EngineConfig, ModelConfig, RopeScaling, SamplingParams, load_yaml
from jaxinfer.presets import load_preset, preset_names

REQUIRED_PRESETS = ["llama-3-8b", "llama-3-70b", "llama-3.1-8b", "smollm2-135m", "smollm2-360m", "smollm2-1.7b", "mistral-7b"]


@pytest.mark.parametrize("name", REQUIRED_PRESETS)
def test_required_presets_load(name: str) -> None:
    cfg = load_preset(name)
    assert cfg.num_heads % cfg.num_kv_heads == 0
    assert name in preset_names()


def test_llama31_preset_has_rope_scaling() -> None:
    cfg = load_preset("llama-3.1-8b")
    assert cfg.rope_scaling is RopeScaling.LLAMA3 and cfg.rope_scaling_factor == 8.0


def test_unknown_yaml_key_is_named(tmp_path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("vocab_size: 10\nhidden_size: 8\nintermediate_size: 16\nnum_layers: 1\nnum_heads: 2\n"
                    "num_kv_heads: 1\nhiden_size: 3\n")
    with pytest.raises(ConfigError, match="'hiden_size'"):
        ModelConfig.from_dict(load_yaml(path))


def test_bad_enum_value_lists_allowed() -> None:
    with pytest.raises(ConfigError, match="rope_scaling.*'llama3'"):
        ModelConfig.from_dict(dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1,
                                   num_heads=2, num_kv_heads=1, rope_scaling="yarnish"))


def test_heads_must_group() -> None:
    with pytest.raises(ConfigError, match="num_heads \\(6\\) must be a multiple of num_kv_heads \\(4\\)"):
        ModelConfig(vocab_size=10, hidden_size=12, intermediate_size=16, num_layers=1, num_heads=6, num_kv_heads=4)


def test_configs_are_frozen() -> None:
    cfg = EngineConfig()
    with pytest.raises(Exception):
        cfg.max_num_seqs = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_sampling_params_validation_names_field(kwargs, field) -> None:
    with pytest.raises(ConfigError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_sampling_params_from_yaml_mapping() -> None:
    p = SamplingParams.from_dict({"max_tokens": 8, "temperature": 0, "stop": ["\n"]})
    assert p.greedy and p.stop == ("\n",) and isinstance(p.temperature, float)


def test_engine_attention_impl_validated() -> None:
    with pytest.raises(ConfigError, match="attention_impl"):
        EngineConfig(attention_impl="flash")


def test_moe_models_keep_multi_step_decode_on_accelerators() -> None:
    """A mixture-of-experts model decodes in multi-step calls at every batch size on a GPU/TPU (its single steps
    are launch-bound); a dense model keeps the platform's single steps, and a value the user passed stays."""
    from jaxinfer.platform import ACCELERATOR, MOE_SINGLE_STEP_MAX_ROWS, fill_defaults, fit_to_model

    chosen = fill_defaults({"single_step_max_rows": None}, backend="gpu")
    assert chosen["single_step_max_rows"] == ACCELERATOR.single_step_max_rows > 0
    assert fit_to_model(chosen, moe=False) == chosen
    assert fit_to_model(chosen, moe=True)["single_step_max_rows"] == MOE_SINGLE_STEP_MAX_ROWS == 0
    given = fill_defaults({"single_step_max_rows": 8}, backend="gpu")  # passed explicitly: not among the chosen
    assert "single_step_max_rows" not in fit_to_model(given, moe=True)


def test_quantized_weights_keep_multi_step_decode_on_a_gpu_only() -> None:
    """Quantized weights on a GPU decode in multi-step calls at every batch size (a single step launches each
    quantized product's kernels one by one); a TPU keeps its single steps, and a value the user passed stays."""
    from jaxinfer.platform import QUANTIZED_GPU_SINGLE_STEP_MAX_ROWS, fill_defaults, fit_to_model

    chosen = fill_defaults({"single_step_max_rows": None}, backend="gpu")
    assert fit_to_model(chosen, moe=False, quantized=True, backend="gpu")["single_step_max_rows"] == \
        QUANTIZED_GPU_SINGLE_STEP_MAX_ROWS == 0
    assert fit_to_model(chosen, moe=False, quantized=True, backend="tpu") == chosen
    assert fit_to_model(chosen, moe=False, quantized=False, backend="gpu") == chosen
    given = fill_defaults({"single_step_max_rows": 8}, backend="gpu")
    assert "single_step_max_rows" not in fit_to_model(given, moe=False, quantized=True, backend="gpu")


def test_a_quantized_kv_cache_on_a_gpu_defaults_to_32_token_pages() -> None:
    """The GPU attention kernel copies each page's scale row by TMA (a multiple of 128 bytes: 32 fp32)."""
    from jaxinfer.platform import default_page_size

    assert default_page_size(True, "gpu") == 32
    assert default_page_size(False, "gpu") == default_page_size(True, "cpu") == default_page_size(True, "tpu") == 16
