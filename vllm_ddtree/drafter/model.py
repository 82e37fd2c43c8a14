# SPDX-License-Identifier: Apache-2.0
"""A trainable DFlash drafter that computes exactly what vLLM's in-tree one computes.

vLLM 0.32's ``DFlashQwen3ForCausalLM`` (``model_executor/models/qwen3_dflash.py``):

* context: ``c = fc(concat_k h_k)`` over the target's aux hidden states, then per
  drafter layer ``K = rope(k_norm(k_proj(hidden_norm(c))))``,
  ``V = v_proj(hidden_norm(c))`` (context tokens only contribute keys and values,
  no queries);
* queries: the block ``[bonus, mask x (block_size - 1)]`` at positions ``p .. p+bs-1``
  runs through Qwen3 decoder layers (pre-norm, per-head q/k RMSNorm, neox RoPE),
  attending non-causally to the context before ``p`` and to the whole block;
* ``norm`` then the target's (shared) LM head; mask position ``j`` predicts token
  ``p + j``. With a reduced draft vocabulary (``draft_vocab_size``, as EAGLE-3) the
  drafter has its own LM head over ``Vd`` tokens, and ``d2t`` maps draft id ``d``
  to target id ``d + d2t[d]``; vLLM scatters those logits into the target vocabulary
  (-inf elsewhere), so the trees are drawn from the draft tokens only (verification
  is unchanged: lossless whatever the drafter proposes).

Checkpoint format (what vLLM loads): ``config.json`` with
``architectures = ["DFlashDraftModel"]``, ``model_type = "qwen3"`` and
``dflash_config = {mask_token_id, target_layer_ids}``; ``model.safetensors`` with the
names below and no embeddings or LM head (shared with the target);
``mask_embedding.pt`` with the trained embedding of the mask slot. A reduced
vocabulary adds ``draft_vocab_size`` to the config and ``lm_head.weight`` [Vd, H]
and ``d2t`` [Vd] to the safetensors (the token embeddings stay the target's).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DrafterShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    vocab_size: int
    max_position_embeddings: int
    # None: the target's LM head over its whole vocabulary (shared, not exported).
    draft_vocab_size: int | None = None

    @classmethod
    def from_target(
        cls,
        target_config,
        *,
        num_layers: int,
        target_layer_ids,
        mask_token_id: int,
        block_size: int,
        draft_vocab_size: int | None = None,
    ) -> DrafterShape:
        rope = getattr(target_config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))
        return cls(
            hidden_size=target_config.hidden_size,
            num_layers=num_layers,
            num_heads=target_config.num_attention_heads,
            num_kv_heads=target_config.num_key_value_heads,
            head_dim=getattr(target_config, "head_dim", None)
            or target_config.hidden_size // target_config.num_attention_heads,
            intermediate_size=target_config.intermediate_size,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=float(theta),
            target_layer_ids=tuple(target_layer_ids),
            mask_token_id=mask_token_id,
            block_size=block_size,
            vocab_size=target_config.vocab_size,
            max_position_embeddings=target_config.max_position_embeddings,
            draft_vocab_size=draft_vocab_size or None,
        )

    def hf_config(self, dtype: torch.dtype = torch.bfloat16) -> dict:
        """The drafter's ``config.json`` as vLLM 0.32's DFlash loader reads it.

        ``block_size`` is stored at the top level (vLLM 0.32 reads neither copy;
        the ddtree adapter derives its default draft length from it) and in
        ``dflash_config`` (newer z-lab schema). No embeddings; no LM head either
        (vLLM shares the target's) unless the vocabulary is reduced.
        """
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "block_size": self.block_size,
            **(
                {"draft_vocab_size": self.draft_vocab_size}
                if self.draft_vocab_size
                else {}
            ),
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
            },
        }


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(
        x.dtype
    ) * weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """Neox-style (rotate-half) RoPE tables.

    ``positions`` [...] -> cos, sin [..., head_dim].
    """
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    )
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DrafterLayer(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        h, hd = s.hidden_size, s.head_dim
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, s.num_heads * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(h, s.num_kv_heads * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(h, s.num_kv_heads * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(s.num_heads * hd, h, bias=False)
        self.self_attn.q_norm = nn.Module()
        self.self_attn.q_norm.weight = nn.Parameter(torch.ones(hd))
        self.self_attn.k_norm = nn.Module()
        self.self_attn.k_norm.weight = nn.Parameter(torch.ones(hd))
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(s.intermediate_size, h, bias=False)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = nn.Parameter(torch.ones(h))


class DFlashDrafter(nn.Module):
    """Parameters named as in the vLLM checkpoint, plus ``mask_embedding``."""

    def __init__(self, shape: DrafterShape):
        super().__init__()
        self.shape = shape
        h = shape.hidden_size
        self.layers = nn.ModuleList(
            DrafterLayer(shape) for _ in range(shape.num_layers)
        )
        self.fc = nn.Linear(h * len(shape.target_layer_ids), h, bias=False)
        self.hidden_norm = nn.Module()
        self.hidden_norm.weight = nn.Parameter(torch.ones(h))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(h))
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        if shape.draft_vocab_size:
            self.lm_head = nn.Linear(h, shape.draft_vocab_size, bias=False)
            # Target id of each draft id (ascending); set by init_from_target or load.
            draft_ids = torch.arange(shape.draft_vocab_size, dtype=torch.int64)
            self.register_buffer("draft_token_ids", draft_ids)

    @property
    def has_own_lm_head(self) -> bool:
        return self.shape.draft_vocab_size is not None

    # ----------------------------------------------------------------------- #
    def init_from_target(
        self, target: nn.Module, draft_token_ids: torch.Tensor | None = None
    ) -> None:
        """Warm start: drafter layer i <- the target's last layers, ``fc`` <- last tap.

        The target (Llama) layers have the same projections; Qwen3's q/k norms start
        at 1. ``fc`` starts as the identity on the deepest tap, so the context keys
        first look like the residual stream those layers were trained on. The mask
        embedding starts at the mean token embedding. A reduced vocabulary needs
        ``draft_token_ids`` ([Vd] distinct target ids); its LM head starts as the
        target's rows of those tokens.
        """
        s = self.shape
        t_layers = target.model.layers
        for i, layer in enumerate(self.layers):
            src = t_layers[len(t_layers) - s.num_layers + i]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, name).weight.data.copy_(
                    getattr(src.self_attn, name).weight
                )
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.data.copy_(
                    getattr(src.mlp, name).weight
                )
            layer.input_layernorm.weight.data.copy_(src.input_layernorm.weight)
            layer.post_attention_layernorm.weight.data.copy_(
                src.post_attention_layernorm.weight
            )
        h = s.hidden_size
        self.fc.weight.data.zero_()
        self.fc.weight.data[:, -h:] = torch.eye(h)
        self.norm.weight.data.copy_(target.model.norm.weight)
        self.mask_embedding.data.copy_(target.model.embed_tokens.weight.mean(0))
        if self.has_own_lm_head:
            if draft_token_ids is None:
                raise ValueError("a reduced draft vocabulary needs draft_token_ids")
            self.set_draft_token_ids(draft_token_ids)
            head = target.get_output_embeddings().weight
            self.lm_head.weight.data.copy_(head[self.draft_token_ids])

    def to_target_ids(self, output_ids: torch.Tensor) -> torch.Tensor:
        """Ids over the LM head's outputs -> target token ids."""
        return self.draft_token_ids[output_ids] if self.has_own_lm_head else output_ids

    def to_output_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Target-id labels (-100: none) -> LM-head output ids; a token outside the
        draft vocabulary becomes -100 (no draft can be right there)."""
        if not self.has_own_lm_head:
            return labels
        ids = self.draft_token_ids
        t2d = torch.full(
            (self.shape.vocab_size,), -100, dtype=torch.int64, device=ids.device
        )
        t2d[ids] = torch.arange(ids.numel(), device=ids.device)
        return torch.where(labels >= 0, t2d[labels.clamp(min=0)], labels)

    def set_draft_token_ids(self, draft_token_ids: torch.Tensor) -> None:
        ids = torch.as_tensor(draft_token_ids, dtype=torch.int64).flatten()
        v = self.shape.vocab_size
        if (
            ids.numel() != self.shape.draft_vocab_size
            or bool((ids < 0).any() | (ids >= v).any())
            or ids.unique().numel() != ids.numel()
        ):
            raise ValueError(
                f"draft_token_ids must be {self.shape.draft_vocab_size} distinct ids "
                f"in [0, {v})"
            )
        self.draft_token_ids.copy_(ids.sort().values)

    # ----------------------------------------------------------------------- #
    def context_kv(self, features: torch.Tensor, positions: torch.Tensor):
        """Per layer (K, V) of the context.

        features [S, T, F] -> K, V [S, kv_heads, T, hd].
        """
        s = self.shape
        ctx = rms_norm(self.fc(features), self.hidden_norm.weight, s.rms_norm_eps)
        cos, sin = rope_cos_sin(positions, s.head_dim, s.rope_theta)  # [S, T, hd]
        out = []
        for layer in self.layers:
            k = layer.self_attn.k_proj(ctx).unflatten(-1, (s.num_kv_heads, s.head_dim))
            k = rms_norm(k, layer.self_attn.k_norm.weight, s.rms_norm_eps)
            k = apply_rope(k, cos.unsqueeze(-2), sin.unsqueeze(-2))
            v = layer.self_attn.v_proj(ctx).unflatten(-1, (s.num_kv_heads, s.head_dim))
            out.append((k.transpose(1, 2), v.transpose(1, 2)))
        return out

    def forward(
        self,
        query_embeds: torch.Tensor,
        query_positions: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        context_lengths: torch.Tensor,
    ) -> torch.Tensor:
        """Blocks of queries through the layers, many blocks per context.

        Block ``a`` of sequence ``s`` attends to the context rows
        ``< context_lengths[s, a]`` (its anchor) and to its own ``block_size`` rows,
        non-causally: what vLLM's DFlash drafter computes for one block. The blocks
        never see each other, so the block part of attention is computed per block
        (``A`` small ``bs x bs`` products instead of one ``A bs x A bs`` masked one)
        and one softmax spans both parts.

        Args:
            query_embeds: [S, A * bs, H] embeddings of the blocks (mask slots already
                replaced by ``mask_embedding``).
            query_positions: [S, A * bs] absolute positions.
            context: :meth:`context_kv` output (keys over T context rows).
            context_lengths: [S, A] context rows each block sees.

        Returns:
            [S, A * bs, H] final-normed hidden states (LM head input).
        """
        s = self.shape
        bs, kvh, hd = s.block_size, s.num_kv_heads, s.head_dim
        groups = s.num_heads // kvh
        num_seqs, num_rows, _ = query_embeds.shape
        num_blocks = num_rows // bs
        cos, sin = rope_cos_sin(query_positions, hd, s.rope_theta)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        num_ctx = context[0][0].shape[2]
        # [S, 1, 1, A * bs, T]: context row t is visible to a block iff t < its anchor.
        visible = (torch.arange(num_ctx, device=query_embeds.device)
                   < context_lengths.repeat_interleave(bs, dim=1).unsqueeze(-1))
        visible = visible[:, None, None]
        h = query_embeds
        for layer, (ck, cv) in zip(self.layers, context, strict=True):
            a = layer.self_attn
            x = rms_norm(h, layer.input_layernorm.weight, s.rms_norm_eps)
            q = rms_norm(a.q_proj(x).unflatten(-1, (s.num_heads, hd)), a.q_norm.weight,
                         s.rms_norm_eps)
            k = rms_norm(a.k_proj(x).unflatten(-1, (kvh, hd)), a.k_norm.weight,
                         s.rms_norm_eps)
            v = a.v_proj(x).unflatten(-1, (kvh, hd))
            q = apply_rope(q, cos, sin) * (1.0 / math.sqrt(hd))
            k = apply_rope(k, cos, sin)
            # [S, kvh, g, A * bs, hd]: query heads grouped under their KV head.
            q = q.unflatten(2, (kvh, groups)).permute(0, 2, 3, 1, 4)
            # [S, kvh, 1, A, bs, hd]: each block's own keys and values.
            k = k.unflatten(1, (num_blocks, bs)).permute(0, 3, 1, 2, 4).unsqueeze(2)
            v = v.unflatten(1, (num_blocks, bs)).permute(0, 3, 1, 2, 4).unsqueeze(2)
            ctx_scores = (q @ ck.unsqueeze(2).transpose(-1, -2)).masked_fill(
                ~visible, float("-inf"))  # [S, kvh, g, A * bs, T]
            qb = q.unflatten(3, (num_blocks, bs))  # [S, kvh, g, A, bs, hd]
            blk_scores = qb @ k.transpose(-1, -2)  # [S, kvh, g, A, bs, bs]
            probs = torch.cat([ctx_scores.unflatten(3, (num_blocks, bs)), blk_scores],
                              dim=-1).softmax(-1).to(q.dtype)
            ctx_probs, blk_probs = probs.split([num_ctx, bs], dim=-1)
            o = ctx_probs.flatten(3, 4) @ cv.unsqueeze(2)  # [S, kvh, g, A * bs, hd]
            # [S, kvh, g, A, bs, hd]
            o = o.unflatten(3, (num_blocks, bs)) + blk_probs @ v
            # [S, A * bs, heads * hd]
            o = o.flatten(3, 4).permute(0, 3, 1, 2, 4).flatten(2)
            h = h + a.o_proj(o)
            x = rms_norm(h, layer.post_attention_layernorm.weight, s.rms_norm_eps)
            h = h + layer.mlp.down_proj(
                F.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x)
            )
        return rms_norm(h, self.norm.weight, s.rms_norm_eps)

    # ----------------------------------------------------------------------- #
    def export(
        self,
        out_dir: Path,
        dtype: torch.dtype = torch.bfloat16,
        extra_files: dict[str, str] | None = None,
        mask_embedding: bool = True,
    ) -> None:
        """Writes the vLLM checkpoint directory (config, safetensors, mask embedding).

        ``mask_embedding=False`` leaves out ``mask_embedding.pt``: the mask slots
        then use the target's embedding of ``mask_token_id``.
        """
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {
            name: p.detach().to(dtype).contiguous()
            for name, p in self.named_parameters()
            if name != "mask_embedding"
        }
        if self.has_own_lm_head:
            # vLLM's convention (EAGLE-3): target id = draft id + d2t[draft id].
            ids = self.draft_token_ids
            tensors["d2t"] = (ids - torch.arange(ids.numel())).contiguous()
        save_file(
            tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"}
        )
        if mask_embedding:
            torch.save(
                {
                    "mask_token_id": self.shape.mask_token_id,
                    "embedding": self.mask_embedding.detach().to(dtype).clone(),
                },
                out_dir / "mask_embedding.pt",
            )
        (out_dir / "config.json").write_text(
            json.dumps(self.shape.hf_config(dtype), indent=2) + "\n"
        )
        for name, text in (extra_files or {}).items():
            (out_dir / name).write_text(text)

    @classmethod
    def load(
        cls, ckpt_dir: Path, target_embeddings: torch.Tensor | None = None
    ) -> DFlashDrafter:
        """Inverse of :meth:`export` (fp32 parameters).

        A checkpoint without ``mask_embedding.pt`` uses the target's embedding of
        ``mask_token_id`` for the mask slots, as vLLM does: ``target_embeddings``
        ([V, H]) must then be given.
        """
        from safetensors.torch import load_file

        cfg = json.loads((Path(ckpt_dir) / "config.json").read_text())
        d = cfg["dflash_config"]
        shape = DrafterShape(
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=cfg["rope_theta"],
            target_layer_ids=tuple(d["target_layer_ids"]),
            mask_token_id=d["mask_token_id"],
            block_size=d.get("block_size", cfg.get("block_size", 16)),
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg["max_position_embeddings"],
            draft_vocab_size=cfg.get("draft_vocab_size"),
        )
        model = cls(shape)
        state = load_file(str(Path(ckpt_dir) / "model.safetensors"))
        d2t = state.pop("d2t", None)
        if d2t is not None:
            state["draft_token_ids"] = d2t + torch.arange(d2t.numel())
        state = {
            k: v if k == "draft_token_ids" else v.float() for k, v in state.items()
        }
        mask_path = Path(ckpt_dir) / "mask_embedding.pt"
        if mask_path.is_file():
            mask = torch.load(mask_path, weights_only=True)["embedding"]
        elif target_embeddings is not None:
            mask = target_embeddings[shape.mask_token_id]
        else:
            raise FileNotFoundError(
                f"{mask_path} is missing: pass the target's embeddings for the mask "
                "slots"
            )
        state["mask_embedding"] = mask.detach().float().clone()
        model.load_state_dict(state)
        return model
