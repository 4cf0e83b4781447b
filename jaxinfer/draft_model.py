"""The draft model of speculative decoding (`speculative={"method": "draft", "model": ...}`): found, checked
against the target, loaded once per replica, and given a runner whose cache mirrors the target's pages.

Checked before anything is loaded: the draft's vocabulary must be the target's (a proposal is a token id of
the target), its tensor-parallel degree 1 or the target's, and its quantization (`speculative.quantization`,
spelled and defaulted as the target's `quantization`: a GGUF draft stays quantized under "auto", "int4" makes
a float draft 4-bit) one its weights and mesh can take. Checked once both tokenizers exist: they
encode the same probe text to the same ids and share the EOS ids. On a replica of several devices a degree-1
draft lives on the replica's first device; its proposals move to the target's devices before verification.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxinfer.config import ConfigError, MeshConfig, ModelConfig
from jaxinfer.errors import InvalidInput, Notice
from jaxinfer.kv_cache import allocate_kv_cache, bytes_per_page
from jaxinfer.models import family_for_config
from jaxinfer.params import init_params
from jaxinfer.sharding import mesh_rules
from jaxinfer.spec_config import SpeculativeConfig

PROBE_TEXT = "Speculative drafts must tokenize like the target: 12 apples, naïve café, <tag>!\n"


class DraftModel:
    def __init__(self, spec: SpeculativeConfig, target: ModelConfig, target_mesh_cfg: MeshConfig, *,
                 random_weights: bool) -> None:
        from jaxinfer.llm import resolve_source  # the target's own lookup: paths, bundled aliases, presets
        from jaxinfer.llm_args import resolve_model_name

        self.name = spec.model
        self.checkpoint, preset = resolve_source(resolve_model_name(spec.model))
        if self.checkpoint is None and not random_weights:
            raise InvalidInput(f"speculative.model={spec.model!r} is a shape-only preset; give a checkpoint, or pass "
                               "random_weights=True for random weights of both models.", field="speculative.model",
                               value=spec.model, accepted="a checkpoint path or bundled alias")
        self.config: ModelConfig = preset if self.checkpoint is None else self.checkpoint.config
        if self.config.vocab_size != target.vocab_size:
            raise InvalidInput(
                f"speculative.model={spec.model!r} has a vocabulary of {self.config.vocab_size} tokens and the "
                f"target {target.vocab_size}; a draft model must share the target's vocabulary and tokenizer.",
                field="speculative.model", value=spec.model, accepted=f"a model with {target.vocab_size} tokens")
        self.tp = spec.draft_tensor_parallel_size or target_mesh_cfg.tensor
        tp_only = target_mesh_cfg.expert == target_mesh_cfg.seq == 1  # a replica's devices are its tensor axis
        if self.tp not in (1, target_mesh_cfg.tensor) or (self.tp > 1 and not tp_only):
            raise InvalidInput.of("LLM argument ", "speculative.draft_tensor_parallel_size", self.tp,
                                  f"1 or the target's tensor_parallel_size ({target_mesh_cfg.tensor}, when the target "
                                  "uses no expert or sequence parallelism)")
        try:
            self.rules = mesh_rules(self.config, MeshConfig(tensor=self.tp))
        except ConfigError as e:  # its heads do not split over the target's degree
            raise InvalidInput(f"speculative.model={spec.model!r}: {e} Set speculative.draft_tensor_parallel_size=1.",
                               field="speculative.draft_tensor_parallel_size", value=self.tp,
                               accepted="1, or a degree the draft's heads split over") from None
        self.family = family_for_config(self.config)
        self.quantization = spec.quantization
        self.plan: Any = None  # set by prepare(), which LLM calls before load()

    def prepare(self, replica: Mesh, dtype: Any) -> None:
        """Resolve and check the draft's quantization plan on a replica's mesh (before any weight is loaded)."""
        from jaxinfer.quantization import QuantizationError, build_plan

        specs = self.family.param_specs(self.config, dtype)
        try:
            self.plan, notes = build_plan(self.quantization, self.checkpoint, specs, self.rules, self.mesh(replica))
        except QuantizationError as e:
            raise InvalidInput(f"speculative.quantization={self.quantization!r} for the draft {self.name!r}: {e}",
                               field="speculative.quantization", value=self.quantization) from None
        for note in notes:
            warnings.warn(f"draft model: {note}", Notice, stacklevel=4)

    def mesh(self, replica: Mesh) -> Mesh:
        """The draft's mesh inside one target replica's: the same devices, or the first one."""
        if self.tp > 1:
            return replica
        return Mesh(np.asarray(replica.devices.flat[:1]).reshape((1,) * replica.devices.ndim), replica.axis_names)

    def load(self, replica: Mesh, dtype: Any, seed: int) -> Any:
        from jaxinfer.quantization import quantized_specs

        specs = self.family.param_specs(self.config, dtype)
        mesh = self.mesh(replica)
        if self.checkpoint is None:
            return init_params(quantized_specs(specs, self.plan), jax.random.key(seed + 1), mesh, self.rules)
        return self.checkpoint.load_weights(specs, mesh, self.rules, plan=self.plan)

    def bytes_per_page(self, page_size: int, dtype: Any, replica: Mesh) -> int:
        return bytes_per_page(self.config, page_size, dtype, self.mesh(replica))

    def runner(self, replica: Mesh, weights: Any, num_pages: int, page_size: int, dtype: Any,
               attention_impl: str, interpret: bool) -> Any:
        """A ModelRunner over the draft's weights with a cache of `num_pages` pages (the target's count)."""
        from jaxinfer.engine.runner import ModelRunner

        mesh = self.mesh(replica)
        cache = allocate_kv_cache(self.config, num_pages, page_size, dtype, mesh, self.rules)
        family = self.family
        if self.plan:  # quantized weights run through the Pallas matmul (in shard_map on this mesh)
            from jaxinfer.linear import Linear
            from jaxinfer.models import with_linear

            family = with_linear(family, Linear.for_engine(mesh, self.rules, attention_impl, interpret))
        return ModelRunner(family, self.config, weights, cache, mesh, self.rules, attention_impl=attention_impl,
                           interpret=interpret)

    def check_tokenizer(self, target_tokenizer: Any) -> None:
        """Same ids for a probe text and the same EOS ids, when both models have a tokenizer."""
        if self.checkpoint is None or target_tokenizer is None:
            return
        from jaxinfer.llm import load_model_tokenizer

        mine = load_model_tokenizer(self.checkpoint, None)
        if mine is None:
            return
        same = (list(mine.encode(PROBE_TEXT)) == list(target_tokenizer.encode(PROBE_TEXT))
                and set(mine.eos_token_ids) == set(target_tokenizer.eos_token_ids))
        if not same:
            raise InvalidInput(f"speculative.model={self.name!r} tokenizes text differently from the target; a draft "
                               "model must share the target's tokenizer.", field="speculative.model",
                               value=self.name, accepted="a model with the target's tokenizer")
