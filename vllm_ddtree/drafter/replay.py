# SPDX-License-Identifier: Apache-2.0
"""Offline evaluation that predicts vLLM: a replay of vLLM's own drafting steps.

vLLM's ``"dflash"`` (the greedy chain, T = 0) runs the drafter on held-out prompts
one request at a time; every verify step's accepted count is recorded from its
rejection sampler. Offline, the trained model drafts at exactly those anchors (the
position of each step's bonus token) from the target's hidden states of the same
text, and its chain acceptance is compared with vLLM's, step by step. Agreement
says the offline numbers (``train.evaluate``'s) measure what vLLM will see; the
same run also gives the offline stride estimate beside it.

    python -m vllm_ddtree.drafter.replay --checkpoint vllm_ddtree/drafter/smollm2_135m
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch

from vllm_ddtree.drafter import train
from vllm_ddtree.drafter.model import DFlashDrafter


def vllm_chain_steps(target_dir: str, drafter_dir: str, prompts: list[list[int]],
                     max_new_tokens: int, num_drafts: int) -> list[dict]:
    """Runs vLLM's ``"dflash"`` chain greedily on each prompt (one at a time).

    Returns, per prompt: ``prompt_ids``, ``output_ids`` and per verify step the
    drafts it verified (``drafts``) and how many it accepted (``accepted``).
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the hook below
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, not most of the memory
    import vllm
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.spec_decode.dflash import DFlashProposer

    steps: list[tuple[int, int]] = []
    drafted: list[list[int]] = []
    forward = RejectionSampler.forward
    greedy_sample = DFlashProposer._greedy_sample

    def record(self, metadata, *args, **kwargs):
        out = forward(self, metadata, *args, **kwargs)
        valid = (out.sampled_token_ids >= 0).sum(dim=1).tolist()  # -1: padding
        steps.extend(zip(metadata.num_draft_tokens, [v - 1 for v in valid], strict=True))
        return out

    def record_drafts(self, hidden_states):
        out = greedy_sample(self, hidden_states)
        drafted.append(out.flatten().tolist())
        return out

    RejectionSampler.forward = record
    DFlashProposer._greedy_sample = record_drafts
    try:
        llm = vllm.LLM(model=target_dir, dtype="float32", max_num_seqs=1, seed=0,
                       max_model_len=max(len(p) for p in prompts) + max_new_tokens + 32,
                       speculative_config={"method": "dflash", "model": drafter_dir,
                                           "num_speculative_tokens": num_drafts})
        params = vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        runs = []
        for ids in prompts:
            steps.clear()
            drafted.clear()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            runs.append({"prompt_ids": ids, "output_ids": list(out[0].outputs[0].token_ids),
                         "drafts": [d for d, _ in steps], "accepted": [a for _, a in steps],
                         # the tokens each step verified (proposal k -> step k)
                         "draft_ids": drafted[:len(steps)]})
        del llm
    finally:
        RejectionSampler.forward = forward
        DFlashProposer._greedy_sample = greedy_sample
    return runs


@torch.no_grad()
def offline_chain(model: DFlashDrafter, hf_target, sequence: list[int],
                  anchors: list[int]) -> tuple[list[int], list[list[int]]]:
    """The chain acceptance of the trained model's greedy block at each anchor (the
    bonus token's position in ``sequence``), from the target's fp32 hidden states
    of ``sequence``, counted over the drafts whose labels ``sequence`` holds; and
    the drafted tokens."""
    s = model.shape
    ids = torch.tensor([sequence])
    hs = hf_target.model(input_ids=ids, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1] for i in s.target_layer_ids], dim=-1)  # [1, T, F]
    embed = hf_target.model.embed_tokens.weight
    head = hf_target.get_output_embeddings().weight
    bs = s.block_size
    out, drafts = [], []
    for start in range(0, len(anchors), 32):
        chunk = torch.tensor([anchors[start:start + 32]])
        batch = {
            "features": feats,
            "context_positions": torch.arange(feats.shape[1]).unsqueeze(0),
            "bonus": ids[0, chunk[0]].unsqueeze(0),
            "anchors": chunk,
            "query_positions": (chunk[:, :, None] + torch.arange(bs)).flatten(1),
        }
        pred = model.to_target_ids(train.drafter_logits(model, embed, head, batch).argmax(-1))
        for a, p in enumerate(chunk[0].tolist()):
            labels = sequence[p + 1:p + bs]
            hits = (pred[0, a, :len(labels)] == torch.tensor(labels, dtype=torch.long))
            out.append(int(hits.long().cumprod(0).sum()))
            drafts.append(pred[0, a].tolist())
    return out, drafts


def replay(target_dir: str, drafter_dir: str, prompts: list[list[int]],
           max_new_tokens: int) -> dict:
    """vLLM's chain acceptance and the offline replay of the same steps."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    model = DFlashDrafter.load(Path(drafter_dir), hf.model.embed_tokens.weight).eval()
    num_drafts = model.shape.block_size - 1
    runs = vllm_chain_steps(target_dir, drafter_dir, prompts, max_new_tokens, num_drafts)
    vllm_acc, offline_acc, stride_acc, same, first_same = [], [], [], 0, 0
    vllm_acc_64 = []  # steps drafting within the first 64 output tokens
    for run in runs:
        seq = run["prompt_ids"] + run["output_ids"]
        anchors, kept, kept_drafts = [], [], []
        bonus = len(run["prompt_ids"])  # the first draft follows the prefill's token
        # The prefill's own sample goes through the rejection sampler too, with no
        # drafts: it is not a drafting step (proposal k is verified by the k-th
        # step that has drafts).
        verified = [(d, a) for d, a in zip(run["drafts"], run["accepted"], strict=True)
                    if d > 0]
        for k, (drafts, accepted) in enumerate(verified):
            # Steps whose every label is in the output (the last ones may draft
            # past EOS or max_tokens, which the output does not show).
            if drafts == num_drafts and bonus + num_drafts < len(seq):
                anchors.append(bonus)
                kept.append(accepted)
                kept_drafts.append(run["draft_ids"][k])
                if bonus - len(run["prompt_ids"]) < 64:
                    vllm_acc_64.append(accepted)
            bonus += accepted + 1
        offline, offline_drafts = offline_chain(model, hf, seq, anchors)
        run["replayed"] = offline
        # train.evaluate's estimate on the same text: a block every block_size tokens.
        stride = list(range(len(run["prompt_ids"]), len(seq) - num_drafts, num_drafts + 1))
        stride_acc += offline_chain(model, hf, seq, stride)[0]
        vllm_acc += kept
        offline_acc += offline
        same += sum(a == b for a, b in zip(kept, offline, strict=True))
        first_same += sum(a[0] == b[0] for a, b in zip(kept_drafts, offline_drafts,
                                                       strict=True))
    tau_vllm = 1 + float(np.mean(vllm_acc)) if vllm_acc else None
    tau_offline = 1 + float(np.mean(offline_acc)) if offline_acc else None
    return {
        "steps": len(vllm_acc),
        "tau_vllm": tau_vllm,
        "tau_offline_replay": tau_offline,
        "relative_gap": (abs(tau_offline - tau_vllm) / tau_vllm) if vllm_acc else None,
        "tau_vllm_first_64": 1 + float(np.mean(vllm_acc_64)) if vllm_acc_64 else None,
        "tau_offline_stride": 1 + float(np.mean(stride_acc)) if stride_acc else None,
        "steps_equal": same,
        # Steps where vLLM's first draft token is the offline model's.
        "first_drafts_equal": first_same,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> None:
    from vllm_ddtree import assets
    from vllm_ddtree.drafter.__main__ import DEFAULT_EXPORT

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_EXPORT)
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench", "gsm8k",
                                                     "sharegpt"])
    p.add_argument("--prompts-per-dataset", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="JSON report")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target = assets.smollm2_target()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    prompts = []
    for ds in args.datasets:
        # The benchmarks' prompts, seed 1 (bench_real's fresh-prompts order uses 0).
        texts = assets.load_prompts(ds, args.prompts_per_dataset, tok, seed=1,
                                    max_prompt_tokens=384,
                                    split="eval" if ds == "sharegpt" else "all")
        prompts += [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    report = replay(target, str(args.checkpoint), prompts, args.max_new_tokens)
    report["checkpoint"] = str(args.checkpoint)
    report["max_new_tokens"] = args.max_new_tokens
    summary = {k: report[k] for k in ("steps", "tau_vllm", "tau_offline_replay",
                                       "relative_gap", "steps_equal", "first_drafts_equal",
                                       "tau_vllm_first_64", "tau_offline_stride")}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
