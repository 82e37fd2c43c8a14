# SPDX-License-Identifier: Apache-2.0
"""Statistical losslessness of tree sampling on a branching tree.

A synthetic target assigns logits to every prefix. One DDTree (V=5, L=3, B=14,
several branching nodes) is verified for N = 100,000 independent requests at once.
Compared with the exact ancestral distribution of the (processed) target:

* the joint law of the first two emitted tokens (25 cells; when a round emits one
  token, the second comes from an exact draw of the next round's distribution);
* the law of the number of tokens a round emits (L + 1 = 4 cells).

Bound. For n draws from a k-cell law p, E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n)
(Jensen on each |p_hat_i - p_i|), and TV changes by at most 1/n per draw, so by
McDiarmid P(TV > E[TV] + t) <= exp(-2 n t^2). With t = sqrt(ln(1e6) / (2n)) a
correct sampler fails with probability < 1e-6 per check (about 0.03 for the joint
at n = 1e5). A sampler that reuses one coin along a path (negative control) is
rejected by the same check.
"""

import math

import pytest
import torch

from vllm_ddtree.sampling import TreeSamplingParams, apply_sampling_params
from vllm_ddtree.tree import build_ddtree
from vllm_ddtree.verify import verify_tree

N = 100_000
VOCAB, DEPTH, BUDGET = 5, 3, 14
DELTA = 1e-6

PARAM_SETS = {
    "temperature": dict(temperature=1.0),
    "top_k": dict(temperature=0.8, top_k=3),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.3, min_p=0.15),
    "all": dict(temperature=0.9, top_k=4, top_p=0.85, min_p=0.05),
}


def target_logits_of(prefix: tuple[int, ...], draft: torch.Tensor) -> torch.Tensor:
    """Synthetic target: leans on the draft's marginal, plus prefix-specific noise."""
    seed = 1 + sum((t + 1) * 7**k for k, t in enumerate(prefix))
    noise = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))
    d = len(prefix)
    lean = draft[d] if d < DEPTH else torch.zeros(VOCAB)
    return 1.2 * lean + noise


def target_dist(prefix, draft, params: dict) -> torch.Tensor:
    p = TreeSamplingParams.from_lists(
        [params["temperature"]], [params.get("top_k", -1)], [params.get("top_p", 1.0)],
        [params.get("min_p", 0.0)],
    )
    z = apply_sampling_params(target_logits_of(prefix, draft).unsqueeze(0), p)
    return torch.softmax(z.double(), dim=-1)[0]


@pytest.fixture(scope="module")
def setup():
    draft = torch.randn(DEPTH, VOCAB, generator=torch.Generator().manual_seed(0)) * 0.7
    tree = build_ddtree(draft.unsqueeze(0).expand(N, DEPTH, VOCAB), BUDGET, validate=False)
    prefixes = []
    for i in range(tree.num_rows):
        path, node = [], i
        while node > 0:
            path.append(int(tree.tokens[0, node]))
            node = int(tree.parents[0, node])
        prefixes.append(tuple(reversed(path)))
    # Non-vacuous: the tree branches at the root and below it.
    kids = torch.bincount(tree.parents[0, 1:], minlength=tree.num_rows)
    assert kids[0] >= 2 and (kids[1:] >= 2).any()
    assert int(tree.num_nodes[0]) == BUDGET
    target = torch.stack([target_logits_of(p, draft) for p in prefixes])
    return draft, tree, prefixes, target.unsqueeze(0).expand(N, -1, -1)


def exact_laws(draft, tree, prefixes, params):
    first = target_dist((), draft, params)
    joint = torch.stack([first[a] * target_dist((a,), draft, params) for a in range(VOCAB)])
    # P(at least d drafts accepted) = sum over depth-d nodes of their path prob.
    path_prob = {(): 1.0}
    at_least = [1.0] + [0.0] * DEPTH
    for p in sorted(prefixes[1:], key=len):
        path_prob[p] = path_prob[p[:-1]] * float(target_dist(p[:-1], draft, params)[p[-1]])
        at_least[len(p)] += path_prob[p]
    length = torch.tensor([at_least[d] - (at_least[d + 1] if d < DEPTH else 0.0)
                           for d in range(DEPTH + 1)], dtype=torch.float64)
    return joint.flatten(), length


def tv_bound(p: torch.Tensor, n: int) -> float:
    expected = 0.5 * torch.sqrt(p * (1 - p) / n).sum().item()
    return expected + math.sqrt(math.log(1 / DELTA) / (2 * n))


def empirical_laws(out, draft, params, seed):
    y1 = out.committed_tokens[:, 0]
    y2 = out.committed_tokens[:, 1].clone()
    g = torch.Generator().manual_seed(seed)
    one = out.num_accepted == 0  # the round emitted only y1: draw y2 from the next round
    for a in range(VOCAB):
        rows = (one & (y1 == a)).nonzero().flatten()
        if len(rows):
            y2[rows] = torch.multinomial(target_dist((a,), draft, params).float(), len(rows),
                                         replacement=True, generator=g)
    joint = torch.bincount(y1 * VOCAB + y2, minlength=VOCAB * VOCAB).double() / N
    length = torch.bincount(out.num_accepted, minlength=DEPTH + 1).double() / N
    return joint, length


def run(tree, target, params, method, coins):
    p = TreeSamplingParams.from_lists(
        [params["temperature"]] * N, [params.get("top_k", -1)] * N,
        [params.get("top_p", 1.0)] * N, [params.get("min_p", 0.0)] * N,
    )
    return verify_tree(tree, target, p, method=method, coins=coins, validate=False)


@pytest.mark.parametrize("method", ["sample_walk", "rejection"])
@pytest.mark.parametrize("name", sorted(PARAM_SETS))
def test_emitted_tokens_follow_target(setup, method, name):
    draft, tree, prefixes, target = setup
    params = PARAM_SETS[name]
    g = torch.Generator().manual_seed(1234)
    coins = (torch.rand(N, tree.num_rows, generator=g), torch.rand(N, generator=g))
    out = run(tree, target, params, method, coins)
    joint, length = exact_laws(draft, tree, prefixes, params)
    emp_joint, emp_length = empirical_laws(out, draft, params, seed=99)
    tv_joint = 0.5 * (emp_joint - joint).abs().sum().item()
    tv_length = 0.5 * (emp_length - length).abs().sum().item()
    assert tv_joint <= tv_bound(joint, N), (tv_joint, tv_bound(joint, N))
    assert tv_length <= tv_bound(length, N), (tv_length, tv_bound(length, N))
    # Tokens outside the filtered support are never emitted.
    assert (emp_joint[joint == 0] == 0).all()
    # Non-vacuous: deep acceptance happens.
    assert emp_length[2:].sum() > 0.05


def test_negative_control_shared_coin_is_detected(setup):
    """Reusing one coin along the path (coins keyed by step, not by node) is biased."""
    draft, tree, prefixes, target = setup
    params = PARAM_SETS["temperature"]
    u = torch.rand(N, 1, generator=torch.Generator().manual_seed(5))
    coins = (u.expand(N, tree.num_rows).contiguous(), u[:, 0].clone())
    out = run(tree, target, params, "sample_walk", coins)
    joint, _ = exact_laws(draft, tree, prefixes, params)
    emp_joint, _ = empirical_laws(out, draft, params, seed=99)
    tv_joint = 0.5 * (emp_joint - joint).abs().sum().item()
    assert tv_joint > 3 * tv_bound(joint, N)
