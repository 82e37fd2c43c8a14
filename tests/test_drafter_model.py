# SPDX-License-Identifier: Apache-2.0
"""The trainable DFlash drafter computes what vLLM's in-tree DFlash drafter computes.

If training and serving disagreed (aux-layer offset, RoPE, norms, mask embedding,
what the block attends to), a trained drafter would be accepted far less in vLLM
than in training, silently. Here a random drafter made by
:class:`vllm_ddtree.drafter.model.DFlashDrafter` is exported, served by vLLM, and
its first draft logits (after the prompt's prefill) are compared with the torch
model's on the target's Hugging Face hidden states.
"""

import numpy as np
import pytest
import torch

from vllm_ddtree import tiny_models
from vllm_ddtree.drafter import train
from vllm_ddtree.drafter.data import FeatureIndex
from vllm_ddtree.drafter.model import DFlashDrafter, DrafterShape

vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 6
NODES = 64  # tree nodes per step in the served-drafter test
PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 128, 64, 33]


def random_drafter(target_dir: str, seed: int, draft_vocab_size: int | None = None
                   ) -> DFlashDrafter:
    """Random weights; with ``draft_vocab_size``, its own LM head over a random set of
    target tokens (not a prefix of the vocabulary, so a wrong id map shows)."""
    config = transformers.AutoConfig.from_pretrained(target_dir)
    shape = DrafterShape.from_target(config, num_layers=2, target_layer_ids=[0, 2],
                                     mask_token_id=tiny_models.MASK_TOKEN_ID,
                                     block_size=BLOCK_SIZE, draft_vocab_size=draft_vocab_size)
    torch.manual_seed(seed)
    model = DFlashDrafter(shape)
    with torch.no_grad():  # norms and the mask embedding away from their defaults
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
        if draft_vocab_size:
            model.set_draft_token_ids(torch.randperm(config.vocab_size)[:draft_vocab_size])
            model.lm_head.weight.mul_(20.0)  # spread logits: no near-tie argmax
    return model


def draft_logits_in_torch(model, target_dir, prompt, bonus):
    """The first block's mask-slot logits, ``[bs - 1, V']``, from the HF target's hidden
    states of ``prompt`` (the context a prefill leaves), and with the context rolled."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        hs = hf.model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in model.shape.target_layer_ids], dim=-1)
        n = len(prompt)
        batch = {
            "features": feats,
            "context_positions": torch.arange(n).unsqueeze(0),
            "bonus": torch.tensor([[bonus]]),
            "query_positions": torch.arange(n, n + BLOCK_SIZE).unsqueeze(0),
            "anchors": torch.tensor([[n]]),
        }
        embed, head = hf.model.embed_tokens.weight, hf.lm_head.weight
        ours = train.drafter_logits(model, embed, head, batch)[0, 0]
        # Non-vacuous: the context matters (a different prompt changes the draft).
        batch["features"] = torch.roll(feats, 1, dims=1)
        shifted = train.drafter_logits(model, embed, head, batch)[0, 0]
    return ours, shifted


@pytest.mark.parametrize("arch,draft_vocab", [("llama", None), ("qwen3", None), ("qwen3", 64)])
def test_vllm_serves_the_trained_model_exactly(tmp_path, vllm_patched, monkeypatch, arch,
                                               draft_vocab):
    """Draft logits served by ddtree == the torch drafter's, after the prefill and at
    every later drafting step (the context then holds tokens committed from verified
    trees). With a reduced draft vocabulary they are the Vd draft logits, and the
    served tree is the one built from the target-vocabulary logits vLLM's
    compute_logits gives (-inf outside the draft tokens), in target ids."""
    from vllm_ddtree.tree import build_ddtree
    from vllm_ddtree.vllm_adapter.proposer import DDTreeProposer

    target_dir = tiny_models.make_target(tmp_path / "target", arch=arch, kind="random",
                                         seed=11)
    model = random_drafter(target_dir, seed=12, draft_vocab_size=draft_vocab)
    model.export(tmp_path / "drafter", dtype=torch.float32)

    captured = []
    orig = DDTreeProposer._sample_draft_tokens

    def record(self, hidden_states, sampling_metadata):
        out = orig(self, hidden_states, sampling_metadata)
        captured.append(self._draft_logits.detach().clone())
        return out

    trees = []
    propose = DDTreeProposer.propose

    def record_tree(self, *args, **kwargs):
        out = propose(self, *args, **kwargs)
        trees.append(self.last_tree)
        return out

    # Tokens each verify step committed (accepted nodes + the bonus), lookup
    # nodes included: the drafter's next context grows by exactly these.
    committed = []
    from vllm_ddtree.vllm_adapter import runner as runner_module

    def record_commit(*args, **kwargs):
        plan = plan_commit(*args, **kwargs)
        committed.append(int(plan.num_committed[0]))
        return plan

    plan_commit = runner_module.plan_commit
    monkeypatch.setattr(DDTreeProposer, "_sample_draft_tokens", record)
    monkeypatch.setattr(DDTreeProposer, "propose", record_tree)
    monkeypatch.setattr(runner_module, "plan_commit", record_commit)
    llm = vllm.LLM(model=target_dir, dtype="float32", enforce_eager=True, max_model_len=256,
                   speculative_config={"method": "ddtree", "model": str(tmp_path / "drafter"),
                                       # a wide tree: some steps accept nodes
                                       "num_speculative_tokens": NODES,
                                       "ddtree_budget": "fixed",
                                       # the checkpoint's own arithmetic
                                       "ddtree_drafter_quantization": "none"})
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       vllm.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)
    del llm
    generated = list(out[0].outputs[0].token_ids)
    bonus = generated[0]
    served = captured[0].view(BLOCK_SIZE - 1, -1)  # first proposal: after the prefill

    # The same draft in torch: HF hidden states of the prompt as the context.
    ours, shifted = draft_logits_in_torch(model, target_dir, PROMPT, bonus)
    if draft_vocab:
        full = served.new_full((served.shape[0], model.shape.vocab_size), float("-inf"))
        full[:, model.draft_token_ids] = served
        want = build_ddtree(full.unsqueeze(0), NODES, root_token_ids=torch.tensor([bonus]),
                            validate=False)  # -inf outside the draft tokens
        tree = trees[0]
        assert tree.tokens.tolist() == want.tokens.tolist()
        assert tree.parents.tolist() == want.parents.tolist()
        assert set(tree.tokens[0, 1:].tolist()) <= set(model.draft_token_ids.tolist())
    assert served.shape == ours.shape
    err = (served - ours).abs().max().item()
    assert err < 2e-3 * ours.abs().max().item(), err
    assert (shifted - ours).abs().max().item() > 50 * err

    # Later steps: step k drafts from the prompt + the tokens committed so far, its
    # bonus the last of them (lookup nodes are verified too: prompts repeat here).
    bonus_at, checked = 0, 0
    for logits, num_committed in zip(captured[1:], committed, strict=False):
        bonus_at += num_committed
        if bonus_at >= len(generated):
            break
        later, _ = draft_logits_in_torch(model, target_dir, PROMPT + generated[:bonus_at],
                                         generated[bonus_at])
        later_served = logits.view(BLOCK_SIZE - 1, -1)
        assert (later_served - later).abs().max().item() < 2e-3 * later.abs().max().item()
        checked += 1
    # Where the output repeats (the llama case here), lookup nodes are accepted and
    # the steps after them check the accepted path's hidden states as context.
    assert checked >= 3


def test_dflash_chain_serves_a_reduced_vocabulary(tmp_path, vllm_patched, monkeypatch):
    """vLLM's own DFlash (the chain) loads the same reduced-vocabulary checkpoint:
    its first drafts are the torch drafter's argmax, mapped to target ids."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    target_dir = tiny_models.make_target(tmp_path / "target", arch="qwen3", kind="random",
                                         seed=11)
    model = random_drafter(target_dir, seed=13, draft_vocab_size=64)
    model.export(tmp_path / "drafter", dtype=torch.float32)
    captured = []
    orig = DFlashProposer._greedy_sample

    def record(self, hidden_states):
        out = orig(self, hidden_states)
        captured.append(out.detach().clone())
        return out

    monkeypatch.setattr(DFlashProposer, "_greedy_sample", record)
    llm = vllm.LLM(model=target_dir, dtype="float32", enforce_eager=True, max_model_len=256,
                   speculative_config={"method": "dflash", "model": str(tmp_path / "drafter"),
                                       "num_speculative_tokens": BLOCK_SIZE - 1})
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       vllm.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    del llm
    ours, _ = draft_logits_in_torch(model, target_dir, PROMPT, out[0].outputs[0].token_ids[0])
    want = model.to_target_ids(ours.argmax(-1))
    assert captured[0].flatten().tolist() == want.tolist()


@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_export_load_round_trip(tmp_path, draft_vocab):
    target_dir = tiny_models.make_target(tmp_path / "target", arch="llama", seed=3)
    model = random_drafter(target_dir, seed=4, draft_vocab_size=draft_vocab)
    model.export(tmp_path / "d", dtype=torch.float32)
    again = DFlashDrafter.load(tmp_path / "d")
    assert again.shape == model.shape
    assert model.state_dict().keys() == again.state_dict().keys()
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_draft_vocabulary_and_labels():
    """The most frequent continuation tokens (prompt tokens not counted); labels
    outside the draft vocabulary are not trained on, and ids map back."""
    index = FeatureIndex([0], 2, offsets=[0, 6], lengths=[6, 5], prompt_lengths=[3, 2],
                         ids=[0, 1])
    #                  prompt | continuation      prompt | continuation
    tokens = np.array([9, 9, 9, 4, 7, 4, 9, 9, 2, 7, 4], dtype=np.int32)
    counts = train.continuation_counts(index, tokens, [0, 1], vocab_size=10)
    assert counts.tolist() == [0, 0, 1, 0, 3, 0, 0, 2, 0, 0]
    assert train.choose_draft_vocab(counts, 2).tolist() == [4, 7]
    assert train.choose_draft_vocab(counts, 4).tolist() == [0, 2, 4, 7]  # ties: low ids
    shape = DrafterShape(hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                         intermediate_size=8, rms_norm_eps=1e-6, rope_theta=1e4,
                         target_layer_ids=(0,), mask_token_id=1, block_size=4, vocab_size=10,
                         max_position_embeddings=64, draft_vocab_size=3)
    model = DFlashDrafter(shape)
    model.set_draft_token_ids(torch.tensor([7, 2, 4]))
    labels = torch.tensor([[2, 4, 5, 7, -100]])
    assert model.to_output_labels(labels).tolist() == [[0, 1, -100, 2, -100]]
    assert model.to_target_ids(torch.tensor([2, 0, 1])).tolist() == [7, 2, 4]
    with pytest.raises(ValueError, match="distinct"):
        model.set_draft_token_ids(torch.tensor([7, 7, 4]))


def test_make_batch_anchors_labels_and_soft_labels():
    """Block a of a sequence is anchored at p (it sees context rows < p), slot j is
    labelled with token p + j, and its soft label is the top-k stored on row
    p + j - 1 (the row whose next token that is)."""
    index = FeatureIndex([0], 2, offsets=[0, 10], lengths=[10, 7], prompt_lengths=[4, 3],
                         ids=[0, 1], topk=2)
    feats = np.zeros((17, 2), dtype=np.int16)
    tokens = np.arange(100, 117, dtype=np.int32)
    # Row r's top-1 is token r + 1 (as for greedy text), its top-2 an unrelated id.
    topk_ids = np.stack([np.append(tokens[1:], 0), np.full(17, 7)], axis=1).astype(np.int32)
    topk_logp = np.tile(np.array([-0.1, -2.5], dtype=np.float16), (17, 1))
    rng = np.random.default_rng(0)
    batch = train.make_batch(index, feats, tokens, [0, 1], 3, 4, rng, torch.device("cpu"),
                             (topk_ids, topk_logp))
    labels, anchors = batch["labels"], batch["anchors"]
    assert labels.shape == (2, 3, 3)
    for s, (off, n, plen) in enumerate([(0, 10, 4), (10, 7, 3)]):
        ps = anchors[s].tolist()
        assert ps == sorted(set(ps)) and all(plen <= p <= n - 2 for p in ps)
        assert batch["features"].shape[1] == max(int(anchors[:, -1].max()), 1)
        for a, p in enumerate(ps):
            assert batch["bonus"][s, a] == tokens[off + p]
            assert batch["query_positions"][s, a * 4:(a + 1) * 4].tolist() == list(
                range(p, p + 4))
            want = [int(tokens[off + p + j]) if p + j < n else -100 for j in range(1, 4)]
            assert labels[s, a].tolist() == want
            valid = labels[s, a] >= 0
            assert (batch["soft_ids"][s, a, valid, 0] == labels[s, a, valid]).all()
            assert (batch["soft_ids"][s, a, valid, 1] == 7).all()


def test_many_blocks_equal_each_block_alone():
    """The batched forward (many anchors on one context pass, block-local attention)
    computes for every block what the same block computes alone over exactly its
    context: what vLLM's drafter serves (test_vllm_serves_the_trained_model_exactly).
    Fails if blocks see each other or a context row at or past their anchor."""
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=3, vocab_size=50)
    shape = DrafterShape.from_target(config, num_layers=2, target_layer_ids=[0, 1],
                                     mask_token_id=1, block_size=4)
    torch.manual_seed(0)
    model = DFlashDrafter(shape)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
    feats = torch.randn(2, 12, 64)
    anchors = torch.tensor([[2, 5, 11], [9, 3, 0]])  # the last block of row 1: padding
    embeds = torch.randn(2, 12, 32)
    qpos = (anchors[:, :, None] + torch.arange(4)).flatten(1)
    with torch.no_grad():
        ctx = model.context_kv(feats, torch.arange(12).expand(2, 12))
        together = model(embeds, qpos, ctx, anchors)
        for s in range(2):
            for a in range(3):
                p = int(anchors[s, a])
                rows = slice(4 * a, 4 * a + 4)
                alone_ctx = model.context_kv(feats[s:s + 1, :max(p, 1)],
                                             torch.arange(max(p, 1)).unsqueeze(0))
                alone = model(embeds[s:s + 1, rows], qpos[s:s + 1, rows], alone_ctx,
                              torch.tensor([[p]]))
                torch.testing.assert_close(together[s, rows], alone[0], rtol=1e-5,
                                           atol=1e-5)


def test_soft_labels_pull_towards_the_target_distribution():
    """distill = 1: the loss is the cross-entropy against the target's top-k
    renormalised over the draft vocabulary, minimal (zero gradient) when the
    drafter's distribution equals it; a top-k token outside the draft vocabulary
    gets no mass."""
    config = transformers.LlamaConfig(hidden_size=8, intermediate_size=16,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      num_hidden_layers=2, vocab_size=10)
    shape = DrafterShape.from_target(config, num_layers=1, target_layer_ids=[0],
                                     mask_token_id=1, block_size=2, draft_vocab_size=4)
    model = DFlashDrafter(shape)
    model.set_draft_token_ids(torch.tensor([2, 3, 5, 7]))
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.eye(4, 8))
    # Target top-3 over ids 3, 5, 9 with probs 0.5, 0.3, 0.2: 9 is not a draft token,
    # so the soft label is 3: 5/8, 5: 3/8 over the draft vocabulary.
    want = torch.tensor([0.0, 5 / 8, 3 / 8, 0.0])
    batch = {"labels": torch.tensor([[[3]]]),
             "soft_ids": torch.tensor([[[[3, 5, 9]]]]),
             "soft_logprobs": torch.tensor([[[[0.5, 0.3, 0.2]]]]).log()}
    weights = torch.ones(1)
    at_target = torch.zeros(1, 1, 1, 8)
    at_target[..., :4] = (want + 1e-30).log().clamp(min=-60)
    hidden = at_target.requires_grad_()
    loss = train.loss_fn(model, None, hidden, batch, weights, distill=1.0)
    loss.backward()
    assert hidden.grad[..., 1:3].abs().max() < 1e-6
    entropy = -(want[1:3] * want[1:3].log()).sum()
    assert loss.item() == pytest.approx(entropy.item(), rel=1e-5)
    hard = train.loss_fn(model, None, at_target, batch, weights, distill=0.0)
    assert hard.item() == pytest.approx(-np.log(5 / 8), rel=1e-5)


def test_training_pipeline_with_a_draft_vocabulary(tmp_path):
    """generate pack -> features -> train (resumed) -> export with a reduced vocabulary:
    the draft tokens are the continuations' most frequent ones, kept across a resume,
    and the exported checkpoint loads with them."""
    import json

    from vllm_ddtree.drafter import data

    target_dir = tiny_models.make_target(tmp_path / "target", arch="qwen3", kind="random",
                                         seed=5)
    rng = np.random.default_rng(0)
    common = list(range(30, 38))  # every continuation token; prompts use others too
    rows = [{"id": i, "source": "sharegpt", "temperature": 0.0,
             "prompt_ids": rng.integers(20, 300, size=6).tolist(),
             "output_ids": rng.choice(common, size=20).tolist()} for i in range(12)]
    made = tmp_path / "made"
    made.mkdir()
    (made / data.GENERATIONS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    pack = tmp_path / "pack" / "generations.jsonl.gz"
    assert data.save_generations_pack(made, pack) == 12
    work = tmp_path / "work"
    assert data.restore_generations(work, pack) == 12
    assert data.restore_generations(work, pack) == 0  # nothing twice
    assert data._read_jsonl(work / data.GENERATIONS) == rows

    data.extract_features(work, target_dir, [0, 2])
    config = train.TrainConfig(
        target_layer_ids=[0, 2], num_layers=1, block_size=4,
        mask_token_id=tiny_models.MASK_TOKEN_ID, steps=2, seqs_per_step=2, anchors_per_seq=2,
        lr=1e-3, loss_decay=7.0, ckpt_every=1, eval_every=2, seed=0, warmup=1,
        val_every_nth_seq=4, autocast="none", draft_vocab_size=len(common))
    train.train(work, target_dir, config)
    config.steps = 3  # resumes from step 2's checkpoint
    train.train(work, target_dir, config)
    out = train.export_latest(work, target_dir, config, tmp_path / "export")
    model = DFlashDrafter.load(out)
    assert model.shape.draft_vocab_size == len(common)
    assert model.draft_token_ids.tolist() == common
    report = (out / "TRAINING.md").read_text()
    assert "covering 100.00% of the held-out continuation tokens" in report
    assert "Steps done: 3 of 3" in report


def test_learning_rate_schedules():
    """Cosine ends at min_lr_ratio * lr; WSD holds lr until its last decay_steps,
    then falls linearly to the same floor, so extending ``steps`` on resume only
    moves the decay."""
    base = dict(target_layer_ids=[0], num_layers=1, block_size=4, mask_token_id=1,
                seqs_per_step=1, anchors_per_seq=1, lr=1e-3, loss_decay=7.0, ckpt_every=1,
                eval_every=1, seed=0, warmup=10, min_lr_ratio=0.1)
    cosine = train.TrainConfig(steps=100, **base)
    assert cosine.lr_at(0) == pytest.approx(1e-4)
    assert cosine.lr_at(55) == pytest.approx(0.55e-3, rel=1e-6)  # halfway
    assert cosine.lr_at(100) == pytest.approx(1e-4)
    wsd = train.TrainConfig(steps=100, lr_schedule="wsd", decay_steps=20, **base)
    assert wsd.lr_at(9) == pytest.approx(1e-3)
    assert wsd.lr_at(79) == pytest.approx(1e-3)
    assert wsd.lr_at(90) == pytest.approx(0.55e-3)
    assert wsd.lr_at(100) == pytest.approx(1e-4)
    longer = train.TrainConfig(steps=200, lr_schedule="wsd", decay_steps=20, **base)
    assert [longer.lr_at(s) for s in range(80)] == [wsd.lr_at(s) for s in range(80)]
    with pytest.raises(ValueError, match="lr_schedule"):
        train.TrainConfig(steps=100, lr_schedule="linear", **base)
    with pytest.raises(ValueError, match="decay_steps"):  # would never decay
        train.TrainConfig(steps=100, lr_schedule="wsd", **base)


def test_session_rounds_and_init_from_an_exported_drafter(tmp_path):
    """A session-sized campaign: disjoint feature rounds, and training that starts
    from an exported drafter (its weights and draft vocabulary), refused when its
    shape differs from the training config."""
    import json

    from vllm_ddtree.drafter import data

    rows = [{"id": i, "prompt_ids": [1], "output_ids": [2] * 8} for i in range(10)]
    rounds = [[r["id"] for r in data.round_subset(rows[::-1], 3, k, seed=0)]
              for k in range(4)]
    assert len(set(sum(rounds[:3], []))) == 9  # three disjoint blocks of 3
    assert rounds[3] == rounds[0]  # then around again
    assert rounds[0] != sorted(rounds[0]) or rounds[1] != sorted(rounds[1])  # shuffled

    target_dir = tiny_models.make_target(tmp_path / "target", arch="qwen3", kind="random",
                                         seed=5)
    rng = np.random.default_rng(1)
    gens = [{"id": i, "source": "sharegpt", "temperature": 0.0,
             "prompt_ids": rng.integers(20, 300, size=6).tolist(),
             "output_ids": rng.integers(30, 60, size=20).tolist()} for i in range(12)]
    work = tmp_path / "work"
    work.mkdir()
    (work / data.GENERATIONS).write_text("".join(json.dumps(r) + "\n" for r in gens))
    index = data.extract_features(work, target_dir, [0, 2], max_sequences=5, data_round=1)
    assert sorted(index.ids) == sorted(r["id"] for r in data.round_subset(gens, 5, 1, 0))
    with pytest.raises(ValueError, match="another --max-sequences"):
        data.extract_features(work, target_dir, [0, 2], max_sequences=5, data_round=0)

    init = random_drafter(target_dir, seed=7, draft_vocab_size=16)
    init.export(tmp_path / "init", dtype=torch.float32)
    config = train.TrainConfig(
        target_layer_ids=[0, 2], num_layers=2, block_size=BLOCK_SIZE,
        mask_token_id=tiny_models.MASK_TOKEN_ID, steps=1, seqs_per_step=2, anchors_per_seq=2,
        lr=1e-3, loss_decay=7.0, ckpt_every=1, eval_every=1, seed=0, warmup=1,
        val_every_nth_seq=4, autocast="none", draft_vocab_size=16,
        init_from=str(tmp_path / "init"))
    train.train(work, target_dir, config)
    # One AdamW step from the start moves each weight by about lr at most, and
    # the optimizer saw the gradients of the model it trains (a replaced model
    # object would train nothing: grad_norm 0, weights unchanged).
    state = torch.load(work / train.CKPT_DIR / "step_1.pt", weights_only=False)["model"]
    moved = 0
    for name, value in init.state_dict().items():
        if name == "draft_token_ids":
            assert torch.equal(state[name], value)
            continue
        assert (state[name] - value).abs().max() <= 1.1e-3 + 1e-5 * value.abs().max(), name
        moved += int(not torch.equal(state[name], value))
    assert moved >= len(init.state_dict()) // 2
    log = [json.loads(line) for line in (work / train.LOG).read_text().splitlines()]
    assert log[-1]["grad_norm"] > 0

    config.num_layers = 1
    with pytest.raises(ValueError, match="num_layers: 2 \\(training config: 1\\)"):
        train.load_init(tmp_path / "init", config,
                        transformers.AutoConfig.from_pretrained(target_dir))
