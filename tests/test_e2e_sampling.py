# SPDX-License-Identifier: Apache-2.0
"""ddtree inside vLLM 0.32 on CPU honours each request's SamplingParams, or refuses it.

Tiny models (vllm_ddtree.tiny_models), engine in-process, at most one LLM alive.

* sharp oracle pair at T = 0.8: the target repeats its last token with probability
  above 1 - 1e-9 (checked from its weights), so ddtree's output must be that token;
  vLLM's own chain sampler on CPU fails this kind of test (environment-cpu.md);
* "two-way" oracle pair: lm_head = a E + b E[perm], so after token x the target
  puts most of its mass on x and on perm^-1(x) (a spread, context-dependent law),
  and the oracle drafter (sharing lm_head) drafts that same law at every depth: the
  tree branches and accepts drafts at T = 1. On it:
  - the joint law of the first two tokens (T = 1, top_k, top_p) matches
    non-speculative sampling (two-sample TV bound below);
  - min_p, min_tokens (EOS is likely after EOS_PARTNER), logit_bias,
    allowed_token_ids, logprobs and prompt_logprobs match non-speculative vLLM;
  - seeded requests reproduce exactly across engines, batches, budgets (fixed
    and auto), chunking;
  - the same joint law under the auto budget;
  - each refused parameter is a ValueError naming it, and the engine carries on.
* the two-way pair with random o_proj / down_proj: the target's law depends on
  the whole context through attention, so tree masks, positions, the KV commit
  and per-node penalty histories show at T = 1 (joint law of 3 tokens vs
  non-speculative vLLM, with a repetition penalty).
"""

import gc
import math
import random

import pytest
import torch

from _law_utils import joint_tv, tv_bound
from vllm_ddtree import tiny_models

vllm = pytest.importorskip("vllm")

BLOCK_SIZE = 5  # L = 4 drafted positions
BUDGET = 8
EOS = tiny_models.EOS_TOKEN_ID
EOS_PARTNER = 200  # after this token the two-way target emits EOS with p ~ 0.3
DIST_LAST = 67  # last prompt token of the distribution test: two likely successors
N_DIST = 4000
LONG_PROMPT = 600  # > the small engine's max_num_batched_tokens: chunked prefill


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


def _two_way_target(path, oracle_noise=0.0):
    """tiny_models.make_two_way_target with perm[EOS] = EOS_PARTNER."""
    return tiny_models.make_two_way_target(path, partner=(EOS, EOS_PARTNER),
                                           oracle_noise=oracle_noise)


@pytest.fixture(scope="module")
def models(tmp_path_factory, vllm_patched):
    root = tmp_path_factory.mktemp("sampling_models")
    sharp = tiny_models.make_target(root / "sharp_target", kind="oracle", seed=1)
    sharp_drafter = tiny_models.make_dflash_drafter(
        root / "sharp_drafter", sharp, kind="oracle", block_size=BLOCK_SIZE, seed=2)
    target, head, emb = _two_way_target(root / "two_way_target")
    drafter = tiny_models.make_dflash_drafter(
        root / "two_way_drafter", target, kind="oracle", block_size=BLOCK_SIZE, seed=2)
    attention, _, _ = _two_way_target(root / "attention_target", oracle_noise=1.0)
    attention_drafter = tiny_models.make_dflash_drafter(
        root / "attention_drafter", attention, kind="oracle", block_size=BLOCK_SIZE, seed=2)
    return {"sharp": (str(sharp), str(sharp_drafter)), "two_way": (target, drafter),
            "attention": (attention, attention_drafter), "head": head, "emb": emb}


def next_token_probs(models, last: int, temperature: float = 1.0) -> torch.Tensor:
    """The two-way target's exact next-token law (it depends on the last token only:
    o_proj = down_proj = 0, unit-RMS embeddings, final norm weight 1)."""
    emb, head = models["emb"], models["head"]
    return torch.softmax(head.double() @ emb[last].double() / temperature, dim=-1)


def make_llm(target, speculative_config=None, **kw):
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("seed", 0)
    return vllm.LLM(model=target, dtype="float32", enforce_eager=True,
                    disable_log_stats=False, speculative_config=speculative_config, **kw)


def ddtree(drafter, budget=BUDGET, **kw):
    # "fixed" unless asked: the statistics need trees verified every step.
    return {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget,
            "ddtree_budget": "fixed", **kw}


def spec_counts(llm) -> dict:
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return {"drafts": metrics.get("vllm:spec_decode_num_drafts", 0) or 0,
            "accepted": metrics.get("vllm:spec_decode_num_accepted_tokens", 0) or 0}


def run(llm, prompts, params):
    """Token ids of each request (params: one SamplingParams or one per prompt)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def prompts_ending_in(lasts, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(250) for _ in range(rng.randrange(2, 12))] + [t] for t in lasts]


SP = vllm.SamplingParams

# --------------------------------------------------------------------------- #
# Workloads shared by the non-speculative reference and ddtree
# --------------------------------------------------------------------------- #

DIST_PROMPT = [12, 34, DIST_LAST]
# The attention-dependent target at T = 1 with top_k = 2 and a repetition penalty:
# the joint law of 3 tokens has at most 8 cells. A short prompt, so one wrongly
# visible tree token takes a large share of attention.
ATTENTION_PARAMS = dict(temperature=1.0, top_k=2, repetition_penalty=1.3, max_tokens=3,
                        ignore_eos=True)
N_ATTENTION = 20000
DIST_PARAMS = dict(temperature=1.0, top_k=3, top_p=0.9, max_tokens=3, ignore_eos=True)
GREEDY_PROMPTS = prompts_ending_in([65, 67, 120, 31], seed=3)
CONSTRAINED = {  # name -> SamplingParams kwargs, greedy, compared with no-spec vLLM
    "logit_bias": dict(logit_bias={120: 6.0, 67: -2.0, 5: 3.0}),
    "allowed_token_ids": dict(allowed_token_ids=[5, 120, 121, 122, 200, EOS]),
    "logprobs": dict(logprobs=3, prompt_logprobs=2),
    # History edits: each node's history is the output + the drafts on its path.
    "plain": dict(),
    "presence_penalty": dict(presence_penalty=1.5),
    "frequency_penalty": dict(frequency_penalty=0.7),
    "repetition_penalty": dict(repetition_penalty=1.5),
    "penalties_and_bias": dict(repetition_penalty=1.3, frequency_penalty=0.3,
                               logit_bias={120: 1.0}),
    "bad_words": None,  # 3 greedy tokens of the first prompt (set by `reference`)
}
HISTORY_EDITS = ["presence_penalty", "frequency_penalty", "repetition_penalty",
                 "penalties_and_bias", "bad_words"]


def constrained_params(name):
    return SP(temperature=0.0, max_tokens=10, **CONSTRAINED[name])


def seeded_workload():
    """Seeded T = 1 requests; the first has a prompt longer than the small engine's
    token budget (its prefill is chunked, with discarded sample rows)."""
    rng = random.Random(7)
    prompts = [[rng.randrange(250) for _ in range(LONG_PROMPT)],
               [1, 2, 3, DIST_LAST], [9, EOS_PARTNER], [50, 51, 120]]
    params = [SP(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=i != 2,
                 top_p=0.95 if i == 3 else 1.0, min_p=0.05 if i == 1 else 0.0)
              for i in range(len(prompts))]
    return prompts, params


def unseeded_filler(n, seed=1):
    rng = random.Random(seed)
    prompts = [[rng.randrange(250) for _ in range(rng.randrange(2, 30))] for _ in range(n)]
    return prompts, [SP(temperature=1.0, max_tokens=rng.randrange(4, 30), ignore_eos=True)
                     for _ in range(n)]


@pytest.fixture(scope="module")
def reference(models):
    """Everything from engines other than the shared ddtree engine, one at a time:
    non-speculative vLLM (the reference), then a second ddtree engine for seeds."""
    target, drafter = models["two_way"]
    # A three-token bad word on the greedy path of the first prompt (the target's
    # law depends on the last token only, so that path is known exactly): it bans
    # a token at a draft node whose own path completes the word's prefix, which
    # only that node's history (output + its ancestors) shows.
    from transformers import AutoTokenizer

    last = GREEDY_PROMPTS[0][-1]
    path = []
    for _ in range(3):
        last = int(next_token_probs(models, last).argmax())
        path.append(last)
    word = AutoTokenizer.from_pretrained(target).decode(path)
    CONSTRAINED["bad_words"] = dict(bad_words=[word])
    ref = {}
    llm = make_llm(target)
    ref["dist"] = run(llm, [DIST_PROMPT] * N_DIST, SP(**DIST_PARAMS))
    # Negative control for the bound: the same requests without top_k / top_p.
    ref["dist_untruncated"] = run(llm, [DIST_PROMPT] * N_DIST,
                                  SP(**{**DIST_PARAMS, "top_k": 0, "top_p": 1.0}))
    for name in CONSTRAINED:
        outs = llm.generate([{"prompt_token_ids": p} for p in GREEDY_PROMPTS],
                            constrained_params(name), use_tqdm=False)
        ref[name] = outs
    del llm  # before the next LLM: its teardown resets vLLM's global state
    gc.collect()
    # Another seed than the ddtree engines': independent random streams.
    llm = make_llm(models["attention"][0], max_num_batched_tokens=2048, seed=1)
    ref["attention"] = run(llm, [DIST_PROMPT] * N_ATTENTION, SP(**ATTENTION_PARAMS))
    ref["attention_no_penalty"] = run(llm, [DIST_PROMPT] * (N_ATTENTION // 4),
                                      SP(**{**ATTENTION_PARAMS, "repetition_penalty": 1.0}))
    del llm
    gc.collect()
    # ddtree on the attention target (here: at most one LLM alive at a time).
    attention_target, attention_drafter = models["attention"]
    llm = make_llm(attention_target, ddtree(attention_drafter), max_num_batched_tokens=2048)
    ref["attention_ddtree"] = run(llm, [DIST_PROMPT] * N_ATTENTION, SP(**ATTENTION_PARAMS))
    ref["attention_ddtree_stats"] = spec_counts(llm)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    ref["attention_ddtree_stats"]["branch_paths"] = int(runner.ddtree.num_branch_paths)
    del llm, runner
    gc.collect()
    # Second ddtree engine: smaller token budget (the long prompt is prefilled in
    # chunks), another node budget and the auto budget (other trees, chosen per
    # step from timings), seeded requests among others.
    llm = make_llm(target, ddtree(drafter, budget=3, ddtree_budget="auto"),
                   max_num_batched_tokens=256)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    # Tiny models: drafting rarely pays on timings alone, and the tests need
    # trees. Drafting is kept on; each tree is still trimmed to its best prefix.
    controller = runner.ddtree.budget
    controller.min_gain, controller.max_loss = -1.0, 1.0  # start at once, never stop
    # Trees cost their rows only (a tiny target's tree overhead would trim
    # every tree to nothing): the trims then follow the rows' costs.
    controller.tree_overhead_cost.update = lambda *args: None
    # Whether the controller trims depends on this machine's timings (on a busy
    # machine it kept whole trees); every other decision keeps one node fewer
    # than it chose (still a prefix of each tree), so trimmed trees are sampled
    # from whatever the timings. used[k]: request-steps verified with k nodes.
    choose, calls = controller.choose, [0]
    used = [0] * 4

    def trimming_choose(tree, *args, **kwargs):
        counts = choose(tree, *args, **kwargs)
        calls[0] += 1
        if calls[0] % 2:
            counts = (counts - 1).clamp(min=0)
        for k in counts.tolist():
            used[k] += 1
        return counts

    controller.choose = trimming_choose
    prompts, params = seeded_workload()
    fp, fparams = unseeded_filler(5, seed=9)
    outs = run(llm, fp + prompts, fparams + params)
    ref["seeded_small"] = outs[len(fp):]
    before = spec_counts(llm)
    ref["dist_auto"] = run(llm, [DIST_PROMPT] * N_DIST, SP(**DIST_PARAMS))
    after = spec_counts(llm)
    ref["dist_auto_accepted"] = after["accepted"] - before["accepted"]
    ref["dist_auto_chosen"] = used
    del runner, controller
    del llm  # before the next LLM: its teardown resets vLLM's global state
    gc.collect()
    return ref


@pytest.fixture(scope="module")
def engine(models, reference):
    target, drafter = models["two_way"]
    llm = make_llm(target, ddtree(drafter), max_num_batched_tokens=2048)
    yield llm
    del llm  # before the next LLM: its teardown resets vLLM's global state
    gc.collect()


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #


def test_near_deterministic_target_at_t08(models):
    """The sharp oracle target at T = 0.8 repeats its last token (p > 1 - 1e-9):
    ddtree must emit exactly that token, and accept nearly every draft."""
    from safetensors.torch import load_file

    target, drafter = models["sharp"]
    emb = load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"].double()
    prompts = prompts_ending_in([5, 65, 67, 120, 199, 31, 250, 100], seed=1)
    for p in prompts:
        probs = torch.softmax(emb @ emb[p[-1]] / 0.8, dim=-1)  # lm_head == embeddings
        assert 1.0 - probs[p[-1]].item() < 1e-9
    llm = make_llm(target, ddtree(drafter, budget=16))
    outs = run(llm, prompts, SP(temperature=0.8, max_tokens=24, ignore_eos=True))
    stats = spec_counts(llm)
    del llm  # before the next LLM: its teardown resets vLLM's global state
    gc.collect()
    for p, o in zip(prompts, outs):
        assert o == [p[-1]] * 24, (p[-1], o)
    assert stats["drafts"] > 0
    assert 1 + stats["accepted"] / stats["drafts"] >= 0.9 * BLOCK_SIZE, stats


def test_distribution_matches_non_speculative(models, reference, engine):
    """T = 1, top_k = 3, top_p = 0.9: the joint law of the first two tokens (and of
    the second and third), ddtree vs N_DIST plain vLLM requests: N_DIST unseeded
    requests (the rejection rule) and N_DIST / 2 seeded ones (seeds 0, 1, ...:
    counter coins, sample_walk). At most 9 cells (top_k = 3 per position)."""
    # The law is spread (not one-hot) and top_k/top_p matter: >= 20% of the
    # untruncated mass lies outside the top 3.
    probs = next_token_probs(models, DIST_LAST)
    top = probs.sort(descending=True).values
    assert top[1] > 0.2 and top[:3].sum() < 0.8, top[:4]
    ref = reference["dist"]
    # The bound has power: dropping top_k/top_p is caught.
    tv, _ = joint_tv(reference["dist_untruncated"], ref, slice(0, 2))
    bound = tv_bound(9, N_DIST, N_DIST)
    print(f"negative control (no top_k/top_p): TV={tv:.4f} bound={bound:.4f}")
    assert tv > 2 * bound
    for seeded, n in ((False, N_DIST), (True, N_DIST // 2)):
        before = spec_counts(engine)
        params = [SP(**DIST_PARAMS, seed=i if seeded else None) for i in range(n)]
        outs = run(engine, [DIST_PROMPT] * n, params)
        after = spec_counts(engine)
        accepted = after["accepted"] - before["accepted"]
        assert accepted > 0.1 * n, (before, after)  # the tree accepts at T = 1
        bound = tv_bound(9, n, N_DIST)
        for name, cut in (("tokens 1-2", slice(0, 2)), ("tokens 2-3", slice(1, 3))):
            tv, cells = joint_tv(outs, ref, cut)
            print(f"seeded={seeded} {name}: n={n} vs {N_DIST} cells={cells} TV={tv:.4f} "
                  f"bound={bound:.4f} accepted drafts={accepted}")
            assert cells <= 9
            assert tv <= bound, (seeded, name, tv, bound)


def test_distribution_under_the_auto_budget(reference):
    """The joint law of the first two tokens (T = 1, top_k = 3, top_p = 0.9)
    under ``ddtree_budget="auto"`` (budget 3, trees trimmed per step from this
    machine's timings, and every other step one node shorter still) vs N_DIST
    plain vLLM requests."""
    outs, ref = reference["dist_auto"], reference["dist"]
    accepted = reference["dist_auto_accepted"]
    assert accepted > 0.1 * N_DIST, accepted  # the auto budget drafts here
    chosen = reference["dist_auto_chosen"]  # request-steps verified with 0..3 nodes
    assert chosen[3] > 0 and sum(chosen[1:3]) > 0.1 * sum(chosen), chosen  # trimmed
    bound = tv_bound(9, N_DIST, N_DIST)
    tv, cells = joint_tv(outs, ref, slice(0, 2))
    print(f"auto: n={N_DIST} cells={cells} TV={tv:.4f} bound={bound:.4f} "
          f"accepted drafts={accepted}")
    assert cells <= 9
    assert tv <= bound, (tv, bound)


def test_distribution_with_attention_and_a_penalty(reference):
    """T = 1, top_k = 2, repetition_penalty = 1.3, on a target whose law depends
    on the context through attention (o_proj, down_proj != 0): the joint law of
    the first three tokens, ddtree vs N_ATTENTION plain vLLM requests (8 cells).
    Here a tree row that sees a sibling (mask), a wrong position or a rejected
    token's K/V, or a penalty that reads the wrong history, changes the law:
    mutation-checked: sibling rows left to the causal kernel, TV 0.078; node
    histories without the path tokens, TV 0.098; the bound is 0.040 at
    delta = 1e-6 and the correct code gives TV 0.011."""
    ref = reference["attention"]
    # The bound has power against a penalty ignored everywhere.
    no_penalty = reference["attention_no_penalty"]
    tv, _ = joint_tv(no_penalty, ref, slice(0, 3))
    assert tv > 2 * tv_bound(8, len(no_penalty), N_ATTENTION), tv
    outs = reference["attention_ddtree"]  # made in `reference`: one LLM at a time
    stats = reference["attention_ddtree_stats"]
    branch_paths = stats["branch_paths"]
    # The tree accepts most drafts, and often along a sibling (non-spine) path.
    assert stats["accepted"] > 0.5 * N_ATTENTION, stats
    assert branch_paths > 0.05 * N_ATTENTION, branch_paths
    tv, cells = joint_tv(outs, ref, slice(0, 3))
    bound = tv_bound(8, N_ATTENTION, N_ATTENTION)
    print(f"attention target: n={N_ATTENTION} cells={cells} TV={tv:.4f} bound={bound:.4f} "
          f"accepted={stats['accepted']} branch paths={branch_paths}")
    assert cells <= 8
    assert tv <= bound, (tv, bound)


def test_min_p_keeps_only_the_top_token(models, engine):
    """T = 1 with min_p above the second-best ratio is greedy: the two-way target
    repeats its last token. Without min_p the same requests are not greedy."""
    lasts = [65, 67, 120, 31, 5]
    ratios = []
    for t in lasts:
        top = next_token_probs(models, t).sort(descending=True)
        assert int(top.indices[0]) == t
        ratios.append((top.values[1] / top.values[0]).item())
    min_p = 0.99
    assert max(ratios) < min_p, ratios
    prompts = prompts_ending_in(lasts, seed=5) * 4
    outs = run(engine, prompts, SP(temperature=1.0, min_p=min_p, max_tokens=12,
                                   ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o == [p[-1]] * 12, (p[-1], o)
    control = run(engine, prompts, SP(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert any(o != [p[-1]] * 12 for p, o in zip(prompts, control))


def test_min_tokens_masks_eos_at_every_depth(engine):
    """After EOS_PARTNER the target draws EOS with p ~ 0.3 and the drafter drafts it
    at every depth: no EOS may come before min_tokens output tokens."""
    prompts = [[3, 4, EOS_PARTNER]] * 150
    early = run(engine, prompts, SP(temperature=1.0, max_tokens=10))
    assert sum(1 for o in early if EOS in o[:4]) > 20  # EOS is likely early
    before = spec_counts(engine)["accepted"]
    outs = run(engine, prompts, SP(temperature=1.0, max_tokens=10, min_tokens=4))
    assert spec_counts(engine)["accepted"] > before
    assert all(EOS not in o[:4] for o in outs), [o for o in outs if EOS in o[:4]]
    assert any(EOS in o[4:] for o in outs)  # EOS still ends requests after that
    # Greedy: the prompt ends in EOS, whose repeat is the greedy next token.
    greedy = run(engine, [[7, EOS]], SP(temperature=0.0, max_tokens=6, min_tokens=3))
    assert greedy[0][:3].count(EOS) == 0 and len(greedy[0]) >= 3, greedy


@pytest.mark.parametrize("name", list(CONSTRAINED))
def test_constrained_greedy_matches_non_speculative(reference, engine, name):
    outs = engine.generate([{"prompt_token_ids": p} for p in GREEDY_PROMPTS],
                           constrained_params(name), use_tqdm=False)
    for got, want in zip(outs, reference[name]):
        g, w = got.outputs[0], want.outputs[0]
        assert list(g.token_ids) == list(w.token_ids)
        if name != "logprobs":
            continue
        assert len(g.logprobs) == len(w.logprobs) == len(g.token_ids)
        for tok, lg, lw in zip(g.token_ids, g.logprobs, w.logprobs):
            assert lg.keys() == lw.keys() and tok in lg
            for t in lg:
                assert lg[t].rank == lw[t].rank
                assert math.isclose(lg[t].logprob, lw[t].logprob, abs_tol=1e-4)
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs)
        for pg, pw in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert pg.keys() == pw.keys()
            for t in pg:
                assert math.isclose(pg[t].logprob, pw[t].logprob, abs_tol=1e-4)


def test_seeded_requests_reproduce(reference, engine):
    """The same seeded requests: alone, shuffled among unseeded ones, and in another
    engine (the auto budget up to 3 nodes instead of 8 fixed, token budget 256 so
    the long prompt is prefilled in chunks): identical tokens."""
    prompts, params = seeded_workload()
    alone = run(engine, prompts, params)
    assert any(len(set(o)) > 2 for o in alone)  # genuinely random output
    fp, fparams = unseeded_filler(7)
    mixed_prompts = fp + prompts
    mixed_params = fparams + params
    order = list(range(len(mixed_prompts)))
    random.Random(3).shuffle(order)
    mixed = run(engine, [mixed_prompts[i] for i in order], [mixed_params[i] for i in order])
    back = {i: o for i, o in zip(order, mixed)}
    assert [back[len(fp) + k] for k in range(len(prompts))] == alone
    assert reference["seeded_small"] == alone
    # Another seed gives another output.
    other = run(engine, prompts[1:2], [SP(temperature=1.0, seed=999, max_tokens=24,
                                          ignore_eos=True, min_p=0.05)])
    assert other[0] != alone[1]


@pytest.mark.parametrize("name", HISTORY_EDITS)
def test_history_edits_change_the_output(reference, name):
    """Each penalty / bad word changes the greedy output (so the equality test
    above can see a wrong history)."""
    changed = [list(a.outputs[0].token_ids) != list(b.outputs[0].token_ids)
               for a, b in zip(reference[name], reference["plain"])]
    assert any(changed), name


def test_penalties_in_a_mixed_batch(reference, engine):
    """Penalised, biased and plain greedy requests in one batch: each one as alone."""
    names = ["plain", "presence_penalty", "repetition_penalty", "bad_words",
             "penalties_and_bias", "logit_bias"]
    prompts = [GREEDY_PROMPTS[i % len(GREEDY_PROMPTS)] for i in range(len(names))]
    params = [constrained_params(n) for n in names]
    outs = run(engine, prompts, params)
    for i, name in enumerate(names):
        want = reference[name][i % len(GREEDY_PROMPTS)].outputs[0].token_ids
        assert outs[i] == list(want), name


# Structured outputs are honoured (xgrammar); their refusal for other grammar
# backends is tested in test_structured_outputs.py.
REFUSED = {
    "logprob_token_ids": dict(logprobs=2, logprob_token_ids=[5, 6]),
    "thinking_token_budget": dict(thinking_token_budget=8),
}


def refused_kwargs(name: str) -> dict:
    return REFUSED[name]


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_parameter_is_a_request_error(engine, name):
    kwargs = refused_kwargs(name)
    ok = {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(ValueError, match=rf"ddtree.*{name}"):
        engine.generate([ok, ok], [SP(max_tokens=4), SP(max_tokens=4, **kwargs)],
                        use_tqdm=False)
    out = run(engine, [[1, 2, 3]], SP(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0]) == 4


@pytest.mark.parametrize("name", list(REFUSED))
def test_prebuilt_request_with_refused_parameter_is_refused(engine, name):
    """An EngineCoreRequest built past the request-time check (the refused
    parameter set after process_inputs) is refused where it enters: by
    LLMEngine.add_request, and by the engine core itself; nothing is left
    pending and the engine carries on (issue 12.5; the multiprocess engine's
    FinishReason.ERROR answer is in test_multiprocess.py)."""
    llm_engine = engine.llm_engine
    for n, add in enumerate(("llm_engine", "engine_core")):
        request = llm_engine.input_processor.process_inputs(
            f"prebuilt-{name}-{n}", {"prompt_token_ids": [1, 2, 3]}, SP(max_tokens=4),
            supported_tasks=llm_engine.get_supported_tasks())
        for key, value in refused_kwargs(name).items():
            setattr(request.sampling_params, key, value)
        with pytest.raises(ValueError, match=rf"ddtree.*{name}"):
            if add == "llm_engine":
                llm_engine.add_request(request.request_id, request, request.sampling_params)
            else:
                llm_engine.engine_core.add_request(request)
        assert not llm_engine.has_unfinished_requests(), add
        assert request.request_id not in llm_engine.engine_core.engine_core.scheduler.requests
    out = run(engine, [[1, 2, 3]], SP(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0]) == 4


def test_counter_uniforms_are_uniform_and_keyed():
    """The seeded coins: a pure function of (seed, counter), uniform on [0, 1),
    uncorrelated across counters and across adjacent seeds (no vLLM needed)."""
    import numpy as np

    from vllm_ddtree.vllm_adapter.runner import counter_uniforms

    seeds = [0, 1, 2, -5, 2**70 + 3]
    counters = np.arange(50_000)[None, :].repeat(len(seeds), axis=0)
    u = counter_uniforms(seeds, counters)
    assert u.dtype == np.float32 and u.shape == counters.shape
    assert (u >= 0).all() and (u < 1).all()
    assert np.array_equal(u[:, 7:9], counter_uniforms(seeds, counters[:, 7:9]))
    hist = np.histogram(u.ravel(), bins=20, range=(0, 1))[0]
    expected = u.size / 20
    assert np.abs(hist - expected).max() < 6 * math.sqrt(expected)  # ~6 sigma
    for a, b in ((0, 1), (1, 2), (0, 3)):
        assert abs(np.corrcoef(u[a], u[b])[0, 1]) < 0.03  # 50k draws: sd ~0.0045
    assert abs(np.corrcoef(u[0, :-1], u[0, 1:])[0, 1]) < 0.03
