"""Typed model configuration for the decoder family (Llama 2/3, Qwen2/2.5, Qwen3, Mistral; Qwen3-MoE, Mixtral).

`ModelConfig.from_hf(config_json)` reads a Hugging Face `config.json` (a dict or a path to the file or
its folder) and `to_hf()` writes one back, so a checkpoint can travel HF -> megalign -> HF.

Design choices:
- One dataclass for the four families: they differ only in attention biases (Qwen2 has q/k/v bias,
  no o bias; Llama's and Qwen3's `attention_bias` put a bias on all four), Qwen3's per-head RMSNorm
  on q and k (`qk_norm`, implied by the family), RoPE scaling (Llama 3) and Mistral's sliding window.
  The family is kept in `model_type` so `to_hf()` writes the right architecture (`hf_architecture`).
- RoPE parameters are read from `rope_parameters` (transformers >= 5) or from the older top-level
  `rope_theta` + `rope_scaling` keys; both spellings give the same config.
- Sliding window (Mistral): supported exactly as transformers does it, as a mask on the index
  distance between query and key, `q_idx - kv_idx < sliding_window` (padding included, as in HF).
  Qwen2's and Qwen3's per-layer windows (`use_sliding_window: true` with `max_window_layers`) are rejected.
- Mixture of experts (Qwen3-MoE, Mixtral; `megalign.models.moe`): `num_experts > 0` replaces the SwiGLU
  of the layers `is_moe_layer` names by `num_experts` SwiGLU experts of width `moe_intermediate_size`,
  `num_experts_per_tok` of them per token. Qwen3-MoE is Qwen3's attention (q/k norms) with HF's
  `num_experts` (transformers 5 also writes `num_local_experts`), `moe_intermediate_size`,
  `norm_topk_prob`, `decoder_sparse_step` and `mlp_only_layers` (dense layers of width
  `intermediate_size`); Mixtral is Mistral's attention with `num_local_experts` experts of width
  `intermediate_size` and always-renormalised top-k weights. Mixtral's `router_jitter_noise` (a random
  training-time input scaling) is rejected when non-zero. Qwen2-MoE is Qwen2's attention (`qkv_bias`, default
  on) with Qwen3-MoE's keys plus a shared expert (a SwiGLU of width `shared_expert_intermediate_size` every
  token goes through, scaled by a sigmoid gate).
- Vocab padding: `vocab_pad_multiple` rounds the embedding / LM-head rows up (Megatron-style, so a
  vocab splits evenly over tensor-parallel ranks). `vocab_size` stays the real vocabulary; the padded
  rows never receive probability (see `heads.LMHead`) and are dropped when saving.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")

_HF_CLASS_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
                    "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}
# families that share another's attention: Qwen3-MoE is Qwen3's, Mixtral is Mistral's
_ATTENTION_FAMILY = {"qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "mixtral": "mistral"}


def hf_architecture(model_type: str, task: str = "CausalLM") -> str:
    """The `transformers` class of family `model_type` for `task` ('CausalLM', 'SequenceClassification',
    'TokenClassification'), e.g. ('qwen3', 'SequenceClassification') -> 'Qwen3ForSequenceClassification'."""
    return f"{_HF_CLASS_PREFIX[model_type]}For{task}"


class HFConfigError(ValueError):
    """An HF config.json that megalign cannot use, its message naming the file and key: the launcher prints it as
    one line (`megalign.trainers.cli`), as a config error."""


@dataclass
class RopeScaling:
    """Llama 3 RoPE frequency scaling (`rope_type: llama3`), as in `transformers`' `_compute_llama3_parameters`.

    Wavelengths `lambda_i = 2*pi / inv_freq_i` longer than `original_max_position_embeddings / low_freq_factor`
    are divided by `factor`; shorter than `original_max_position_embeddings / high_freq_factor` are kept; the
    band between is interpolated with `s = (L_orig / lambda - low) / (high - low)`:
    `inv_freq = (1 - s) * inv_freq / factor + s * inv_freq`.
    """

    factor: float
    """Context extension factor (8 for Llama 3.1)."""
    low_freq_factor: float
    """Divides the original context to give the wavelength above which frequencies are fully scaled."""
    high_freq_factor: float
    """Divides the original context to give the wavelength below which frequencies are untouched."""
    original_max_position_embeddings: int
    """Context length the model was pretrained with before the extension (8192 for Llama 3)."""

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"rope_scaling.original_max_position_embeddings must be > 0, got {self.original_max_position_embeddings}"
            )


@dataclass
class ModelConfig:
    """Shape and numerics of one decoder-only transformer; validated on construction."""

    model_type: str
    """HF family: one of SUPPORTED_MODEL_TYPES (chooses the architecture written by `to_hf`)."""
    vocab_size: int
    """Real vocabulary size V (rows of the HF embedding)."""
    hidden_size: int
    """Model width H."""
    intermediate_size: int
    """SwiGLU inner width F."""
    num_hidden_layers: int
    """Number of decoder layers L."""
    num_attention_heads: int
    """Query heads (whole model, all tensor-parallel ranks together)."""
    num_key_value_heads: int
    """Key/value heads (GQA: each serves num_attention_heads / num_key_value_heads query heads)."""
    head_dim: int
    """Width of one head; HF's default is hidden_size // num_attention_heads but it may differ."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside RMSNorm's rsqrt(mean(x^2) + eps)."""
    rope_theta: float = 10000.0
    """RoPE base: inv_freq_i = theta^(-2i / head_dim)."""
    rope_scaling: Optional[RopeScaling] = None
    """Llama 3 frequency scaling, or None for plain RoPE."""
    qkv_bias: bool = False
    """Bias on the q, k, v projections (Qwen2: True; Llama, Qwen3: `attention_bias`)."""
    o_bias: bool = False
    """Bias on the output projection (Llama, Qwen3: `attention_bias`; never in Qwen2)."""
    mlp_bias: bool = False
    """Bias on gate/up/down projections (Llama `mlp_bias`)."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix (small Qwen2 models)."""
    sliding_window: Optional[int] = None
    """Mistral: a query attends only to keys with index distance < sliding_window; None for full attention."""
    max_position_embeddings: int = 4096
    """Longest context: the RoPE cos/sin tables are precomputed for positions below it (a larger position is an error)."""
    vocab_pad_multiple: int = 1
    """Embedding / LM-head rows are rounded up to a multiple of this (e.g. 128 * tp); 1 = no padding."""
    pad_token_id: Optional[int] = None
    """Padding token (read by reward models' HF config; megalign itself pools with the attention mask)."""
    num_experts: int = 0
    """MoE: experts per MoE layer E (0 = a dense model)."""
    num_experts_per_tok: int = 0
    """MoE: experts each token is routed to, k (top-k of the router's softmax)."""
    moe_intermediate_size: int = 0
    """MoE: SwiGLU width of one expert (Mixtral: its `intermediate_size`)."""
    norm_topk_prob: bool = True
    """MoE: renormalise the k chosen probabilities to sum to 1 (Mixtral always; Qwen3-MoE per its config)."""
    decoder_sparse_step: int = 1
    """MoE: layer i is an MoE layer when (i + 1) % decoder_sparse_step == 0 (and not in mlp_only_layers)."""
    mlp_only_layers: tuple = ()
    """MoE: layers that keep a dense SwiGLU of width intermediate_size (Qwen3-MoE)."""
    shared_expert_intermediate_size: int = 0
    """MoE: width of the shared expert every token also goes through (Qwen2-MoE); 0 = none."""
    router_aux_loss_coef: float = 0.001
    """MoE: weight of the load-balancing loss (`moe.load_balancing_loss`) when training uses it."""
    extra_hf: dict = field(default_factory=dict, repr=False)
    """HF keys megalign does not use (bos/eos ids, id2label, ...), written back unchanged by `to_hf`."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                     "vocab_pad_multiple"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0 or None, got {self.sliding_window}")
        self._check_moe()
        if self.model_type in ("llama", "qwen3", "qwen3_moe") and self.qkv_bias != self.o_bias:
            raise ValueError(f"{self.model_type}'s one attention_bias switch biases q, k, v and o together; got "
                             f"qkv_bias={self.qkv_bias}, o_bias={self.o_bias}")

    def _check_moe(self) -> None:
        if (self.num_experts > 0) != (self.model_type in MOE_MODEL_TYPES):
            raise ValueError(f"num_experts must be > 0 exactly for the MoE families {MOE_MODEL_TYPES}; got "
                             f"{self.num_experts} for model_type {self.model_type!r}")
        if self.num_experts == 0:
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
            raise ValueError(f"moe_intermediate_size ({self.moe_intermediate_size}) and decoder_sparse_step "
                             f"({self.decoder_sparse_step}) must be > 0")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are not layers of a {self.num_hidden_layers}-layer model")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` has an MoE MLP (transformers' Qwen3MoeDecoderLayer rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def qk_norm(self) -> bool:
        """Qwen3's per-head RMSNorm on q and k: one `[head_dim]` gain each, applied to every head before RoPE.

        A property of the family (every Qwen3 checkpoint has it, no other family does), so a config
        cannot disagree with the architecture `to_hf` names."""
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding / LM head: vocab_size rounded up to vocab_pad_multiple."""
        m = self.vocab_pad_multiple
        return -(-self.vocab_size // m) * m

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ValueError naming every size a `tp`-way split cannot divide, at start-up, before any weight exists.

        Tensor parallelism gives each rank whole heads (num_attention_heads / tp query heads and
        num_key_value_heads / tp kv heads, so a query head stays on the rank of its kv head), a slice
        of the SwiGLU width (every expert's too) and of the padded vocabulary; all must divide evenly.
        """
        sizes = (("num_attention_heads", self.num_attention_heads), ("num_key_value_heads", self.num_key_value_heads),
                 ("intermediate_size", self.intermediate_size), ("moe_intermediate_size", self.moe_intermediate_size),
                 ("shared_expert_intermediate_size", self.shared_expert_intermediate_size),
                 ("padded_vocab_size", self.padded_vocab_size))
        bad = [f"{name} ({value})" for name, value in sizes if value % tp]
        if bad:
            hint = (f"; pad the vocabulary with vocab_pad_multiple a multiple of {tp}"
                    if self.padded_vocab_size % tp else "")
            raise ValueError(f"{' and '.join(bad)} must be divisible by the tensor-parallel size {tp}{hint}")

    @classmethod
    def from_hf(cls, hf: Union[dict, str, os.PathLike], vocab_pad_multiple: int = 1) -> "ModelConfig":
        """Build from an HF config dict, a config.json path, or a checkpoint folder holding config.json.

        A file that cannot be read or parsed, a required key missing, an unsupported family or a bad value is an
        `HFConfigError` naming the key, and the file when read from one."""
        where = ""
        if not isinstance(hf, dict):
            path = os.fspath(hf)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            where = f"{path}: "
            try:
                with open(path) as f:
                    hf = json.load(f)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise HFConfigError(f"{where}cannot be read as an HF config.json: {exc}") from exc
            if not isinstance(hf, dict):
                raise HFConfigError(f"{where}an HF config.json holds a JSON object, got {type(hf).__name__}")
        try:
            return cls._from_hf_dict(dict(hf), vocab_pad_multiple)
        except KeyError as exc:
            raise HFConfigError(f"{where}required key {exc.args[0]!r} is missing") from None
        except (TypeError, ValueError) as exc:
            raise HFConfigError(f"{where}{exc}") from exc

    @classmethod
    def _from_hf_dict(cls, hf: dict, vocab_pad_multiple: int) -> "ModelConfig":
        """`from_hf` of a parsed config.json; KeyError for a missing key, ValueError / TypeError for a bad value."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; the SwiGLU MLP needs 'silu'")
        if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and hf.get("use_sliding_window"):
            raise ValueError(f"{model_type} with use_sliding_window=true (per-layer windows) is not supported")

        rope_theta, rope_scaling = _read_rope(hf)
        heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        # Qwen2 hard-codes q/k/v bias and no o bias; Mistral hard-codes none; Llama and Qwen3 follow attention_bias.
        attention_bias = model_type in ("llama", "qwen3", "qwen3_moe") and bool(hf.get("attention_bias", False))
        qkv_bias = (model_type == "qwen2" or attention_bias
                    or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True))))
        o_bias = attention_bias
        used = {
            "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
            "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings",
            "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
            "max_position_embeddings", "hidden_act", "architectures", "pad_token_id", "transformers_version",
        } | set(_MOE_KEYS)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=model_type == "llama" and bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=hf.get("sliding_window") if model_type in ("mistral", "mixtral") else None,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            vocab_pad_multiple=vocab_pad_multiple,
            pad_token_id=hf.get("pad_token_id"),
            extra_hf={k: v for k, v in hf.items() if k not in used},
            **_read_moe(hf, model_type),
        )

    def to_hf(self, architecture: Optional[str] = None) -> dict:
        """HF config.json content; `architecture` overrides the default `...ForCausalLM` (e.g. for reward models)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope.update(rope_type="llama3", factor=self.rope_scaling.factor,
                        low_freq_factor=self.rope_scaling.low_freq_factor,
                        high_freq_factor=self.rope_scaling.high_freq_factor,
                        original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings)
        out = dict(self.extra_hf)
        out.update(
            architectures=[architecture or hf_architecture(self.model_type)],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            pad_token_id=self.pad_token_id,
        )
        family = _ATTENTION_FAMILY.get(self.model_type, self.model_type)
        if family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
        if family != "qwen2":
            out["attention_bias"] = self.qkv_bias
        if self.model_type in ("llama", "mistral"):
            out["mlp_bias"] = self.mlp_bias
        if family == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.model_type == "qwen2_moe":
            out.update(qkv_bias=self.qkv_bias, shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        if self.model_type in ("qwen2_moe", "qwen3_moe"):
            out.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                       norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                       mlp_only_layers=list(self.mlp_only_layers))
        if self.model_type == "mixtral":
            out.update(num_local_experts=self.num_experts, router_jitter_noise=0.0)
        if self.num_experts:
            out.update(num_experts_per_tok=self.num_experts_per_tok, router_aux_loss_coef=self.router_aux_loss_coef)
        return out


_MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
             "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "router_jitter_noise",
             "output_router_logits", "shared_expert_intermediate_size", "qkv_bias")


def _read_moe(hf: dict, model_type: str) -> dict:
    """The MoE fields of `ModelConfig` from an HF Qwen2-MoE / Qwen3-MoE / Mixtral config (none for a dense family)."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    if hf.get("router_jitter_noise", 0.0):
        raise ValueError(f"router_jitter_noise={hf['router_jitter_noise']} is not supported (only 0)")
    # Qwen3-MoE's hub configs say num_experts; transformers 5 writes it as num_local_experts (Mixtral's key)
    qwen = model_type != "mixtral"
    experts = hf.get("num_experts", hf.get("num_local_experts")) if qwen else hf["num_local_experts"]
    if experts is None:
        raise KeyError("num_experts")
    return dict(
        num_experts=experts,
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"] if qwen else hf["intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)) if qwen else True,
        decoder_sparse_step=hf.get("decoder_sparse_step", 1) if qwen else 1,
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()) if qwen else (),
        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
        shared_expert_intermediate_size=hf["shared_expert_intermediate_size"] if model_type == "qwen2_moe" else 0,
    )


def _read_rope(hf: dict) -> tuple[float, Optional[RopeScaling]]:
    """(rope_theta, llama3 scaling or None) from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported; expected 'default' or 'llama3'")
    return theta, RopeScaling(
        factor=params["factor"],
        low_freq_factor=params["low_freq_factor"],
        high_freq_factor=params["high_freq_factor"],
        original_max_position_embeddings=params["original_max_position_embeddings"],
    )
