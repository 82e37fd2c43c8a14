# SPDX-License-Identifier: Apache-2.0
"""Tree verification: which draft path the target accepts, one output contract.

The target ran once over every tree row (ancestor-only attention), so row ``i``
of ``target_logits`` is the target's next-token logits after the path root..i.
A request's walk starts at the root and, at each node, decides the next token:

* greedy (temperature < 1e-5): ``argmax`` of the raw logits;
* ``"sample_walk"``: one target sample per visited node (inverse CDF with that
  node's coin); descend if a child carries it, else it is the bonus token. This
  is the DDTree reference's rule (paper Sec. 4.1), lossless because every emitted
  token is an exact draw from the target given its ancestors;
* ``"rejection"``: target-only tree rejection sampling (the EAGLE/SGLang
  kernel's rule, SpecInfer https://arxiv.org/abs/2305.09781 with one-hot drafts):
  the node's coin is compared with the running CDF of its children's target
  probabilities in draft-rank order; if no child is accepted the bonus is drawn
  from the target with those children removed, using the request's final coin.

Both sampling rules emit exactly the target's ancestral distribution (proof in
docs: tree-sampling-kernels.md Sec. 4) and accept a child with probability equal
to the children's total target mass, the best any lossless verifier can do.

Canonical arithmetic, shared by every backend: ``z = logits / T`` (after the
request's min-p/top-k/top-p), ``e = exp(z - max z)`` in float32, prefix sums and
totals in float64. Inverse CDF picks the first token whose inclusive prefix sum
is ``> u * total`` (strict: a zero-mass token is never emitted), falling back to
the last token with ``e > 0`` if rounding leaves none.

Output contract (:class:`TreeVerifyOutput`), the seam to the commit step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from vllm_ddtree.sampling import (
    TreeSamplingParams,
    apply_sampling_params,
    draw_coins,
)
from vllm_ddtree.tree import DraftTree

__all__ = [
    "VerifyMethod",
    "TreeVerifyOutput",
    "verify_tree",
    "verify_tree_torch",
]

VerifyMethod = Literal["sample_walk", "rejection"]
METHOD_IDS = {"sample_walk": 0, "rejection": 1}


@dataclass
class TreeVerifyOutput:
    """What the target accepted, per request (padded to the tree's max depth + 1)."""

    # [R, L + 1] int64. Local node indices of the accepted path, root (0) first,
    # -1 padded. Entry j is the node at depth j.
    accepted_indices: torch.Tensor
    # [R, L + 1] int64. Accepted draft tokens, then exactly one bonus/correction
    # token, -1 padded: num_accepted + 1 valid entries.
    committed_tokens: torch.Tensor
    # [R] int64. Accepted draft nodes (root and bonus excluded).
    num_accepted: torch.Tensor


def _check_inputs(
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: TreeSamplingParams,
    method: str,
    threshold_single: float,
    threshold_acc: float,
    coins: tuple[torch.Tensor, torch.Tensor] | None,
    validate_values: bool,
    row_index: torch.Tensor | None = None,
) -> None:
    expected = (tree.num_reqs, tree.num_rows)
    dims = 3 if row_index is None else 2
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != dims:
        shape = (
            tuple(target_logits.shape)
            if isinstance(target_logits, torch.Tensor)
            else None
        )
        want = "[num_reqs, N + 1, vocab_size]" if dims == 3 else "[num_logits, vocab]"
        raise ValueError(f"target_logits must have shape {want}, got {shape}")
    if not target_logits.is_floating_point():
        raise ValueError(
            f"target_logits must be floating point, got {target_logits.dtype}"
        )
    if row_index is None and tuple(target_logits.shape[:2]) != expected:
        raise ValueError(
            f"target_logits has shape {tuple(target_logits.shape)}, expected "
            f"[{expected[0]}, {expected[1]}, vocab_size] to match the tree"
        )
    if row_index is not None and (
        tuple(row_index.shape) != expected
        or row_index.dtype != torch.int64
        or row_index.device != target_logits.device
    ):
        raise ValueError(
            f"row_index must be an int64 tensor of shape [{expected[0]}, "
            f"{expected[1]}] on {target_logits.device}, got {row_index.dtype} "
            f"{tuple(row_index.shape)} on {row_index.device}"
        )
    if target_logits.device != tree.tokens.device:
        raise ValueError(
            f"target_logits is on {target_logits.device} but the tree is on "
            f"{tree.tokens.device}"
        )
    if method not in METHOD_IDS:
        raise ValueError(f"method must be one of {sorted(METHOD_IDS)}, got {method!r}")
    for name, value in (
        ("threshold_single", threshold_single),
        ("threshold_acc", threshold_acc),
    ):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{name} must be in (0, 1], got {value}")
    if coins is not None:
        node_coins, final_coins = coins
        if node_coins.shape != expected or final_coins.shape != expected[:1]:
            raise ValueError(
                f"coins must be ([{expected[0]}, {expected[1]}], [{expected[0]}]), got "
                f"({tuple(node_coins.shape)}, {tuple(final_coins.shape)})"
            )
    params.validate(tree.num_reqs, target_logits.device, check_values=validate_values)
    if validate_values and row_index is not None:
        if bool(((row_index < 0) | (row_index >= target_logits.shape[0])).any()):
            raise ValueError(
                f"row_index has entries outside [0, {target_logits.shape[0]})"
            )
        target_logits = target_logits[row_index]
    if validate_values:  # synchronizes with the device
        if torch.isnan(target_logits).any() or torch.isposinf(target_logits).any():
            raise ValueError("target_logits contains NaN or +inf values")
        if torch.isneginf(target_logits).all(dim=-1).any():
            raise ValueError("target_logits has a row where every value is -inf")
        if coins is not None and not bool(
            ((coins[0] >= 0) & (coins[0] < 1)).all()
            & ((coins[1] >= 0) & (coins[1] < 1)).all()
        ):
            raise ValueError("coins must lie in [0, 1)")


def verify_tree(
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: TreeSamplingParams | None = None,
    *,
    method: VerifyMethod = "rejection",
    coins: tuple[torch.Tensor, torch.Tensor] | None = None,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    backend: str = "auto",
    validate: bool = True,
    row_index: torch.Tensor | None = None,
    max_tree_depth: int | None = None,
) -> TreeVerifyOutput:
    """Verifies a batch of draft trees against the target's logits.

    Args:
        tree: the draft trees (R requests, N + 1 rows each).
        target_logits: [R, N + 1, V] target logits; row i follows the path to node
            i. With ``row_index``: [M, V], any rows (e.g. the target's logits for
            the whole batch, read in place).
        params: per-request sampling parameters; ``None`` means all greedy. A batch
            may mix greedy and sampled requests with different parameters.
        method: ``"sample_walk"`` or ``"rejection"`` for sampled requests.
        coins: ``(node_coins [R, N + 1], final_coins [R])`` uniforms in [0, 1);
            drawn with :func:`draw_coins` (honouring seeded generators) if omitted.
        threshold_single, threshold_acc: EAGLE-style relaxations of the rejection
            rule; 1.0 (the default) is exact. Lower values are lossy.
        backend: ``"auto"`` (CUDA extension > Triton > torch), or one of them.
        validate: check values (NaN/inf, coin range) too; synchronizes the device.
        row_index: [R, N + 1] int64: tree row i of request b is
            ``target_logits[row_index[b, i]]``. Every backend reads only the rows
            on each walk, in place (with min-p/top-k/top-p, the kernels read a
            processed float32 copy of the tree rows instead).
        max_tree_depth: the deepest tree the caller will ever verify (an
            engine's: its node budget); the Triton kernel then runs one compiled
            variant for every step instead of one per path-length tile.

    Returns:
        The :class:`TreeVerifyOutput`.
    """
    if max_tree_depth is not None and tree.max_depth > max_tree_depth:
        raise ValueError(
            f"a tree of depth {tree.max_depth} is deeper than max_tree_depth "
            f"{max_tree_depth}"
        )
    if params is None:
        params = TreeSamplingParams.greedy(tree.num_reqs, target_logits.device)
    _check_inputs(
        tree,
        target_logits,
        params,
        method,
        threshold_single,
        threshold_acc,
        coins,
        validate,
        row_index,
    )
    if coins is None:
        coins = draw_coins(
            tree.num_reqs, tree.num_rows, target_logits.device, params.generators
        )
    from vllm_ddtree.ops import tree_verify_dispatch

    return tree_verify_dispatch(
        tree,
        target_logits,
        params,
        method,
        coins,
        threshold_single,
        threshold_acc,
        backend,
        row_index,
        max_tree_depth,
    )


def _inverse_cdf(e: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """[M, V] float32 weights, [M] coins -> [M] first index with prefix > u * total."""
    cdf = e.double().cumsum(dim=-1)
    target = coins.double() * cdf[:, -1]
    pick = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    vocab = e.shape[-1]
    last_valid = (vocab - 1) - torch.argmax((e > 0).flip(-1).to(torch.int8), dim=-1)
    return torch.where(pick >= vocab, last_valid, pick)


def verify_tree_torch(
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: TreeSamplingParams,
    method: VerifyMethod,
    coins: tuple[torch.Tensor, torch.Tensor],
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    row_index: torch.Tensor | None = None,
) -> TreeVerifyOutput:
    """Torch reference: vectorized over requests, one step per depth.

    Only the rows on each request's walk are processed (L + 1 rows instead of
    N + 1), so no [R, N + 1, V] temporary is made; this is also the test oracle of
    the Triton and CUDA kernels. ``row_index``: see :func:`verify_tree`.
    """
    num_reqs, rows = tree.num_reqs, tree.num_rows
    vocab = target_logits.shape[-1]
    device = target_logits.device
    node_coins, final_coins = coins
    width = tree.max_depth + 1
    req = torch.arange(num_reqs, device=device)
    node_idx = torch.arange(rows, device=device).unsqueeze(0)
    greedy = params.is_greedy
    rejection = method == "rejection"

    accepted = torch.full((num_reqs, width), -1, dtype=torch.int64, device=device)
    accepted[:, 0] = 0
    cur = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    active = torch.ones(num_reqs, dtype=torch.bool, device=device)
    is_cpu = device.type == "cpu"

    # Greedy batches: one argmax over every logits row, read in place (as
    # vLLM's greedy sampler does), so the walk below reads token ids only
    # instead of gathering an [R, V] row per depth.
    row_argmax = None
    if params.all_greedy:
        row_argmax = target_logits.argmax(dim=-1)  # [R, N + 1] or [M]
        if row_index is not None:
            row_argmax = row_argmax[row_index]  # [R, N + 1]

    def step_distribution(node: torch.Tensor):
        if row_argmax is not None:
            return None, None
        if row_index is None:
            raw = target_logits[req, node].float()  # [R, V]
        else:
            raw = target_logits[row_index[req, node]].float()
        if params.all_greedy:
            return raw, None
        z = apply_sampling_params(raw.clone(), params)
        m = z.amax(dim=-1, keepdim=True)
        e = torch.exp(z - m)  # float32; removed tokens -> 0
        return raw, e

    for depth in range(1, width):
        raw, e = step_distribution(cur)
        children = (tree.parents == cur.unsqueeze(1)) & active.unsqueeze(1)  # [R, rows]
        # Greedy rows and sample_walk: the node's token, then a child carrying it.
        token = raw.argmax(dim=-1) if row_argmax is None else row_argmax[req, cur]
        if e is not None:
            token = torch.where(greedy, token, _inverse_cdf(e, node_coins[req, cur]))
        match = children & (tree.tokens == token.unsqueeze(1))
        if rejection and e is not None:
            # Running CDF of the children's target mass in draft-rank (index) order.
            # Tokens outside [0, V) (e.g. -1 placeholders) have no target mass.
            in_vocab = (tree.tokens >= 0) & (tree.tokens < vocab)
            e_tok = e.gather(1, tree.tokens.clamp(0, vocab - 1))
            e_child = torch.where(children & in_vocab, e_tok, 0.0).double()
            # The same float64 total as the inverse CDF's (its last prefix sum).
            total = e.double().cumsum(dim=-1)[:, -1:]
            acc = e_child.cumsum(dim=1)
            coin = node_coins[req, cur].double().unsqueeze(1)
            take = (e_child > 0) & (
                (coin * total * threshold_acc < acc)
                | (e_child >= threshold_single * total)
            )
            match = torch.where(greedy.unsqueeze(1), match, children & take)
        child = torch.where(match, node_idx, rows).amin(dim=1)
        advance = child < rows
        accepted[:, depth] = torch.where(advance, child, -1)
        cur = torch.where(advance, child, cur)
        active = advance
        if is_cpu and not bool(active.any()):  # CPU only
            break

    num_accepted = (accepted[:, 1:] >= 0).sum(dim=1)
    # The bonus / correction token at the last accepted node.
    raw, e = step_distribution(cur)
    if e is None:
        sampled = None
    elif rejection:
        rejected = tree.parents == cur.unsqueeze(1)  # every child was rejected
        # Count, not assign: several rows may carry one token (root, padding).
        drop = torch.zeros(e.shape, dtype=torch.int32, device=device)
        in_vocab = (tree.tokens >= 0) & (tree.tokens < vocab)
        drop.scatter_add_(
            1, tree.tokens.clamp(0, vocab - 1), (rejected & in_vocab).to(torch.int32)
        )
        e_res = torch.where(drop > 0, 0.0, e)
        sampled = _inverse_cdf(e_res, final_coins)
        # All mass on rejected children can only come from float rounding.
        sampled = torch.where(
            e_res.sum(dim=-1) > 0, sampled, _inverse_cdf(e, final_coins)
        )
    else:
        sampled = _inverse_cdf(e, node_coins[req, cur])
    bonus = raw.argmax(dim=-1) if row_argmax is None else row_argmax[req, cur]
    if sampled is not None:
        bonus = torch.where(greedy, bonus, sampled)

    path_tokens = tree.tokens.gather(1, accepted[:, 1:].clamp(min=0))
    committed = torch.full((num_reqs, width), -1, dtype=torch.int64, device=device)
    committed[:, :-1] = torch.where(accepted[:, 1:] >= 0, path_tokens, -1)
    committed.scatter_(1, num_accepted.unsqueeze(1), bonus.unsqueeze(1))
    return TreeVerifyOutput(accepted, committed, num_accepted)
