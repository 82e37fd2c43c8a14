# SPDX-License-Identifier: Apache-2.0
"""Trains the project's DFlash drafter for SmolLM2-135M-Instruct, stage by stage.

    python -m vllm_ddtree.drafter all --workdir ~/.cache/vllm-ddtree/drafter-work

Stages (each resumable; ``all`` runs the missing ones in order):
``generate`` (target continuations), ``features`` (target hidden states),
``train`` (DFlash objective, checkpoints every ``--ckpt-every`` steps),
``export`` (vLLM checkpoint directory, default ``vllm_ddtree/drafter/smollm2_135m``);
``data`` runs the first two.
Runs on CUDA when available, else CPU. Safe to kill at any point.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from vllm_ddtree import assets

DEFAULT_WORKDIR = assets.cache_root() / "drafter-work-v3"
DEFAULT_EXPORT = Path(__file__).resolve().parent / "smollm2_135m"
# The target's continuations, kept in the repository (token ids, gzip): the costly
# stage, so that generation goes on across machines and sessions. v3: greedy, fp32
# (v2's pack, smollm2_135m.jsonl.gz: bf16, a quarter sampled at T = 1).
DEFAULT_PACK = (Path(__file__).resolve().parent / "generations"
                / "smollm2_135m_fp32_greedy.jsonl.gz")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_ddtree.drafter", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["generate", "features", "data", "train", "export", "all"],
                   help="data: generate + features")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--export-dir", type=Path, default=DEFAULT_EXPORT)
    p.add_argument("--pack", type=Path, default=DEFAULT_PACK,
                   help="generations kept across work directories (read before, "
                        "rewritten during generation)")
    p.add_argument("--num-sharegpt", type=int, default=10000)
    p.add_argument("--num-code", type=int, default=3000)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--gen-dtype", default="float32",
                   help="the target's precision for continuations and features")
    p.add_argument("--sampled-every", type=int, default=0,
                   help="N > 0: every N-th prompt sampled at T=1 (0: all greedy)")
    p.add_argument("--topk", type=int, default=20,
                   help="the target's top-k log-probs stored per token (soft labels)")
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=[1, 9, 18, 27])
    p.add_argument("--num-layers", type=int, default=3)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=16)  # <empty_output>
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--seqs-per-step", type=int, default=8)
    p.add_argument("--anchors-per-seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--loss-decay", type=float, default=7.0,
                   help="position j of the block has loss weight exp(-(j-1)/decay)")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--val-every-nth-seq", type=int, default=50,
                   help="sequence i is held out for evaluation when i %% N == 0")
    p.add_argument("--autocast", choices=["auto", "bf16", "none"], default="auto",
                   help="forward precision (fp32 master weights either way)")
    p.add_argument("--draft-vocab-size", type=int, default=16384,
                   help="0: the target's LM head over its whole vocabulary; N: the "
                        "drafter's own head over the N most frequent continuation tokens")
    p.add_argument("--lr-schedule", choices=["cosine", "wsd"], default="wsd",
                   help="wsd: warmup, constant, linear decay over the last --decay-steps "
                        "(extendable across sessions by a larger --steps)")
    p.add_argument("--decay-steps", type=int, default=1000)
    p.add_argument("--distill", type=float, default=0.5,
                   help="weight of the target's top-k soft labels beside the hard label")
    p.add_argument("--bucketed", action=argparse.BooleanOptionalAction, default=True,
                   help="a step's sequences are length neighbours (little padding)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="train: start from this exported drafter (e.g. the committed one) "
                        "instead of the target's layers")
    p.add_argument("--max-sequences", type=int, default=0,
                   help="features: only this many generated sequences (0: all), a seeded "
                        "random subset; with --data-round R the R-th disjoint subset, so a "
                        "session-sized campaign sees new data each round")
    p.add_argument("--data-round", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from vllm_ddtree.drafter import data

    args.workdir.mkdir(parents=True, exist_ok=True)
    target = assets.smollm2_target()
    stages = {"all": ["generate", "features", "train", "export"],
              "data": ["generate", "features"]}.get(args.stage, [args.stage])
    if "generate" in stages:
        data.restore_generations(args.workdir, args.pack)
        prompts = data.training_prompts(args.num_sharegpt, args.num_code, args.seed)
        data.generate_continuations(args.workdir, target, prompts,
                                    max_new_tokens=args.max_new_tokens, pack=args.pack,
                                    dtype=args.gen_dtype, sampled_every=args.sampled_every)
    if "features" in stages:
        data.extract_features(args.workdir, target, args.target_layer_ids,
                              dtype=args.gen_dtype, topk=args.topk,
                              max_sequences=args.max_sequences, data_round=args.data_round,
                              seed=args.seed)
    if "train" in stages or "export" in stages:
        from vllm_ddtree.drafter import train

        config = train.TrainConfig.from_args(args)
        (args.workdir / "train_config.json").write_text(json.dumps(config.__dict__, indent=2))
        if "train" in stages:
            train.train(args.workdir, target, config)
        if "export" in stages:
            train.export_latest(args.workdir, target, config, args.export_dir)


if __name__ == "__main__":
    main()
