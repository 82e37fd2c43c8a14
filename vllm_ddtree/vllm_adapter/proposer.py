# SPDX-License-Identifier: Apache-2.0
"""DDTree proposer: one DFlash drafter pass, then the draft tree of every request.

``DFlashProposer`` drafts the whole block in one pass and keeps only the argmax
per position. ``DDTreeProposer`` keeps the per-position logits of that pass and
builds the DDTree of each request on device
(:func:`vllm_ddtree.tree.build_ddtree`, no host sync), rooted at the
request's bonus token. The scheduler receives the
tree's B node tokens in node order (parents first, best first), so any prefix it
keeps is itself a valid tree; the structure stays in the worker
(:attr:`last_tree`).
"""

from __future__ import annotations

import copy
import functools
import time

import torch
from vllm.logger import init_logger
from vllm.utils import torch_utils
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.tree import DraftTree, build_ddtree, draft_top_k
from vllm_ddtree.vllm_adapter import attn_context, drafter_weights
from vllm_ddtree.vllm_adapter.config import DDTreeConfig, get_ddtree_config

__all__ = ["DDTreeProposer"]

logger = init_logger(__name__)


class DDTreeProposer(DFlashProposer):
    """DFlash drafting + DDTree construction (https://arxiv.org/abs/2604.12989)."""

    def __init__(self, vllm_config, device: torch.device, runner=None):
        ddtree = get_ddtree_config(vllm_config)
        assert ddtree is not None, "DDTreeProposer needs method='ddtree'"
        # Drafted positions per request: the tree's maximum depth.
        draft_len = min(ddtree.draft_len, ddtree.budget)
        # DFlash sizes its query buffers and warm-up for num_speculative_tokens
        # positions per request; the drafter runs L = draft_len of them, while
        # num_speculative_tokens is the node budget B (the target's rows).
        super().__init__(_with_draft_positions(vllm_config, draft_len), device, runner)
        self.vllm_config = vllm_config
        self.speculative_config = vllm_config.speculative_config
        self.ddtree: DDTreeConfig = ddtree
        self.draft_len = draft_len
        self._draft_logits: torch.Tensor | None = None
        self.last_tree: DraftTree | None = None
        # Batch rows of structured requests (set by the verifier before each
        # pass), and their drafter candidates from the last pass:
        # (rows, log-probs [Rc, depth, K], target token ids [Rc, depth, K]).
        self.candidate_rows: list[int] = []
        self.last_candidates: tuple[list[int], torch.Tensor, torch.Tensor] | None = None
        # Candidates per depth for a grammar-built tree (at least twice the node
        # budget): the grammar may rule out the drafter's first choices, and a
        # node's distribution is renormalised over the allowed candidates.
        self.grammar_top_k = max(2 * ddtree.budget, 64)
        # >>> lookup
        # Batch rows with a lookup draft this pass (set by the verifier), and
        # their drafter candidates (rows, log-probs [Rl, depth, K], target ids),
        # K as the drafter's own tree: the union tree is built on the host.
        self.lookup_rows: list[int] = []
        self.last_lookup_candidates: (
            tuple[list[int], torch.Tensor, torch.Tensor] | None
        ) = None
        # <<< lookup
        # Positions drafted this pass (<= draft_len).
        self.draft_depth = self.draft_len
        # >>> auto budget
        # The auto budget lowers draft_depth while its trees stay shallow. The
        # block is then shorter (bonus + depth mask queries), so the drafter's
        # forward and its LM head shrink with it; measured at batch 1 (SmolLM2
        # pair): trees of 4 nodes from a 4-position block accept as many tokens
        # as from the 15-position one, 4.6% faster.
        # False: the next pass only queues the drafter's context K/V, with no
        # drafter forward, and drafts nothing (set by the auto budget).
        self.draft_this_step = True
        # Context K/V of steps without drafts, not yet written: (target hidden
        # states [n, 3H], positions [n], slots [n], committed rows [n] bool) per
        # step, written in one batch before the next drafter forward (or when
        # max_deferred_rows).
        self._deferred: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._deferred_rows = 0
        self.max_deferred_rows = 4096
        # Host seconds spent in flush_context since the runner last reset it: the
        # auto budget leaves them out of its pass-cost samples (a flush writes rows
        # earlier steps queued; drafting or not, they are written).
        self.flush_seconds = 0.0
        # <<< auto budget

    def load_model(self, target_model, *args, **kwargs) -> None:
        # Every target attention layer is checked now, at engine start: a layer
        # the tree attention cannot serve must never reach a verify forward.
        attn_context.check_model_tree_attention(target_model)
        from vllm_ddtree.vllm_adapter import gdn_state

        # Recurrent (GDN) layers of a hybrid target, put on the tree path.
        self.num_recurrent_layers = gdn_state.install(target_model)
        if self.ddtree.drafter_quantization != "int8":
            super().load_model(target_model, *args, **kwargs)
            return
        # Drafts only steer speed: the drafter's GEMMs may round differently
        # from its checkpoint's dtype (drafter_weights.py).
        with drafter_weights.int8_linears_while_loading() as swapped:
            super().load_model(target_model, *args, **kwargs)
        logger.info(
            "ddtree: the drafter's %d linear layers (LM head included) run in "
            "int8 (ddtree_drafter_quantization='int8')",
            len(swapped),
        )

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        # hidden_states: [R * depth, H], the mask positions, request-major.
        self._draft_logits = self._compute_draft_logits(hidden_states)
        # The chain the base class expects (unused: the trees are built in propose).
        return torch.zeros(
            hidden_states.shape[0], dtype=torch.int64, device=hidden_states.device
        ), None

    def _compute_draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, V'] draft logits: over the target vocabulary, or over the drafter's
        own (``draft_vocab_size`` + ``d2t``, as EAGLE-3) when it has one.

        vLLM's ``compute_logits`` scatters a reduced vocabulary's logits into the
        target's (-inf elsewhere); the tree is the same either way (a -inf token
        is never in it), so it is built over the Vd draft tokens, without the
        [n, V] scatter and with top-k over Vd, and its tokens are mapped to
        target ids (:meth:`_to_target_ids`).
        """
        if self._draft_to_target is None:
            return self.model.compute_logits(hidden_states)  # [n, V]
        return self.model.logits_processor(self.model.lm_head, hidden_states)

    @functools.cached_property
    def _draft_to_target(self) -> torch.Tensor | None:
        """[Vd] target id of each draft id, or None (no reduced vocabulary).
        Read on the first draft, after the drafter's weights are loaded."""
        d2t = getattr(self.model, "draft_id_to_target_id", None)
        if d2t is None:
            return None
        return torch.arange(d2t.shape[0], device=d2t.device) + d2t

    def _to_target_ids(self, tree: DraftTree) -> DraftTree:
        """The tree's node tokens as target ids (the root, a target id already,
        and padding rows, parent -1 and token 0, kept as they are)."""
        if self._draft_to_target is None:
            return tree
        nodes = tree.tokens[:, 1:]  # [R, N] draft ids (padding: 0)
        mapped = self._draft_to_target[nodes]
        tree.tokens = torch.cat(
            [tree.tokens[:, :1], torch.where(tree.parents[:, 1:] >= 0, mapped, nodes)],
            dim=1,
        )
        return tree

    def propose(self, num_speculative_tokens: int, **kwargs) -> torch.Tensor:
        """Returns [R, B] draft node tokens (tree rows 1..B; padding rows are 0)."""
        next_token_ids = kwargs["next_token_ids"]
        self._draft_logits = None
        self.last_tree = None
        self.last_candidates = None
        # >>> lookup
        self.last_lookup_candidates = None
        # <<< lookup
        # >>> auto budget
        # A step without drafts never gets here: DDTreeVerifier.skip_drafter
        # queues its context K/V (defer_context) and returns no drafts.
        assert self.draft_this_step, "context-only steps are handled by the verifier"
        self.flush_context()
        # <<< auto budget
        super().propose(num_speculative_tokens=self.draft_depth, **kwargs)
        logits = self._draft_logits
        assert logits is not None, "the DFlash pass produced no draft logits"
        num_reqs = next_token_ids.shape[0]
        logits = logits.view(num_reqs, self.draft_depth, -1)
        self.last_tree = self._to_target_ids(self._build_tree(logits, next_token_ids))
        # Structured requests' rows: the scheduler builds their trees with
        # their grammars.
        self.last_candidates = self._candidates(
            logits, self.candidate_rows, self.grammar_top_k
        )
        # >>> lookup
        # Lookup rows: the verifier builds their union trees.
        self.last_lookup_candidates = self._candidates(
            logits, self.lookup_rows, self.ddtree.max_children or self.ddtree.budget
        )
        # <<< lookup
        self._draft_logits = None
        return self.last_tree.tokens[:, 1:]

    def _candidates(self, draft_logits: torch.Tensor, rows: list[int], k: int):
        """The drafter's top-``k`` log-probs and target ids per depth of batch
        rows ``rows`` (``[Rc, depth, k]`` each), or None without rows."""
        rows = [b for b in rows if b < draft_logits.shape[0]]
        if not rows:
            return None
        index = torch_utils.async_tensor_h2d(
            rows, dtype=torch.int64, device=draft_logits.device
        )
        selected = draft_logits.index_select(0, index)  # [Rc, depth, V']
        log_probs, token_ids = draft_top_k(selected, min(k, selected.shape[-1]))
        if self._draft_to_target is not None:
            token_ids = self._draft_to_target[token_ids]
        return rows, log_probs, token_ids

    def _build_tree(
        self, draft_logits: torch.Tensor, root_token_ids: torch.Tensor
    ) -> DraftTree:
        """The DDTree of every request from its ``[R, depth, V']`` draft logits,
        rooted at its bonus token (``root_token_ids`` [R]); no host sync."""
        return build_ddtree(
            draft_logits,
            self.ddtree.budget,
            root_token_ids=root_token_ids,
            max_children=self.ddtree.max_children,
            validate=False,
        )

    # >>> auto budget
    def defer_context(
        self,
        target_hidden_states: torch.Tensor,
        target_positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        committed: torch.Tensor | None = None,
    ) -> None:
        """Queues the context K/V of a step without drafts for the next
        :meth:`flush_context`: no drafter forward this step.

        DFlash's context K/V is a projection of the target hidden states of the
        committed tokens, written at their own slots; the block queries' K/V is
        scratch (the next step's context overwrites the bonus token's slot). So
        writing the context keeps every later draft exactly what it would have
        been, and skips the drafter's forward (vLLM's K = 0 path runs it). The
        writes are replayed in order before the next drafter forward, so the
        cache reads the same as if each had been made at once (a slot freed and
        reused in between is written in the same order), at one projection per
        batch instead of one per step.

        After a verify step only the committed rows are written: each block's
        accepted path (moved first in its block), not its rejected tail, as
        vLLM's DFlash pass writes the context of a step with rejected drafts.

        Args:
            target_hidden_states: [n, 3H] the target's tapped hidden states.
            target_positions: [>= n] their positions (linear, not M-RoPE).
            slot_mapping: [>= n] their slots in the drafter's KV group.
            committed: [n] bool, the rows whose tokens were committed (a verify
                step's rejected tree rows are not); None: every row.
        """
        num_tokens = target_hidden_states.shape[0]
        # Copies: the runner reuses its hidden-state and slot buffers.
        self._deferred.append(
            (
                target_hidden_states.clone(),
                target_positions[:num_tokens].clone(),
                slot_mapping[:num_tokens].to(torch.int64, copy=True),
                torch.ones(num_tokens, dtype=torch.bool, device=slot_mapping.device)
                if committed is None
                else committed.clone(),
            )
        )
        self._deferred_rows += num_tokens
        if self._deferred_rows >= self.max_deferred_rows:
            self.flush_context()

    def flush_context(self) -> None:
        """Writes the deferred context K/V (oldest first, one batch)."""
        if not self._deferred:
            return
        started = time.perf_counter()
        hidden, positions, slots, committed = (
            torch.cat(x) for x in zip(*self._deferred, strict=True)
        )
        self._deferred.clear()
        self._deferred_rows = 0
        # One host sync per flush (the committed rows' count), none per step.
        rows = torch.nonzero(committed).squeeze(1)
        hidden, positions, slots = (
            hidden.index_select(0, rows),
            positions.index_select(0, rows),
            slots.index_select(0, rows),
        )
        self.model.precompute_and_store_context_kv(
            self.model.combine_hidden_states(hidden), positions, slots
        )
        self.flush_seconds += time.perf_counter() - started

    # <<< auto budget


def _with_draft_positions(vllm_config, num_positions: int):
    """A shallow copy of ``vllm_config`` whose speculative config (also a shallow
    copy) drafts ``num_positions`` tokens: what DFlash's buffers are sized for."""
    spec = vllm_config.speculative_config
    if spec.num_speculative_tokens == num_positions:
        return vllm_config
    spec = copy.copy(spec)
    object.__setattr__(spec, "num_speculative_tokens", num_positions)
    config = copy.copy(vllm_config)
    object.__setattr__(config, "speculative_config", spec)
    return config
