# SPDX-License-Identifier: Apache-2.0
"""The target distribution of each request, with vLLM 0.32's sampler semantics.

vLLM's ``Sampler`` (``vllm/v1/sample/sampler.py``) turns a row of float32 logits
into the distribution it samples from in this order:

1. greedy requests (temperature < 1e-5) take ``argmax`` of the raw logits;
2. temperature: ``logits / T`` (greedy rows of a mixed batch divide by 1);
3. min-p: drop tokens whose probability is below ``min_p * max_prob``;
4. top-k: drop logits strictly below the k-th largest (ties kept);
5. top-p: sort ascending, drop the prefix whose cumulative probability is
   ``<= 1 - top_p`` (the largest token always stays);
6. ``softmax``.

:func:`apply_sampling_params` applies steps 2-5 on any set of rows (4-5 through
vLLM's own ``apply_top_k_top_p``), so tree verification can process only the
rows its walk visits. Randomness is one uniform
coin per tree node plus one for the final (residual) draw, drawn by
:func:`draw_coins` from per-request ``torch.Generator`` s when a request is seeded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

try:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
except ImportError:  # kernel checks on a machine without vLLM (scripts/gpu_check.sh)
    apply_top_k_top_p = None

__all__ = [
    "SAMPLING_EPS",
    "TreeSamplingParams",
    "apply_sampling_params",
    "draw_coins",
]

# vLLM's _SAMPLING_EPS: temperatures below it are greedy.
SAMPLING_EPS = 1e-5


@dataclass
class TreeSamplingParams:
    """Per-request sampling parameters of a batch (vLLM ``SamplingParams`` fields).

    ``None`` for top_k / top_p / min_p means no request in the batch uses it.
    Build with :meth:`from_lists` to get validation with argument names.
    """

    # [R] float32. < SAMPLING_EPS means greedy.
    temperature: torch.Tensor
    # [R] int64 or None. <= 0 (vLLM's -1/0) or >= vocab size disables top-k.
    top_k: torch.Tensor | None = None
    # [R] float32 or None. 1.0 disables top-p.
    top_p: torch.Tensor | None = None
    # [R] float32 or None. 0.0 disables min-p.
    min_p: torch.Tensor | None = None
    # Request index -> generator for seeded requests.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Host-side hint (like vLLM's SamplingMetadata.all_greedy): every request is
    # greedy, so no distribution needs computing. False when unknown.
    all_greedy: bool = False

    @property
    def num_reqs(self) -> int:
        return self.temperature.shape[0]

    @property
    def is_greedy(self) -> torch.Tensor:
        """[R] bool."""
        return self.temperature < SAMPLING_EPS

    @classmethod
    def greedy(
        cls, num_reqs: int, device: torch.device | str = "cpu"
    ) -> TreeSamplingParams:
        return cls(temperature=torch.zeros(num_reqs, device=device), all_greedy=True)

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int] | None = None,
        top_p: Sequence[float] | None = None,
        min_p: Sequence[float] | None = None,
        seeds: Sequence[int | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> TreeSamplingParams:
        """Validates host-side values (no device sync) and builds the batch."""
        num_reqs = len(temperature)
        for name, values in (
            ("top_k", top_k),
            ("top_p", top_p),
            ("min_p", min_p),
            ("seeds", seeds),
        ):
            if values is not None and len(values) != num_reqs:
                raise ValueError(
                    f"{name} has {len(values)} entries but temperature has {num_reqs}"
                )
        _check_values(temperature, top_k, top_p, min_p)
        device = torch.device(device)
        generators: dict[int, torch.Generator] = {}
        for i, seed in enumerate(seeds or []):
            if seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(int(seed))
                generators[i] = gen
        top_k_used = top_k is not None and any(k > 0 for k in top_k)
        top_p_used = top_p is not None and any(p < 1.0 for p in top_p)
        min_p_used = min_p is not None and any(p > 0.0 for p in min_p)
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device)
            if top_k_used
            else None,
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device)
            if top_p_used
            else None,
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device)
            if min_p_used
            else None,
            generators=generators,
            all_greedy=all(t < SAMPLING_EPS for t in temperature),
        )

    def validate(
        self, num_reqs: int, device: torch.device, check_values: bool = True
    ) -> None:
        """Shape/device checks; value checks too if ``check_values`` (a device sync)."""
        for name in ("temperature", "top_k", "top_p", "min_p"):
            t = getattr(self, name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.shape != (num_reqs,):
                shape = (
                    tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                )
                raise ValueError(f"{name} must be a [{num_reqs}] tensor, got {shape}")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device}, expected {device}")
        if self.top_k is not None and self.top_k.dtype.is_floating_point:
            raise ValueError(f"top_k must be an integer tensor, got {self.top_k.dtype}")
        for i in self.generators:
            if not 0 <= i < num_reqs:
                raise ValueError(
                    f"generators has request index {i} outside [0, {num_reqs})"
                )
        if not check_values:
            return
        _check_values(
            self.temperature.tolist(),
            None if self.top_k is None else self.top_k.tolist(),
            None if self.top_p is None else self.top_p.tolist(),
            None if self.min_p is None else self.min_p.tolist(),
        )

    def select(self, rows: torch.Tensor) -> TreeSamplingParams:
        """Per-row parameters for rows owned by requests ``rows``.

        Generators are dropped.
        """
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return TreeSamplingParams(
            pick(self.temperature),
            pick(self.top_k),
            pick(self.top_p),
            pick(self.min_p),
            all_greedy=self.all_greedy,
        )


def _check_values(temperature, top_k, top_p, min_p) -> None:
    import math

    for i, t in enumerate(temperature):
        if not math.isfinite(t) or t < 0:
            raise ValueError(
                f"temperature must be finite and >= 0, got {t} (request {i})"
            )
    for i, k in enumerate(top_k or []):
        if k < -1:
            raise ValueError(
                "top_k must be -1 (disabled), 0 (disabled) or > 0, "
                f"got {k} (request {i})"
            )
    for i, p in enumerate(top_p or []):
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p} (request {i})")
    for i, p in enumerate(min_p or []):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {p} (request {i})")


def apply_sampling_params(
    logits: torch.Tensor, params: TreeSamplingParams
) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p on rows of logits, as vLLM 0.32 does.

    Args:
        logits: [M, V] float32 rows (modified in place and returned).
        params: [M] per-row parameters (e.g. ``params.select(row_to_request)``).

    Returns:
        [M, V] processed logits (``logits`` itself, or a new tensor when vLLM's
        top-k/top-p makes one); removed tokens are ``-inf``. Greedy rows are only
        divided by 1 (their sample is the argmax of the raw logits).
    """
    vocab = logits.shape[-1]
    temperature = torch.where(
        params.temperature < SAMPLING_EPS, 1.0, params.temperature
    )
    logits.div_(temperature.unsqueeze(1))

    if params.min_p is not None:
        probs = logits.softmax(dim=-1)
        max_prob = probs.amax(dim=-1, keepdim=True)
        logits.masked_fill_(probs < max_prob * params.min_p.unsqueeze(1), float("-inf"))

    top_k = params.top_k
    if top_k is not None:
        # vLLM's InputBatch turns disabled top-k (-1, 0) into the vocab size.
        top_k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    # vLLM's own top-k/top-p (what its rejection sampler uses): a pivot-search
    # Triton kernel on GPU (no full-vocabulary sort, no host sync), the sort /
    # topk reference on CPU.
    if apply_top_k_top_p is not None:
        return apply_top_k_top_p(logits, top_k, params.top_p)
    return _top_k_top_p_by_sort(logits, top_k, params.top_p)


def _top_k_top_p_by_sort(logits, top_k, top_p):
    """vLLM's CPU semantics without vLLM: top-k keeps logits >= the k-th
    largest (ties kept), then top-p drops the ascending prefix of cumulative
    probability <= 1 - p (the largest token stays)."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = logits_sort.gather(1, (vocab - top_k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    if top_p is not None:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        top_p_mask = probs_sum <= 1 - top_p.unsqueeze(1)
        top_p_mask[:, -1] = False  # at least one token stays
        logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)


def draw_coins(
    num_reqs: int,
    num_rows: int,
    device: torch.device | str,
    generators: dict[int, torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform [0, 1) coins: one per tree row and one for the final draw.

    Seeded requests draw their ``num_rows + 1`` coins from their own generator, so
    their output does not depend on the rest of the batch.

    Returns:
        (node_coins [R, num_rows] float32, final_coins [R] float32).
    """
    coins = torch.rand(num_reqs, num_rows + 1, device=device)
    for i, gen in (generators or {}).items():
        coins[i] = torch.rand(num_rows + 1, generator=gen, device=gen.device).to(device)
    return coins[:, :num_rows], coins[:, num_rows]
