# SPDX-License-Identifier: Apache-2.0
"""Tiny, deterministic Hugging Face checkpoints for tests, benchmarks and demos.

Everything here is written locally from a seed: no hub access, no downloads.
A checkpoint directory holds ``config.json``, ``model.safetensors``,
``generation_config.json`` (targets) and a working fast tokenizer
(``tokenizer.json``, ``tokenizer_config.json`` with a chat template,
``special_tokens_map.json``).

Tokenizer
    Byte-level BPE without merges: ids ``0..255`` are the 256 bytes, then
    ``<|endoftext|>`` (:data:`EOS_TOKEN_ID`, the eos), ``<|MASK|>``
    (:data:`MASK_TOKEN_ID`, the DFlash mask token) and ``<|reserved_i|>``
    special tokens that pad the vocabulary to ``vocab_size`` (default 320), so
    every id a model can emit decodes. Any text round-trips.

Targets (:func:`make_target`)
    ``Qwen3ForCausalLM`` or ``LlamaForCausalLM``, untied ``lm_head``.

    - ``kind="random"``: variance-preserving random init, logits with a spread
      of a few units, so greedy output is varied and context dependent. The
      ``lm_head`` rows of the special/reserved ids are zero: greedy decoding
      practically never emits them (eos included), so generation runs to
      ``max_tokens``.
    - ``kind="oracle"``: greedy output repeats the last input token forever.
      ``o_proj`` and ``down_proj`` are zero, so the final hidden state is the
      (normalised) input embedding; ``lm_head`` equals the embedding table and
      the rows have equal norm, so the argmax is the input token. The mask
      token's embedding is zero. The embeddings live in the first
      ``min(hidden_size, num_kv_heads * head_dim)`` coordinates, so an oracle
      drafter with the same head layout can copy them through its value path.
      ``oracle_noise > 0`` gives a target that only mostly repeats (partial
      acceptance).
    - :func:`make_two_way_target`: an oracle target whose ``lm_head`` is
      ``a E + b E[perm]``: after token ``x`` most of the mass is on ``x`` and
      ``perm^-1(x)``, a spread law for sampling tests; with ``oracle_noise`` it
      depends on the whole context through attention.

Drafters (:func:`make_dflash_drafter`)
    The DFlash draft checkpoint vLLM 0.32 loads with
    ``speculative_config={"method": "dflash", "model": DIR,
    "num_speculative_tokens": K}``: ``"architectures": ["DFlashDraftModel"]``,
    ``model_type`` qwen3, ``hidden_size`` equal to the target's,
    ``dflash_config = {"mask_token_id", "target_layer_ids"}``, top-level
    ``block_size``, weight names without a ``model.`` prefix and no
    ``embed_tokens`` / ``lm_head`` (shared with the target).

    - ``kind="random"``: random weights; acceptance is low, output must still
      equal plain greedy decoding.
    - ``kind="oracle"``: every mask query predicts the bonus token (``q = k = 0``
      so attention is uniform, ``fc = 0`` so context values are zero,
      ``v``/``o`` pass the bonus embedding through, MLP zero). With the oracle
      target every draft token is accepted.

vLLM 0.32 facts these builders respect (checked against the installed
sources): ``head_dim`` must be one of :data:`CPU_ATTENTION_HEAD_SIZES`, the
sizes the CPU attention backend declares (a 48 was seen to run too, but is
refused here); ``target_layer_ids`` are 0-based, vLLM
captures the output of layer ``id`` (aux layer ``id + 1``) and collects them in
layer order once each, so ids must be distinct, ascending and below the
target's layer count; vLLM does not read ``block_size`` (give
``num_speculative_tokens``), the DDTree adapter does.

Recommended in-process vLLM settings for these models:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_CPU_KVCACHE_SPACE=1``,
``LLM(..., dtype="float32", enforce_eager=True)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Literal, Sequence

import torch

__all__ = [
    "CPU_ATTENTION_HEAD_SIZES",
    "DEFAULT_VOCAB_SIZE",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "MASK_TOKEN",
    "MASK_TOKEN_ID",
    "NUM_BYTE_TOKENS",
    "build_target_layer_ids",
    "make_arch_target",
    "make_dflash_drafter",
    "make_pair",
    "make_target",
    "make_two_way_arch_target",
    "make_tokenizer",
    "write_tokenizer",
]

#: Head sizes the vLLM CPU attention backend accepts.
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

NUM_BYTE_TOKENS = 256
EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = 256
MASK_TOKEN = "<|MASK|>"
MASK_TOKEN_ID = 257
#: Ids below this are bytes, eos and mask; the rest are reserved specials.
_NUM_NAMED_TOKENS = 258
DEFAULT_VOCAB_SIZE = 320

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Standard deviation of a random target's logits for a unit-RMS hidden state.
_RANDOM_LOGIT_STD = 4.0


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #


def _byte_symbols() -> list[str]:
    """The printable character standing for each byte value (byte-level BPE).

    Printable Latin-1 bytes stand for themselves; the others (controls, space,
    DEL, NBSP, soft hyphen) take the code points 256, 257, ... in byte order,
    which is the alphabet ``tokenizers``' ``ByteLevel`` pre-tokenizer emits.
    """
    printable = set(range(ord("!"), ord("~") + 1))
    printable |= set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols = []
    extra = 0
    for b in range(NUM_BYTE_TOKENS):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(NUM_BYTE_TOKENS + extra))
            extra += 1
    return symbols


def _special_tokens(vocab_size: int) -> list[str]:
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - _NUM_NAMED_TOKENS)]
    return [EOS_TOKEN, MASK_TOKEN, *reserved]


def make_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):
    """A ``tokenizers.Tokenizer``: 256 byte tokens, eos, mask, reserved padding.

    Token ``i < 256`` is byte ``i``; :data:`EOS_TOKEN_ID` and
    :data:`MASK_TOKEN_ID` follow; ids up to ``vocab_size - 1`` are reserved
    special tokens, so the tokenizer covers the model's whole vocabulary.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    _check_vocab_size(vocab_size)
    vocab = {sym: i for i, sym in enumerate(_byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in _special_tokens(vocab_size)
        ]
    )
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    assert tok.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID
    assert tok.token_to_id(MASK_TOKEN) == MASK_TOKEN_ID
    return tok


def write_tokenizer(
    path: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> str:
    """Write the tiny fast tokenizer (and its chat template) into ``path``.

    Files: ``tokenizer.json``, ``tokenizer_config.json`` (``PreTrainedTokenizerFast``,
    eos/pad ``<|endoftext|>``, mask ``<|MASK|>``, a plain ``role: content``
    chat template), ``special_tokens_map.json``. Returns ``str(path)``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size)
    tok.save(str(path / "tokenizer.json"))
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(_special_tokens(vocab_size), start=EOS_TOKEN_ID)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(path / "tokenizer_config.json", config)
    _write_json(
        path / "special_tokens_map.json",
        {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "mask_token": MASK_TOKEN},
    )
    return str(path)


# --------------------------------------------------------------------------- #
# Targets
# --------------------------------------------------------------------------- #


def make_target(
    path: str | os.PathLike,
    arch: Literal["qwen3", "llama"] = "qwen3",
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    intermediate_size: int = 256,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    kind: Literal["random", "oracle"] = "random",
    dtype: str = "float32",
    max_position_embeddings: int = 4096,
    oracle_noise: float = 0.0,
    sliding_window: int | None = None,
) -> str:
    """Write a tiny ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` checkpoint.

    Args:
        path: output directory (created; existing files are overwritten).
        arch: ``"qwen3"`` (with q/k norms) or ``"llama"``.
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
        intermediate_size: model shape. ``head_dim`` must be one of
            :data:`CPU_ATTENTION_HEAD_SIZES` for vLLM on CPU.
        vocab_size: at least 258 (bytes + eos + mask); default 320.
        seed: all weights are drawn from ``torch.Generator().manual_seed(seed)``.
        kind: ``"random"`` (varied greedy output) or ``"oracle"`` (greedy output
            repeats the last input token; see the module docstring).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (weights and config).
        max_position_embeddings: written to the config (bounds ``max_model_len``).
        oracle_noise: ``kind="oracle"`` only. When > 0, ``o_proj`` and
            ``down_proj`` are random with this scale instead of zero: greedy
            output still mostly repeats the last token but sometimes moves on,
            so the oracle drafter is partially accepted and rejections land at
            varied draft positions (default shape and seed, K = 4: about 89%
            of draft tokens accepted at 8.0, 76% at 12.0).
        sliding_window: ``arch="qwen3"`` only: every layer attends to the last
            ``sliding_window`` positions (``layer_types`` all
            ``sliding_attention``: vLLM applies a model-wide window only then).

    Returns:
        ``str(path)``.
    """
    from transformers import LlamaConfig, Qwen3Config

    if arch not in ("qwen3", "llama"):
        raise ValueError(f"arch must be 'qwen3' or 'llama', got {arch!r}")
    if kind not in ("random", "oracle"):
        raise ValueError(f"target kind must be 'random' or 'oracle', got {kind!r}")
    if oracle_noise and kind != "oracle":
        raise ValueError("oracle_noise applies to kind='oracle' only")
    if oracle_noise < 0:
        raise ValueError("oracle_noise must be >= 0")
    _check_vocab_size(vocab_size)
    _check_heads(num_heads, num_kv_heads, head_dim)
    torch_dtype = _torch_dtype(dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        dtype=dtype,
    )
    if sliding_window is not None:
        if arch != "qwen3":
            raise ValueError("sliding_window applies to arch='qwen3' only")
        common.update(
            use_sliding_window=True,
            sliding_window=int(sliding_window),
            max_window_layers=0,
            layer_types=["sliding_attention"] * num_layers,
        )
    if arch == "qwen3":
        config = Qwen3Config(architectures=["Qwen3ForCausalLM"], **common)
    else:
        config = LlamaConfig(architectures=["LlamaForCausalLM"], **common)
    config.save_pretrained(str(path))
    _write_json(
        path / "generation_config.json",
        {"eos_token_id": EOS_TOKEN_ID, "pad_token_id": EOS_TOKEN_ID},
    )

    g = torch.Generator().manual_seed(seed)
    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
    sd: dict[str, torch.Tensor] = {}

    if kind == "random":
        embed = _randn(g, vocab_size, hidden_size)  # unit RMS hidden states
        lm_head = _randn(
            g, vocab_size, hidden_size, std=_RANDOM_LOGIT_STD / math.sqrt(hidden_size)
        )
        lm_head[_NUM_NAMED_TOKENS - 2 :] = 0.0  # eos, mask, reserved: logit 0
    else:
        embed = _oracle_embeddings(g, vocab_size, hidden_size, min(hidden_size, kv_out))
        lm_head = embed.clone()
    sd["model.embed_tokens.weight"] = embed
    sd["lm_head.weight"] = lm_head
    sd["model.norm.weight"] = torch.ones(hidden_size)

    for i in range(num_layers):
        p = f"model.layers.{i}."
        sd.update(
            _decoder_layer(
                g,
                p,
                hidden_size,
                q_out,
                kv_out,
                head_dim,
                intermediate_size,
                qk_norm=arch == "qwen3",
            )
        )
        if kind == "oracle":
            for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                sd[p + name].mul_(oracle_noise)

    _save_safetensors(path / "model.safetensors", sd, torch_dtype)
    write_tokenizer(path, vocab_size)
    return str(path)


# Tiny configurations of the target families public DFlash drafters serve
# (hidden 128, head_dim 64, vocabulary 320), as transformers configs.
_ARCH_DEFAULTS: dict[str, dict] = {
    # Alternating sliding-window / full layers, attention sinks, MoE (top-2 of 4).
    "gpt_oss": dict(
        config_class="GptOssConfig",
        architectures=["GptOssForCausalLM"],
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    ),
    # MLA (DeepSeek-V3 / Kimi-K2): a 512 + 64 latent cache (vLLM's CPU MLA
    # kernel has no other size), q LoRA, one dense layer then MoE with a shared
    # expert and grouped top-k routing with a score-correction bias (noaux_tc).
    "deepseek_v3": dict(
        config_class="DeepseekV3Config",
        architectures=["DeepseekV3ForCausalLM"],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=64,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        head_dim=64,
        intermediate_size=256,
        moe_intermediate_size=64,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        topk_method="noaux_tc",
        # YaRN, as the real checkpoints (vLLM's DeepseekScalingRotaryEmbedding).
        # With plain RoPE vLLM-cpu 0.32 rotates MLA's [T, N, R] query wrongly
        # (its rotary op reads a 3-d query as one head per token), so the
        # output of a default-RoPE MLA target depends on its batch neighbours.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    # Gemma-4 text: sliding (head 64) and global (head 128, partial RoPE)
    # layers, per-layer input embeddings.
    "gemma4": dict(
        config_class="Gemma4TextConfig",
        architectures=["Gemma4ForCausalLM"],
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        global_head_dim=128,
        intermediate_size=256,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=DEFAULT_VOCAB_SIZE,
    ),
    # Hybrid (Qwen3-Next): Gated DeltaNet layers (conv kernel 4, head size 128,
    # the CPU GDN kernels' size; bf16 only on the CPU) between full-attention
    # layers (gated, partial RoPE), MoE with a shared expert.
    "qwen3_next": dict(
        config_class="Qwen3NextConfig",
        architectures=["Qwen3NextForCausalLM"],
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"] * 2,
    ),
    # Full attention, MoE (top-2 of 4), q/k norms.
    "qwen3_moe": dict(
        config_class="Qwen3MoeConfig",
        architectures=["Qwen3MoeForCausalLM"],
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
}


def make_arch_target(
    path: str | os.PathLike,
    arch: str,
    *,
    seed: int = 0,
    dtype: str = "float32",
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    hidden_size: int = 128,
    max_position_embeddings: int = 4096,
    logit_std: float = _RANDOM_LOGIT_STD,
    **config_overrides,
) -> str:
    """Write a tiny random target of a transformers architecture (see
    ``_ARCH_DEFAULTS``: ``"gpt_oss"``, ``"qwen3_moe"``).

    The weights are transformers' own initialisation of the model class, drawn
    from ``torch.manual_seed(seed)``, with a variance-preserving
    ``initializer_range`` (``hidden_size ** -0.5``) so that every layer, and
    attention in particular, moves the output; then, as for
    :func:`make_target`'s random targets, unit-RMS embeddings and an
    ``lm_head`` whose logits spread by ``logit_std`` with the special and
    reserved rows zero (greedy output varies with the context and runs to
    ``max_tokens``).

    Args:
        path: output directory.
        arch: a key of ``_ARCH_DEFAULTS``.
        config_overrides: more config fields (e.g. ``sliding_window``).

    Returns:
        ``str(path)``.
    """
    import transformers

    if arch not in _ARCH_DEFAULTS:
        raise ValueError(f"arch must be one of {sorted(_ARCH_DEFAULTS)}, got {arch!r}")
    _check_vocab_size(vocab_size)
    fields = dict(_ARCH_DEFAULTS[arch])
    config_class = getattr(transformers, fields.pop("config_class"))
    fields.update(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=hidden_size**-0.5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        dtype=dtype,
    )
    fields.update(config_overrides)
    config = config_class(**fields)
    torch_dtype = _torch_dtype(dtype)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(_randn(g, vocab_size, hidden_size))
        head = _randn(
            g, vocab_size, hidden_size, std=logit_std / math.sqrt(hidden_size)
        )
        head[_NUM_NAMED_TOKENS - 2 :] = 0.0  # eos, mask, reserved: logit 0
        model.get_output_embeddings().weight.copy_(head)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch_dtype).save_pretrained(str(path))
    if arch == "deepseek_v3":
        _add_score_correction_bias(path, config, g, torch_dtype)
    _write_json(
        path / "generation_config.json",
        {"eos_token_id": EOS_TOKEN_ID, "pad_token_id": EOS_TOKEN_ID},
    )
    write_tokenizer(path, vocab_size)
    return str(path)


# --------------------------------------------------------------------------- #
# DFlash drafters
# --------------------------------------------------------------------------- #


def make_two_way_target(
    path: str | os.PathLike,
    *,
    a: float = 0.05,
    b: float = 0.045,
    partner: tuple[int, int] | None = None,
    seed: int = 1,
    **target_kw,
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """An oracle target (:func:`make_target`, ``kind="oracle"``) whose
    ``lm_head`` is ``a E + b E[perm]`` (the mask row zero), ``perm`` a random
    permutation: after token ``x`` the target puts most of its mass on ``x``
    and on ``perm^-1(x)``, and an oracle drafter sharing the head drafts that
    same law. With ``oracle_noise`` = 0 (``o_proj = down_proj = 0``) the law
    depends on the last token only, ``softmax(head @ E[x])``; with
    ``oracle_noise`` > 0 it depends on the whole context through attention.

    Args:
        path: output directory.
        a, b: the two terms' scales (logit spread about ``a`` and ``b`` times
            the hidden size).
        partner: ``(x, y)``: make ``perm[x] = y`` (e.g. ``(EOS, y)``: after
            ``y`` the target emits EOS with some probability).
        seed: weights and ``perm``.
        target_kw: more :func:`make_target` arguments (shape, oracle_noise).

    Returns:
        ``(path, head, embeddings)``: the checkpoint directory and the float32
        ``lm_head`` [V, H] and embedding [V, H] it holds.
    """
    from safetensors.torch import load_file, save_file

    target = make_target(path, kind="oracle", seed=seed, **target_kw)
    file = Path(target) / "model.safetensors"
    sd = load_file(str(file))
    emb = sd["model.embed_tokens.weight"].float()
    head = _two_way_head(emb, a, b, partner, torch.Generator().manual_seed(seed))
    sd["lm_head.weight"] = head.to(sd["lm_head.weight"].dtype)
    save_file(
        {k: v.contiguous() for k, v in sd.items()}, str(file), metadata={"format": "pt"}
    )
    return target, head, emb


def make_two_way_arch_target(
    path: str | os.PathLike,
    arch: str,
    *,
    a: float = 0.05,
    b: float = 0.045,
    partner: tuple[int, int] | None = None,
    seed: int = 1,
    oracle_noise: float = 1.0,
    **config_overrides,
) -> str:
    """:func:`make_two_way_target` for a :func:`make_arch_target` architecture.

    The random target's embeddings become oracle rows (equal norm, the mask row
    zero), its ``lm_head`` ``a E + b E[perm]``, and every attention output and
    MLP output projection (``o_proj``, ``down_proj``: dense, routed and shared
    experts) is scaled by ``oracle_noise``: after token ``x`` the law puts most
    of its mass on ``x`` and ``perm^-1(x)``, moved by the context through
    attention. An oracle drafter (:func:`make_dflash_drafter`,
    ``kind="oracle"``) drafts that law's last-token part, so trees branch and
    accept at T = 1.

    Returns:
        ``str(path)``.
    """
    from safetensors.torch import load_file, save_file

    target = make_arch_target(path, arch, seed=seed, **config_overrides)
    tcfg = json.loads((Path(target) / "config.json").read_text())
    hidden, vocab = tcfg["hidden_size"], tcfg["vocab_size"]
    rank = min(hidden, tcfg["num_key_value_heads"] * tcfg["head_dim"])
    g = torch.Generator().manual_seed(seed)
    emb = _oracle_embeddings(g, vocab, hidden, rank)
    head = _two_way_head(emb, a, b, partner, g)
    file = Path(target) / "model.safetensors"
    sd = load_file(str(file))
    dtype = sd["lm_head.weight"].dtype
    sd["model.embed_tokens.weight"] = emb.to(dtype)
    sd["lm_head.weight"] = head.to(dtype)
    for name in sd:
        if name.endswith("o_proj.weight") or "down_proj" in name:
            sd[name] = (sd[name].float() * oracle_noise).to(dtype)
    save_file(
        {k: v.contiguous() for k, v in sd.items()}, str(file), metadata={"format": "pt"}
    )
    return target


def build_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """Default ``target_layer_ids``: ``num_ids`` distinct layers spread evenly.

    DFlash's rule: one id is the middle layer; several are evenly spaced (and
    rounded) over ``[1, num_target_layers - 3]``, e.g. ``[1, 9, 17, 25, 33]``
    for 36 layers and 5 ids. When that range is too short for distinct ids
    (tiny targets), it widens to ``[1, num_target_layers - 2]``, then
    ``[0, num_target_layers - 1]``. Ids are 0-based, ascending and distinct
    (vLLM collects each aux layer once, in layer order).
    """
    if num_ids < 1:
        raise ValueError("num_ids must be >= 1")
    if num_ids > num_target_layers:
        raise ValueError(
            f"cannot pick {num_ids} distinct target layers out of {num_target_layers}"
        )
    if num_ids == 1:
        return [num_target_layers // 2]
    n = num_target_layers
    for lo, hi in ((1, n - 3), (1, n - 2), (0, n - 1)):
        if hi - lo + 1 >= num_ids:
            # Evenly spaced; distinct because the span holds >= num_ids integers.
            return [round(lo + i * (hi - lo) / (num_ids - 1)) for i in range(num_ids)]
    raise AssertionError("unreachable")


def make_dflash_drafter(
    path: str | os.PathLike,
    target_path: str | os.PathLike,
    *,
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids: Sequence[int] | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    mask_token_id: int = MASK_TOKEN_ID,
    seed: int = 0,
    kind: Literal["random", "oracle"] = "random",
    dtype: str | None = None,
) -> str:
    """Write a DFlash draft checkpoint for the target at ``target_path``.

    Args:
        path: output directory.
        target_path: a target written by :func:`make_target` (its config gives
            hidden size, vocabulary, layer count, rope settings and the
            defaults for the head layout; for ``kind="oracle"`` its embedding
            table is read).
        num_layers: draft decoder layers.
        block_size: DFlash block size (bonus + ``block_size - 1`` draft
            tokens). Stored at the top level of ``config.json``; vLLM 0.32
            ignores it (pass ``num_speculative_tokens``), the DDTree adapter
            derives its default draft length from it.
        target_layer_ids: 0-based target layers whose outputs feed ``fc``;
            default :func:`build_target_layer_ids` with ``num_layers`` ids.
        num_heads, num_kv_heads, head_dim, intermediate_size: default to the
            target's.
        mask_token_id: must be inside the target vocabulary (default
            :data:`MASK_TOKEN_ID`, an added special token of the tokenizer).
        seed: weight seed.
        kind: ``"random"`` or ``"oracle"`` (see the module docstring).
        dtype: default the target's.

    Returns:
        ``str(path)``.
    """
    from safetensors import safe_open

    if kind not in ("random", "oracle"):
        raise ValueError(f"drafter kind must be 'random' or 'oracle', got {kind!r}")
    target_path = Path(target_path)
    tcfg = json.loads((target_path / "config.json").read_text())
    hidden = tcfg["hidden_size"]
    vocab_size = tcfg["vocab_size"]
    n_target = tcfg["num_hidden_layers"]
    num_heads = num_heads or tcfg["num_attention_heads"]
    num_kv_heads = num_kv_heads or tcfg["num_key_value_heads"]
    head_dim = head_dim or tcfg.get("head_dim") or hidden // tcfg["num_attention_heads"]
    intermediate_size = intermediate_size or tcfg["intermediate_size"]
    dtype = dtype or tcfg.get("dtype") or tcfg.get("torch_dtype") or "float32"
    torch_dtype = _torch_dtype(dtype)
    _check_heads(num_heads, num_kv_heads, head_dim)
    if block_size < 2:
        raise ValueError("block_size must be >= 2 (bonus token + drafts)")
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(
            f"mask_token_id {mask_token_id} outside the target vocab ({vocab_size})"
        )
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(n_target, num_layers)
    target_layer_ids = [int(i) for i in target_layer_ids]
    if (
        not target_layer_ids
        or any(not 0 <= i < n_target for i in target_layer_ids)
        or sorted(set(target_layer_ids)) != target_layer_ids
    ):
        raise ValueError(
            f"target_layer_ids must be distinct, ascending and in [0, {n_target}); "
            f"got {target_layer_ids}"
        )

    from vllm_ddtree.drafter.model import DFlashDrafter, DrafterShape

    # The target-derived fields (rope, eps, positions, vocab) as for the trained
    # drafter; the head layout may be overridden.
    shape = dataclasses.replace(
        DrafterShape.from_target(
            SimpleNamespace(**tcfg),
            num_layers=num_layers,
            target_layer_ids=target_layer_ids,
            mask_token_id=mask_token_id,
            block_size=block_size,
        ),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
    )

    g = torch.Generator().manual_seed(seed)
    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
    sd: dict[str, torch.Tensor] = {
        "fc.weight": _linear(g, hidden, hidden * len(target_layer_ids)),
        "hidden_norm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
    }
    for i in range(num_layers):
        p = f"layers.{i}."
        sd.update(
            _decoder_layer(
                g, p, hidden, q_out, kv_out, head_dim, intermediate_size, qk_norm=True
            )
        )

    if kind == "oracle":
        with safe_open(str(target_path / "model.safetensors"), framework="pt") as f:
            embed = f.get_tensor("model.embed_tokens.weight").float()
        rank = min(hidden, kv_out)
        if bool((embed[:, rank:] != 0).any()) or bool(
            (embed[mask_token_id] != 0).any()
        ):
            raise ValueError(
                "an oracle drafter needs an oracle target (zero mask embedding, "
                f"embeddings inside the first {rank} = min(hidden, num_kv_heads * "
                "head_dim) coordinates)"
            )
        v_pass, o_pass = _oracle_value_path(hidden, num_heads, num_kv_heads, head_dim)
        sd["fc.weight"].zero_()
        for i in range(num_layers):
            p = f"layers.{i}."
            sd[p + "self_attn.q_proj.weight"].zero_()
            sd[p + "self_attn.k_proj.weight"].zero_()
            sd[p + "self_attn.v_proj.weight"] = v_pass.clone()
            sd[p + "self_attn.o_proj.weight"] = o_pass.clone()
            for name in ("gate_proj", "up_proj", "down_proj"):
                sd[p + f"mlp.{name}.weight"].zero_()

    # One checkpoint writer for the format (the trained drafter's); the mask slots
    # use the target's embedding of the tokenizer's <|MASK|> token.
    model = DFlashDrafter(shape)
    model.load_state_dict({**sd, "mask_embedding": torch.zeros(hidden)})
    path = Path(path)
    model.export(path, dtype=torch_dtype, mask_embedding=False)
    write_tokenizer(path, vocab_size)
    return str(path)


def make_pair(
    tmpdir: str | os.PathLike,
    kind: Literal["random", "oracle"] = "random",
    arch: Literal["qwen3", "llama"] = "qwen3",
    *,
    name: str | None = None,
    **kw,
) -> tuple[str, str]:
    """Write a target and a matching DFlash drafter under ``tmpdir``.

    Directories ``tmpdir/{name}-target`` and ``tmpdir/{name}-dflash``, ``name``
    defaulting to ``f"{arch}-{kind}"`` (give distinct names to pairs that
    differ only in other arguments).
    Keyword arguments prefixed ``target_`` / ``drafter_`` go to
    :func:`make_target` / :func:`make_dflash_drafter` without the prefix;
    ``seed`` goes to both (the drafter gets ``seed + 1``). Returns
    ``(target_dir, drafter_dir)``.
    """
    tkw = {k[len("target_") :]: v for k, v in kw.items() if k.startswith("target_")}
    dkw = {k[len("drafter_") :]: v for k, v in kw.items() if k.startswith("drafter_")}
    rest = {k: v for k, v in kw.items() if not k.startswith(("target_", "drafter_"))}
    seed = rest.pop("seed", 0)
    if rest:
        raise TypeError(f"unexpected make_pair arguments: {sorted(rest)}")
    tmpdir = Path(tmpdir)
    name = name or f"{arch}-{kind}"
    target = make_target(tmpdir / f"{name}-target", arch, kind=kind, seed=seed, **tkw)
    drafter = make_dflash_drafter(
        tmpdir / f"{name}-dflash", target, kind=kind, seed=seed + 1, **dkw
    )
    return target, drafter


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def _check_vocab_size(vocab_size: int) -> None:
    if vocab_size < _NUM_NAMED_TOKENS:
        raise ValueError(f"vocab_size must be >= {_NUM_NAMED_TOKENS}, got {vocab_size}")


def _check_heads(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    if head_dim not in CPU_ATTENTION_HEAD_SIZES:
        raise ValueError(
            f"head_dim {head_dim} is not a CPU attention head size "
            f"{CPU_ATTENTION_HEAD_SIZES}"
        )
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError("num_heads must be a positive multiple of num_kv_heads")


def _torch_dtype(dtype: str) -> torch.dtype:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}"
        ) from None


def _randn(g: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * std


def _decoder_layer(
    g: torch.Generator,
    prefix: str,
    hidden: int,
    q_out: int,
    kv_out: int,
    head_dim: int,
    intermediate: int,
    qk_norm: bool,
) -> dict[str, torch.Tensor]:
    """Random weights of one Llama/Qwen3 decoder layer.

    The draw order is fixed by the seed.
    """
    sd = {
        prefix + "self_attn.q_proj.weight": _linear(g, q_out, hidden),
        prefix + "self_attn.k_proj.weight": _linear(g, kv_out, hidden),
        prefix + "self_attn.v_proj.weight": _linear(g, kv_out, hidden),
        prefix + "self_attn.o_proj.weight": _linear(g, hidden, q_out),
    }
    if qk_norm:
        sd[prefix + "self_attn.q_norm.weight"] = torch.ones(head_dim)
        sd[prefix + "self_attn.k_norm.weight"] = torch.ones(head_dim)
    sd[prefix + "input_layernorm.weight"] = torch.ones(hidden)
    sd[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden)
    sd[prefix + "mlp.gate_proj.weight"] = _linear(g, intermediate, hidden)
    sd[prefix + "mlp.up_proj.weight"] = _linear(g, intermediate, hidden)
    sd[prefix + "mlp.down_proj.weight"] = _linear(g, hidden, intermediate)
    return sd


def _linear(g: torch.Generator, out_features: int, in_features: int) -> torch.Tensor:
    """Variance-preserving init: unit-RMS inputs give unit-RMS outputs."""
    return _randn(g, out_features, in_features, std=1.0 / math.sqrt(in_features))


def _oracle_embeddings(
    g: torch.Generator, vocab: int, hidden: int, rank: int
) -> torch.Tensor:
    """Rows of equal norm (unit RMS) supported on the first ``rank`` coordinates.

    Distinct random directions make ``argmax_j <e_i, e_j>`` equal ``i``; the
    mask row is zero.
    """
    e = torch.zeros(vocab, hidden)
    d = _randn(g, vocab, rank)
    e[:, :rank] = d / d.norm(dim=1, keepdim=True) * math.sqrt(hidden)
    e[MASK_TOKEN_ID] = 0.0
    return e


def _two_way_head(
    emb: torch.Tensor,
    a: float,
    b: float,
    partner: tuple[int, int] | None,
    g: torch.Generator,
) -> torch.Tensor:
    """``a E + b E[perm]`` with the mask row zero, ``perm`` drawn from ``g``
    (``partner = (x, y)`` makes ``perm[x] = y``)."""
    perm = torch.randperm(emb.shape[0], generator=g)
    if partner is not None:
        x, y = partner
        j = int((perm == y).nonzero())
        perm[j], perm[x] = perm[x].clone(), perm[j].clone()
    head = a * emb + b * emb[perm]
    head[MASK_TOKEN_ID] = 0.0
    return head


def _oracle_value_path(
    hidden: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``v_proj`` and ``o_proj`` whose product is the identity on the first
    ``min(hidden, num_kv_heads * head_dim)`` coordinates.

    Coordinate ``c`` goes to kv head ``c // head_dim`` and comes back from the
    first query head of that kv head's group.
    """
    kv_out, q_out = num_kv_heads * head_dim, num_heads * head_dim
    group = num_heads // num_kv_heads
    v = torch.zeros(kv_out, hidden)
    o = torch.zeros(hidden, q_out)
    for c in range(min(hidden, kv_out)):
        kv_head, j = divmod(c, head_dim)
        v[c, c] = 1.0
        o[c, kv_head * group * head_dim + j] = 1.0
    return v, o


def _save_safetensors(
    file: Path, sd: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.to(dtype).contiguous() for k, v in sd.items()},
        str(file),
        metadata={"format": "pt"},
    )


def _add_score_correction_bias(path: Path, config, g, dtype) -> None:
    """vLLM's DeepSeek-V3 router (``noaux_tc``) loads a per-expert
    ``e_score_correction_bias`` that transformers' model does not write: small
    random values, so that grouped routing depends on them."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    sd = load_file(str(file))
    for i in range(config.first_k_dense_replace, config.num_hidden_layers):
        name = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        if name not in sd:
            sd[name] = _randn(g, config.n_routed_experts, std=0.1).to(dtype)
    save_file(sd, str(file), metadata={"format": "pt"})


def _write_json(file: Path, obj) -> None:
    file.write_text(json.dumps(obj, indent=2) + "\n")
