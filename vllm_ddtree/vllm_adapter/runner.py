# SPDX-License-Identifier: Apache-2.0
"""The model runner's ddtree side: :class:`DDTreeVerifier`.

With ``method="ddtree"`` the V1 model runner owns a ``DDTreeVerifier``
(``runner.ddtree``) and a :class:`~vllm_ddtree.vllm_adapter.proposer.DDTreeProposer`
(``runner.drafter``), and calls the verifier where a ddtree step differs from a
DFlash chain step:

1. ``_prepare_inputs`` -> :meth:`DDTreeVerifier.prepare_tree_inputs`: vLLM lays
   out each request's ``[root] + drafts`` rows with linear positions and slots;
   the tree structure is re-attached to the scheduled drafts (:mod:`.step`), the
   RoPE positions of tree rows become ``root position + depth``, and the tree
   attention batch is described.
2. ``_build_attention_metadata`` -> :meth:`DDTreeVerifier.attach_tree_metadata`:
   the target's tree-aware builders give the step's attention metadata its trees,
   so the verify forward attends ancestor-only inside each tree.
3. ``_sample`` -> :meth:`DDTreeVerifier.sample`: tree verification
   (:func:`vllm_ddtree.verify.verify_tree`) instead of the chain
   rejection sampler; its committed tokens have the chain sampler's ``[R, W]``
   ``-1``-padded shape, so vLLM's bookkeeping and scheduler work unchanged (the
   scheduler rolls back ``drafts - accepted`` tokens). The accepted path's K/V is
   then moved to contiguous slots (:mod:`vllm_ddtree.commit`).
4. ``propose_draft_token_ids`` -> :meth:`DDTreeVerifier.before_propose` /
   :meth:`DDTreeVerifier.after_propose`: linear positions are restored and the
   accepted path's hidden states are moved first in each block, so the DFlash
   drafter sees exactly the committed sequence as context; the new trees wait
   for ``take_draft_token_ids``.

Besides: ``initialize_kv_cache`` lets Triton compile every kernel variant a
verify step launches before the first request (:meth:`~DDTreeVerifier.kv_cache_ready`),
``_update_states`` forgets trees not sent
(:meth:`~DDTreeVerifier.drop_requests`), ``_input_fits_in_drafter`` sizes the
drafter's query as a block (:meth:`~DDTreeVerifier.input_fits_in_drafter`) and
``take_draft_token_ids`` sends the trees' structure (and structured requests'
drafter candidates) with the drafts to the scheduler, which sends back the
structure of what it scheduled (:meth:`~DDTreeVerifier.attach_draft_trees`,
:mod:`.draft_trees`).

The auto budget (``ddtree_budget="auto"``, :mod:`.budget_control`) adds: the
step timing of ``execute_model`` / ``sample_tokens``
(:meth:`~DDTreeVerifier.step_started`, :meth:`~DDTreeVerifier.step_finished`),
the step-cost profile after the KV cache exists
(:meth:`~DDTreeVerifier._profile_step_costs`) and the drafter skipping of
``propose_draft_token_ids`` (:meth:`~DDTreeVerifier.skip_drafter`).

In vLLM with ddtree in-tree each of these is an explicit ``if self.ddtree is not
None:`` branch of ``GPUModelRunner``; the plugin makes the same calls from a
runner subclass (:mod:`vllm_ddtree.vllm_adapter.plugin_runner`).
"""

from __future__ import annotations

import dataclasses
import time

import torch
from vllm.logger import init_logger
from vllm.utils import torch_utils
from vllm.v1.outputs import SamplerOutput

from vllm_ddtree.commit import CommitPlan, plan_commit
from vllm_ddtree.sampling import SAMPLING_EPS, TreeSamplingParams
from vllm_ddtree.verify import verify_tree
from vllm_ddtree.vllm_adapter import attn_context
from vllm_ddtree.vllm_adapter.config import DDTreeConfig, get_ddtree_config
from vllm_ddtree.vllm_adapter.draft_trees import ProposedTrees, chain_parents
# >>> lookup
from vllm_ddtree.vllm_adapter.lookup_step import BatchLookup
# <<< lookup
from vllm_ddtree.vllm_adapter.step import StepTrees, build_step_trees
from vllm_ddtree.vllm_adapter.structured_output import GrammarCandidates

__all__ = ["DDTreeVerifier"]


logger = init_logger(__name__)
# >>> auto budget
_BUDGET_LOG_INTERVAL_S = 10.0  # vLLM's default stats log interval
# <<< auto budget


class DDTreeVerifier:
    """Tree verify inputs, tree sampling and KV commit of a V1 model runner's
    steps, and the DFlash drafter's inputs from the committed path
    (https://arxiv.org/abs/2604.12989).

    Args:
        runner: the ``GPUModelRunner`` (or ``CPUModelRunner``) whose drafter is a
            ``DDTreeProposer``.
    """

    def __init__(self, runner) -> None:
        ddtree = get_ddtree_config(runner.vllm_config)
        assert ddtree is not None, "DDTreeVerifier needs method='ddtree'"
        from vllm.platforms import current_platform

        # Before the target's attention layers resolve their backend (when the
        # model is loaded); the start-up checks admitted only these platforms.
        if current_platform.is_cpu():
            from vllm_ddtree.vllm_adapter.cpu_attention import (
                register_tree_attention_backend,
            )
            from vllm_ddtree.vllm_adapter.cpu_mla_attention import (
                register_mla_tree_attention_backend,
            )

            register_tree_attention_backend()
            register_mla_tree_attention_backend()
        elif current_platform.is_cuda():
            from vllm_ddtree.vllm_adapter.gpu_attention import (
                register_gpu_tree_attention_backend,
            )
            from vllm_ddtree.vllm_adapter.gpu_mla_attention import (
                register_gpu_mla_tree_attention_backend,
            )

            register_gpu_tree_attention_backend()
            register_gpu_mla_tree_attention_backend()
        self.runner = runner
        self.config: DDTreeConfig = ddtree
        # No verified path is longer than this (a drafter tree's depth is its
        # block's draft length, a lookup or grammar path's at most B nodes): the
        # verify kernel's path tile, fixed per engine (one compiled variant).
        self.max_tree_depth = max(ddtree.budget, ddtree.draft_len)
        # The last drafter pass's trees, until take_draft_token_ids sends them.
        self.proposed = ProposedTrees()
        # Requests whose scheduled drafts came without a tree (verified as a
        # chain): vLLM padded or replaced them.
        self.num_chain_fallbacks = 0
        # >>> lookup
        # Lookup drafts beside the drafter's (``ddtree_lookup``), or None.
        self.lookup: BatchLookup | None = _make_lookup(runner.vllm_config, ddtree)
        # Batch rows whose trees this pass are union trees.
        self._lookup_rows: list[int] = []
        # <<< lookup
        # >>> auto budget
        self.budget = None
        if ddtree.budget_mode == "auto":
            from vllm_ddtree.vllm_adapter.budget_control import BudgetController

            self.budget = BudgetController(
                runner.drafter.draft_len,
                ddtree.budget,
                runner.device,
                max_rows=runner.max_num_tokens,
                max_reqs=runner.max_num_reqs,
            )
            self.proposed.keep_path_probs = True
        self._budget_logged = time.monotonic()
        self._step_clock: tuple[float, int, int, int, int] | None = None
        self._drafter_seconds = 0.0
        self._propose_started = 0.0
        # req_id -> (path probabilities, depths) of the last grammar-built tree
        # the scheduler built (before its node price cut it): the auto budget
        # values the request's next tree by it.
        self._grammar_trees: dict[str, tuple[list[float], list[int]]] = {}
        # <<< auto budget
        # This step's state, from prepare_tree_inputs to after_propose.
        # Batch rows of structured requests (sample's scan of the batch).
        self._structured_rows: list[int] = []
        self._step: StepTrees | None = None
        self._linear_positions: torch.Tensor | None = None
        self._plan: CommitPlan | None = None
        self._attn: attn_context.TreeAttentionBatch | None = None
        # [max_reqs, B + 1, B + 1] bool: this step's ancestor masks (host side),
        # allocated once.
        rows = ddtree.budget + 1
        self._visibility = torch.zeros(
            runner.max_num_reqs, rows, rows, dtype=torch.bool
        )
        # Device-side counters (no sync): verify steps with a tree, and requests
        # whose accepted path left the chain (a sibling was accepted somewhere).
        self.num_tree_verifies = torch.zeros(
            (), dtype=torch.int64, device=runner.device
        )
        self.num_branch_paths = torch.zeros((), dtype=torch.int64, device=runner.device)
        # Host counter: verify blocks whose tree rows the attention recomputed
        # (chains and root-only blocks are the stock kernel's).
        self.num_attention_trees = 0

    # ------------------------------------------------------------------ #
    # Engine life
    # ------------------------------------------------------------------ #

    def kv_cache_ready(self) -> None:
        """After the KV cache exists, before serving (not in vLLM's profiling
        run): the GPU kernels' variants compiled, then (auto budget) the step
        cost profiled, its timings free of compile stalls."""
        self._warm_up_kernels()
        # >>> auto budget
        self._profile_step_costs()
        # <<< auto budget

    def _warm_up_kernels(self) -> int:
        """Compiles, on CUDA, every Triton kernel variant a verify step of this
        engine launches (tree attention per layer kind, the KV commit, the
        verify kernel): serving launches one variant each, its tiles fixed by
        the node budget, so no step stalls on a compile (1-2 s each: the auto
        budget would time it as the cost of drafting). Returns the launches
        made (0 off CUDA, where nothing is compiled at run time)."""
        runner = self.runner
        if runner.device.type != "cuda":
            return 0
        from vllm_ddtree.ops import resolve_backend
        from vllm_ddtree.vllm_adapter.gpu_attention import warm_up_tree_kernels

        ddtree = self.config
        context = runner.compilation_config.static_forward_context
        launches = warm_up_tree_kernels(context, ddtree.budget + 1)
        if resolve_backend(ddtree.kernel_backend, runner.device) == "triton":
            from vllm_ddtree.ops.triton_verify import warm_up_tree_verify

            launches += warm_up_tree_verify(
                runner.model_config.get_vocab_size(),
                (runner.model_config.dtype, torch.float32),
                self.max_tree_depth,
                ddtree.threshold_single,
                ddtree.threshold_acc,
                runner.device,
            )
        logger.info("ddtree: %d kernel variants compiled before serving", launches)
        return launches

    def _verify_peak_tensors(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """``(shape, dtype)`` of the largest tensors a verify step makes beyond
        what vLLM's profiling run samples (one row per request, a one-draft
        chain): the target's logits of every tree row (R (B + 1) rows, at most
        the step's tokens), their float32 copy (requests that filter or edit
        logits), and the drafter's logits for its positions of every request
        (float32 at most)."""
        runner = self.runner
        rows = min(runner.max_num_tokens, runner.max_num_reqs * (self.config.budget + 1))
        vocab = runner.model_config.get_vocab_size()
        d2t = getattr(getattr(runner.drafter, "model", None), "draft_id_to_target_id", None)
        draft_vocab = vocab if d2t is None else int(d2t.shape[0])
        draft_rows = runner.max_num_reqs * min(self.config.draft_len, self.config.budget)
        return [
            ((rows, vocab), runner.model_config.dtype),
            ((rows, vocab), torch.float32),
            ((draft_rows, draft_vocab), torch.float32),
        ]

    def profile_verify_memory(self) -> None:
        """Allocates, on CUDA, what :meth:`_verify_peak_tensors` lists, inside
        vLLM's profiling run (after its dummy sampler run): the profiled peak then
        counts a verify step's logits, and the KV cache is sized around them
        (~10 GB at ~126 requests with B = 64 on a 151,936-token vocabulary would
        otherwise be found at the first large batch, as an out-of-memory)."""
        runner = self.runner
        if runner.device.type != "cuda":
            return
        held = [
            torch.empty(shape, dtype=dtype, device=runner.device)
            for shape, dtype in self._verify_peak_tensors()
        ]
        del held

    # >>> auto budget
    def _profile_step_costs(self) -> None:
        """The auto budget's step-cost model, fitted on this machine (after the
        KV cache exists, before serving)."""
        if self.budget is not None:
            runner = self.runner
            if getattr(runner.drafter, "num_recurrent_layers", 0):
                self.budget.track_recurrent_state()
            else:
                self.budget.track_branch_rows()
            self.budget.profile(runner, min(runner.max_num_tokens, 512))

    # <<< auto budget
    def input_fits_in_drafter(self, common_attn_metadata) -> bool:
        """Whether the drafter's query fits under max_model_len this step.

        vLLM blanks every draft of the batch unless the longest sequence plus the
        drafter's query fits, and sizes that query as num_speculative_tokens + 1
        (a DFlash chain). The ddtree drafter queries its block, draft_len + 1
        rows, whatever the tree budget B: without this a budget B needed 2B + 2
        free positions instead of B + draft_len + 2.
        """
        if common_attn_metadata is None:
            return False
        return (
            common_attn_metadata.max_seq_len + self.config.draft_len + 1
            <= self.runner.effective_drafter_max_model_len
        )

    # ------------------------------------------------------------------ #
    # A step
    # ------------------------------------------------------------------ #

    # >>> auto budget
    def step_started(self, scheduler_output) -> None:
        """Start of ``execute_model``: the auto budget times the step from here."""
        if self.budget is not None:
            drafts = scheduler_output.scheduled_spec_decode_tokens.values()
            branch = 0
            if not self.budget.charge_all_nodes:
                trees = getattr(scheduler_output, "scheduled_draft_trees", None)
                branch = sum(
                    self.budget.branch_rows(t.parents) for t in (trees or {}).values()
                )
            self._step_clock = (
                time.perf_counter(),
                scheduler_output.total_num_scheduled_tokens,
                sum(1 for d in drafts if d),  # requests verifying drafts
                sum(len(d) for d in drafts),  # their draft nodes
                branch,  # the nodes off their trees' leading chains
            )
            self._drafter_seconds = 0.0

    def step_finished(self) -> None:
        """End of ``sample_tokens``: the step's host time, drafter excluded, is a
        sample of the auto budget's step-cost model."""
        clock = self._step_clock
        if self.budget is None or clock is None:
            return
        # Host time of the step: on CPU the work itself; the stash's
        # device->host copy of the trees has synchronized before this point.
        seconds = time.perf_counter() - clock[0] - self._drafter_seconds
        self.budget.record_step(clock[1], seconds, *clock[2:])
        self._step_clock = None
        now = time.monotonic()
        if now - self._budget_logged >= _BUDGET_LOG_INTERVAL_S:
            # Beside vLLM's own periodic stats lines (one host read per line).
            self._budget_logged = now
            logger.info(self.budget.stats_line())

    # <<< auto budget
    def drop_requests(self, scheduler_output) -> None:
        """Start of ``_update_states``: trees of an earlier pass that were not
        sent are forgotten (the worker keeps no tree across steps: what it
        verifies comes with the scheduler's output)."""
        self.proposed.clear()
        # >>> lookup
        if self.lookup is not None:
            self.lookup.forget(_finished_or_preempted(scheduler_output))
        # <<< lookup
        # >>> auto budget
        for req_id in _finished_or_preempted(scheduler_output):
            self._grammar_trees.pop(req_id, None)
        # <<< auto budget

    def prepare_tree_inputs(self, scheduler_output, spec_decode_metadata) -> None:
        """End of ``_prepare_inputs``: the trees of the scheduled drafts, their
        RoPE positions (root + depth) and the tree attention batch."""
        runner = self.runner
        self._step = None
        self._plan = None
        self._linear_positions = None
        self._structured_rows = []
        trees = getattr(scheduler_output, "scheduled_draft_trees", None) or {}
        # >>> auto budget
        if self.budget is not None:
            for req_id, tree in trees.items():
                if tree.grammar_values is not None:
                    self._grammar_trees[req_id] = tree.grammar_values
        # <<< auto budget
        if spec_decode_metadata is None:
            return
        num_reqs = runner.input_batch.num_reqs
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        total = scheduler_output.total_num_scheduled_tokens
        query_start = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        num_drafts = [len(scheduled.get(r, ())) for r in req_ids]
        if not any(num_drafts):
            # vLLM builds spec-decode metadata for every step; with no draft at
            # all this is a plain decode step (one row per request, no tree).
            return
        starts = [query_start[b + 1] - n - 1 for b, n in enumerate(num_drafts)]
        # Host facts, no device read: the step's input ids are gathered on the
        # host (ddtree runs without async scheduling), and a row's linear
        # position is its request's computed tokens + its offset in the query.
        roots = runner.input_ids.cpu[starts].tolist()
        computed = runner.input_batch.num_computed_tokens_cpu[:num_reqs]
        root_positions = [
            int(computed[b]) + starts[b] - query_start[b] for b in range(num_reqs)
        ]
        step = build_step_trees(
            req_ids,
            scheduled,
            query_start[1:],
            roots,
            trees,
            runner.positions.device,
        )
        self.num_chain_fallbacks += sum(
            1 for b, n in enumerate(num_drafts) if n and step.scheduled[b] is None
        )

        # RoPE positions of tree rows: root position + depth (slots stay linear);
        # rows and positions from the host tree, one pinned copy.
        linear = runner.positions[:total].clone()
        depths = step.host_tree.depths.numpy()
        rows = [starts[b] + i for b in range(num_reqs) for i in range(num_drafts[b] + 1)]
        values = [
            root_positions[b] + int(depths[b, i])
            for b in range(num_reqs)
            for i in range(num_drafts[b] + 1)
        ]
        update = torch_utils.async_tensor_h2d(
            [rows, values], device=linear.device, dtype=torch.int64
        )
        runner.positions[update[0]] = update[1].to(runner.positions.dtype)

        # Root-only blocks, and chains (every node the child of the one before:
        # the verify block of vLLM's own drafters, most lookup drafts), attend
        # exactly as the stock causal kernel computes them and commit in place:
        # only real trees are listed. A recurrent target's state follows every
        # block's tree (gdn_state), so there every block with drafts is listed.
        recurrent = bool(getattr(runner.drafter, "num_recurrent_layers", 0))
        tree_reqs = [
            b
            for b in range(num_reqs)
            if num_drafts[b] > 0
            and (recurrent or step.parents[b] != chain_parents(num_drafts[b]))
        ]
        self.num_attention_trees += len(tree_reqs)
        self._attn = attn_context.TreeAttentionBatch.from_tree(
            step.host_tree,
            tree_rows=tree_reqs,
            req_indices=tree_reqs,
            row_offsets=[starts[b] - query_start[b] for b in tree_reqs],
            num_rows=[num_drafts[b] + 1 for b in tree_reqs],
            prefix_lens=[root_positions[b] for b in tree_reqs],
            visibility_buffer=self._visibility,
            max_tree_rows=self.config.budget + 1,
        )
        self._step = step
        self._linear_positions = linear

    def attach_tree_metadata(self, attn_metadata) -> None:
        """End of ``_build_attention_metadata``: the target's tree-aware builders
        give this step's attention metadata its trees (``metadata.tree``), so the
        verify forward attends ancestor-only inside each tree. No-op in a step
        without trees and in dummy runs.

        Args:
            attn_metadata: layer name -> metadata, as the runner built it
                (replaced in place for the target's attention groups).
        """
        batch = self._attn if self._step is not None else None
        if batch is None or not batch.requests:
            return
        assert isinstance(attn_metadata, dict), "ddtree runs without micro-batching"
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

        for groups in self.runner.attn_groups:
            for group in groups:
                builder = group.get_metadata_builder()
                if isinstance(builder, GDNAttentionMetadataBuilder):
                    # Hybrid targets: the GDN layers follow the trees too
                    # (gdn_state).
                    names = [n for n in group.layer_names if n in attn_metadata]
                    if names:
                        metadata = attn_context.metadata_with_tree(
                            attn_metadata[names[0]], batch
                        )
                        for name in names:
                            attn_metadata[name] = metadata
                    continue
                if not isinstance(
                    builder, attn_context.TreeAttentionMetadataBuilderMixin
                ):
                    continue
                names = [n for n in group.layer_names if n in attn_metadata]
                if not names:
                    continue
                metadata = builder.with_tree(attn_metadata[names[0]], batch)
                for name in names:
                    attn_metadata[name] = metadata

    def sample(self, logits, spec_decode_metadata) -> SamplerOutput:
        """``_sample``: tree verification and the KV commit of the accepted paths
        (or, in a step without drafts, one row per request)."""
        runner = self.runner
        num_reqs = runner.input_batch.num_reqs
        extras = _scan_requests(runner, num_reqs)
        self._structured_rows = extras.structured_rows
        # Seeded requests draw their coins from (seed, output position), never from
        # vLLM's per-request torch generators (see _seeded_coins). Drop those, so
        # that _bookkeeping_sync's generator rewind for discarded rows (partial
        # prefill chunks) has nothing to rewind: it would raise on CPU generators
        # ("CPU Generator does not use offset") and move unused ones on GPU.
        if runner.input_batch.generators:
            runner.input_batch.generators.clear()
        step = self._step
        if step is None or spec_decode_metadata is None:
            # No drafts in this step: one row per request. vLLM's sampler is right
            # unless a request needs what it skips under speculative decoding
            # (min_p, logit_bias) or is seeded (our coins keep a seeded request's
            # output independent of its batch and of the step kind).
            if not extras.needs_own_sampler:
                return runner.sampler(
                    logits=logits,
                    sampling_metadata=runner.input_batch.sampling_metadata,
                )
            device = logits.device
            tree = _root_only_tree(num_reqs, device)
            rows = torch.arange(num_reqs, device=device).unsqueeze(1)
            out, logprobs = _verify_batch(
                self, tree, rows, logits, extras, None, width=1
            )
            return SamplerOutput(
                sampled_token_ids=out.committed_tokens[:, :1].to(torch.int32),
                logprobs_tensors=logprobs,
            )

        # logits: per request its n_r + 1 verify rows, request-major.
        out, logprobs = _verify_batch(
            self, step.tree, step.logit_rows, logits, extras, step
        )
        # >>> auto budget
        if self.budget is not None:
            _calibrate(self, step, out)
        # <<< auto budget
        total = int(self._linear_positions.shape[0])
        plan = plan_commit(out.accepted_indices, step.block_starts, total)
        if self._attn.requests:
            self._attn.commit_kv((plan.src_rows, plan.dst_rows), row_space="batch")
            self._attn.commit_recurrent(
                plan.src_rows.view(num_reqs, -1), plan.num_committed
            )
        self._attn.release()
        self._plan = plan
        self.num_tree_verifies += sum(1 for n in step.num_drafts if n)
        self.num_branch_paths += plan.moved().view(num_reqs, -1).any(dim=1).sum()
        return SamplerOutput(
            sampled_token_ids=out.committed_tokens.to(torch.int32),
            logprobs_tensors=logprobs,
        )

    def before_propose(
        self,
        aux_hidden_states: list[torch.Tensor] | None,
        # >>> lookup
        sampled_token_ids: torch.Tensor | None = None,
        # <<< lookup
    ) -> list[torch.Tensor] | None:
        """Start of ``propose_draft_token_ids``: the drafter's inputs from the
        committed path (linear positions restored), and this step's lookup
        trees after the tokens just committed (``sampled_token_ids``: [R, W],
        -1 padded).

        Returns:
            The target's aux hidden states with each accepted path moved first
            in its block.
        """
        runner = self.runner
        # Structured requests' rows, from this step's scan in sample().
        runner.drafter.candidate_rows = self._structured_rows
        # >>> lookup
        runner.drafter.lookup_rows = self._lookup_rows = []
        if self.lookup is not None and sampled_token_ids is not None:
            self._step_lookup(sampled_token_ids)
        # <<< lookup
        plan = self._plan
        if plan is not None:
            total = plan.hidden_perm.shape[0]
            # The drafter reads linear positions; depth positions would put rejected
            # siblings' draft K/V on the accepted path's slots.
            runner.positions[:total] = self._linear_positions
            if aux_hidden_states is not None:
                aux_hidden_states = [
                    _permute_rows(h, plan.hidden_perm) for h in aux_hidden_states
                ]
        return aux_hidden_states

    # >>> lookup
    def _step_lookup(self, sampled_token_ids: torch.Tensor) -> None:
        """The lookup's part of a step: what the target did with the verified
        lookup nodes, then this step's lookup trees (host work; one read of the
        committed tokens, which vLLM's bookkeeping reads next anyway)."""
        runner = self.runner
        num_reqs = runner.input_batch.num_reqs
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        discarded = runner.discard_request_mask.np[:num_reqs]
        sampled = sampled_token_ids[:num_reqs]
        if torch.is_tensor(sampled):  # [R, W] -1 padded; host lists otherwise
            sampled = sampled.tolist()
        committed = [
            [] if discarded[b] else [t for t in row if t >= 0]
            for b, row in enumerate(sampled)
        ]
        step = self._step
        if step is not None:
            self.lookup.observe(
                req_ids, step.parents, step.tokens, step.num_drafts, committed
            )
            # >>> auto budget
            if self.budget is not None:
                self.budget.observe_lookup_trees(*self.lookup.verified_trees)
            # <<< auto budget
        self.lookup.propose(runner.input_batch, committed)
        # Structured requests' trees are the scheduler's (their grammars).
        self._lookup_rows = self.lookup.rows(excluded=self._structured_rows)
        runner.drafter.lookup_rows = self._lookup_rows

    # <<< lookup
    # >>> auto budget
    def skip_drafter(
        self, scheduler_output, hidden_states, aux_hidden_states, common_attn_metadata
    ) -> torch.Tensor | None:
        """After :meth:`before_propose`: whether the auto budget drafts this
        step, and how deep.

        Returns:
            None to draft; else the (empty) drafts to return at once, the
            drafter's forward skipped and the step's context K/V queued.
        """
        budget = self.budget
        if budget is None:
            return None
        runner = self.runner
        drafter = runner.drafter
        plan = self._plan
        num_reqs = runner.input_batch.num_reqs
        self._propose_started = time.perf_counter()
        drafter.flush_seconds = 0.0
        drafter.draft_this_step = budget.draft_next(
            num_reqs,
            # >>> lookup
            with_lookup=bool(self._lookup_rows),
            # <<< lookup
        )
        drafter.draft_depth = budget.draft_depth
        if drafter.draft_this_step:
            return None
        # No drafts this step: the context K/V of its committed rows is queued
        # here (written before the next drafter forward), without vLLM's
        # drafter-input preparation (next tokens, rejected-row bookkeeping,
        # hidden-state gather), which was most of a context-only step's cost.
        num_tokens = scheduler_output.total_num_scheduled_tokens
        committed = None if plan is None else _committed_rows(self._step, plan)
        if aux_hidden_states is not None:
            target_hidden = torch.cat(
                [h[:num_tokens] for h in aux_hidden_states], dim=-1
            )
        else:
            target_hidden = hidden_states[:num_tokens]
        drafter.defer_context(
            target_hidden,
            runner._get_positions(num_tokens),
            common_attn_metadata.slot_mapping,
            committed,
        )
        seconds = time.perf_counter() - self._propose_started
        # Out of the target step's time, but out of the pass-cost sample too: a
        # flush (here, at max_deferred_rows) writes queued rows.
        self._drafter_seconds = seconds
        budget.record_drafter(False, num_reqs, seconds - drafter.flush_seconds)
        self._step = None
        self._plan = None
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        draft = torch.empty(num_reqs, 0, dtype=torch.int64, device=runner.device)
        self.proposed.clear()
        # >>> lookup
        if self._lookup_rows:
            # No drafter pass, but the lookup trees cost only their rows: built,
            # valued and cut on the host, and sent to the scheduler from there.
            started = time.perf_counter()
            unions = self.lookup.lookup_only_unions(self._lookup_rows)
            num_nodes = budget.choose_lookup_only(unions)
            self.lookup.note_lookup_only_choice(req_ids, self._lookup_rows, num_nodes)
            trees = self.lookup.lookup_only_trees(req_ids, unions, num_nodes)
            if trees is not None:
                draft = self.proposed.put_host(req_ids, trees)
            self._drafter_seconds += time.perf_counter() - started
        # <<< lookup
        # Structured requests still get the tokens their grammar forces: the
        # scheduler builds those trees without drafter candidates.
        self.proposed.put_forced_only(
            req_ids,
            [b for b in drafter.candidate_rows if b < num_reqs],
            self._grammar_candidates,
        )
        return draft

    # <<< auto budget
    def after_propose(self, draft):
        """End of ``propose_draft_token_ids``: the new trees are stashed; the
        scheduler gets each request's real nodes."""
        runner = self.runner
        drafter = runner.drafter
        if drafter.last_tree is not None:
            num_reqs = runner.input_batch.num_reqs
            # Lists of each request's real nodes, not the [R, B] padded tensor:
            # the scheduler then schedules (and the spec-decode counters count)
            # real nodes only, and the stash finds the whole tree again.
            tree = drafter.last_tree
            req_ids = list(runner.input_batch.req_ids[:num_reqs])
            # >>> lookup
            lookup_rows = []
            if self.lookup is not None:
                tree, lookup_rows = self.lookup.union_trees(
                    req_ids, tree, drafter.last_lookup_candidates
                )
            # <<< lookup
            # >>> auto budget
            if self.budget is not None:
                values = [self._grammar_values(tree)]
                # >>> lookup
                values += self._lookup_values(req_ids, lookup_rows, tree.tokens.device)
                # <<< lookup
                tree = dataclasses.replace(
                    tree, num_nodes=self.budget.choose(tree, *values)
                )
            # <<< auto budget
            draft = self.proposed.put(
                req_ids,
                tree,
                drafter.last_candidates,
                self._grammar_candidates,
            )
            drafter.last_tree = None
            drafter.last_candidates = None
            # >>> lookup
            drafter.last_lookup_candidates = None
            # <<< lookup
        # >>> auto budget
        budget = self.budget
        if budget is not None:
            seconds = time.perf_counter() - self._propose_started
            self._drafter_seconds = seconds
            # The first full pass after context-only steps also flushes their
            # queued context K/V (up to max_deferred_rows rows): a cost of those
            # steps, not of drafting, so the pass-cost sample leaves it out.
            budget.record_drafter(
                drafter.draft_this_step,
                runner.input_batch.num_reqs,
                seconds - drafter.flush_seconds,
                drafter.draft_depth,
            )
        # <<< auto budget
        self._step = None
        self._plan = None
        return draft

    # >>> auto budget
    def _grammar_values(self, tree):
        """The auto budget's grammar-shaped values of the batch's structured
        requests: their last grammar-built trees (``BudgetController.choose``)."""
        rows = [
            b
            for b in self.runner.drafter.candidate_rows
            if b < tree.num_reqs
            and self.runner.input_batch.req_ids[b] in self._grammar_trees
        ]
        if not rows:
            return None
        width = tree.tokens.shape[1] - 1
        probs = torch.zeros(len(rows), width)
        depths = torch.zeros(len(rows), width, dtype=torch.int64)
        for i, b in enumerate(rows):
            path_probs, node_depths = self._grammar_trees[
                self.runner.input_batch.req_ids[b]
            ]
            n = min(len(path_probs), width)
            probs[i, :n] = torch.tensor(path_probs[:n])
            depths[i, :n] = torch.tensor(node_depths[:n])
        device = tree.tokens.device
        return (
            torch_utils.async_tensor_h2d(rows, dtype=torch.int64, device=device),
            torch_utils.async_tensor_h2d(probs, device=device),
            torch_utils.async_tensor_h2d(depths, device=device),
        )

    # >>> lookup
    def _lookup_values(self, req_ids, lookup_rows, device):
        """(rows holding union trees [Rl] or None, the batch's lookup-only
        trees or None): what :meth:`BudgetController.choose` values the lookup
        by."""
        if not lookup_rows:
            return None, None
        rows = torch_utils.async_tensor_h2d(
            lookup_rows, dtype=torch.int64, device=device
        )
        # Not verified: only a yardstick (host trees).
        return rows, self.lookup.lookup_only_unions(lookup_rows, watch=False)

    # <<< lookup
    # <<< auto budget
    def _grammar_candidates(
        self, row: int, log_probs: list[list[float]], token_ids: list[list[int]]
    ) -> GrammarCandidates:
        """What the scheduler needs to build batch row ``row``'s tree with its
        grammar: the candidates, the node budget and, with the auto budget, the
        price of a node this step."""
        candidates = GrammarCandidates(log_probs, token_ids, self.config.budget)
        # >>> auto budget
        if self.budget is not None:
            candidates.min_value, candidates.depth_factors = (
                self.budget.grammar_node_price()
            )
        # <<< auto budget
        return candidates

    def attach_draft_trees(self, draft_token_ids):
        """``take_draft_token_ids``: the drafts go to the scheduler with their
        trees' structure, and structured requests' drafter candidates
        (:mod:`.draft_trees`)."""
        return self.proposed.attach(draft_token_ids)


# >>> lookup
def _make_lookup(vllm_config, ddtree: DDTreeConfig) -> BatchLookup | None:
    """The worker's lookup (``ddtree_lookup``, resolved at start-up), with
    vLLM's ``suffix_decoding_*`` settings, or None when off."""
    if ddtree.lookup == "off":
        return None
    from vllm_ddtree.vllm_adapter.lookup import (
        LookupSettings,
        NgramLookup,
        SuffixLookup,
    )

    settings = LookupSettings.from_speculative_config(
        vllm_config.speculative_config, ddtree.budget
    )
    model_config = getattr(vllm_config, "model_config", None)
    max_model_len = getattr(model_config, "max_model_len", 1 << 30)
    if ddtree.lookup == "ngram":
        source = NgramLookup(settings, max_model_len)
    else:  # "suffix"; "auto" is resolved at start-up (config.resolve_lookup)
        source = SuffixLookup(settings, max_model_len)
    logger.info(
        "ddtree: lookup drafts from %s beside the drafter's, in one tree of at most "
        "%d nodes (ddtree_lookup='off' turns them off); proposals up to %g x the "
        "match length, nodes of probability >= %g",
        source.name,
        ddtree.budget,
        settings.max_spec_factor,
        settings.min_token_prob,
    )
    return BatchLookup(source, ddtree.budget)
# <<< lookup


# >>> auto budget
def _committed_rows(step: StepTrees, plan: CommitPlan) -> torch.Tensor:
    """[T] bool: the rows of a verify step whose tokens were committed, every
    row but each tree block's rejected tail (its accepted path having been moved
    first in the block); no host sync."""
    device = plan.num_committed.device
    num_rows = plan.hidden_perm.shape[0]
    starts = step.block_starts
    # [R] block rows: each request's last logits row + 1 - its first.
    sizes = step.logit_rows[:, -1] - step.logit_rows[:, 0] + 1
    offsets = torch.arange(max(step.num_drafts) + 1, device=device)
    rejected = (offsets >= plan.num_committed.unsqueeze(1)) & (
        offsets < sizes.unsqueeze(1)
    )  # [R, longest block]
    committed = torch.ones(num_rows + 1, dtype=torch.bool, device=device)
    committed[torch.where(rejected, starts.unsqueeze(1) + offsets, num_rows)] = False
    return committed[:num_rows]


# <<< auto budget
def _permute_rows(hidden: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """hidden[:T] reordered by perm; rows past T (padding) untouched."""
    out = hidden.clone()
    out[: perm.shape[0]] = hidden.index_select(0, perm.to(hidden.device))
    return out


def _sampling_params(
    metadata, num_reqs: int, device, min_p: list[float] | None = None
) -> TreeSamplingParams:
    """vLLM SamplingMetadata (+ the per-request min_p, which vLLM leaves out of it
    under speculative decoding) -> TreeSamplingParams. Seeded coins are passed to
    verify_tree separately, so no generators."""
    if metadata.all_greedy or metadata.temperature is None:
        return TreeSamplingParams.greedy(num_reqs, device)
    top_k = metadata.top_k
    return TreeSamplingParams(
        temperature=metadata.temperature[:num_reqs].float(),
        top_k=None if top_k is None else top_k[:num_reqs].to(torch.int64),
        top_p=None if metadata.top_p is None else metadata.top_p[:num_reqs].float(),
        min_p=None
        if min_p is None
        else torch_utils.async_tensor_h2d(min_p, device=device, dtype=torch.float32),
    )


# --------------------------------------------------------------------------- #
# Per-request sampling features (min_p, logit_bias, allowed_token_ids,
# min_tokens, seeds, logprobs) in tree verification
# --------------------------------------------------------------------------- #

_MASK64 = (1 << 64) - 1


class _BatchExtras:
    """What a step needs from the requests' own SamplingParams (batch row order)."""

    __slots__ = (
        "seeded_rows",
        "seeds",
        "seeded_out_lens",
        "min_p",
        "logit_bias",
        "history_rows",
        "structured_rows",
    )

    def __init__(self) -> None:
        self.seeded_rows: list[int] = []  # random (T > 0) requests with a seed
        self.seeds: list[int] = []
        self.seeded_out_lens: list[int] = []  # output tokens committed before this step
        self.min_p: list[float] | None = None  # [R] when a random request has min_p > 0
        self.logit_bias: list[tuple[int, dict[int, float]]] = []
        # Requests whose edits read the token history (penalties, bad words).
        self.history_rows: list[int] = []
        # Structured requests: the scheduler builds their trees with their
        # grammars, from the drafter's candidates.
        self.structured_rows: list[int] = []

    @property
    def needs_own_sampler(self) -> bool:
        return bool(self.seeded_rows or self.min_p is not None or self.logit_bias)

    def edits_logits(self, metadata) -> bool:
        """Whether the target logits get edited (bias, allowed ids, min_tokens,
        penalties, bad words)."""
        return bool(
            self.logit_bias
            or self.history_rows
            or metadata.allowed_token_ids_mask is not None
            or _min_tokens_state(metadata)
        )


def _scan_requests(runner, num_reqs: int) -> _BatchExtras:
    """One pass over the batch's SamplingParams (a few attribute reads each)."""
    extras = _BatchExtras()
    requests = runner.requests
    for b, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
        state = requests.get(req_id)
        sp = None if state is None else state.sampling_params
        if sp is None:
            continue
        if sp.logit_bias:
            extras.logit_bias.append((b, sp.logit_bias))
        if (
            sp.presence_penalty != 0.0
            or sp.frequency_penalty != 0.0
            or sp.repetition_penalty != 1.0
            or sp.bad_words_token_ids
        ):
            extras.history_rows.append(b)
        if sp.structured_outputs is not None:
            extras.structured_rows.append(b)
        if sp.temperature < SAMPLING_EPS:
            continue
        if sp.seed is not None:
            extras.seeded_rows.append(b)
            extras.seeds.append(sp.seed)
            extras.seeded_out_lens.append(len(state.output_token_ids))
        if sp.min_p > 0.0:
            if extras.min_p is None:
                extras.min_p = [0.0] * num_reqs
            extras.min_p[b] = float(sp.min_p)
    return extras


def _min_tokens_state(metadata) -> dict:
    """vLLM's MinTokensLogitsProcessor state (it exists under speculative decoding):
    row -> (min_tokens, live output token list, stop token ids, structured)."""
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    logitsprocs = getattr(metadata, "logitsprocs", None)
    for proc in getattr(logitsprocs, "non_argmax_invariant", ()):
        if isinstance(proc, MinTokensLogitsProcessor):
            return proc.min_toks
    return {}


def _apply_constraints(
    runner,
    target: torch.Tensor,
    depths: torch.Tensor,
    metadata,
    extras: _BatchExtras,
    step: StepTrees | None,
) -> None:
    """In place on float32 target [R, rows, V]: the logit edits vLLM's sampler
    makes before temperature, per tree node (penalties after logit_bias, as
    there; the -inf masks commute with the rest). logit_bias and
    allowed_token_ids act on every node; min_tokens masks the stop tokens at the
    nodes of depth d with ``len(output) + d < min_tokens`` (node d predicts output
    token len(output) + d), unless that would leave a node with no token at all
    (then the stop tokens are kept there, as vLLM does for structured output).
    Bad words and penalties read each node's own token history: the committed
    output + the drafts on the path to it (vLLM's chain rule, for a tree), through
    vLLM's own ``apply_bad_words`` and ``apply_all_penalties``."""
    num_reqs, _, vocab = target.shape
    device = target.device
    for b, bias in extras.logit_bias:
        ids = torch_utils.async_tensor_h2d(
            [int(t) for t in bias], device=device, dtype=torch.int64
        )
        vals = torch_utils.async_tensor_h2d(
            list(bias.values()), device=device, dtype=target.dtype
        )
        target[b, :, ids] += vals
    mask = metadata.allowed_token_ids_mask
    if mask is not None:
        target.masked_fill_(mask[:num_reqs, :vocab].unsqueeze(1), float("-inf"))
    for b, (min_tokens, output, stops, _) in _min_tokens_state(metadata).items():
        remaining = min_tokens - len(output)
        if b >= num_reqs or remaining <= 0 or not stops:
            continue
        ids = torch_utils.async_tensor_h2d(
            sorted(t for t in stops if 0 <= t < vocab), device=device, dtype=torch.int64
        )
        kept = target[b][:, ids]  # [rows, S] (a copy)
        masked = torch.where((depths[b] < remaining).unsqueeze(1), float("-inf"), kept)
        target[b, :, ids] = masked
        dead = torch.isneginf(target[b]).all(dim=-1, keepdim=True)
        target[b, :, ids] = torch.where(dead, kept, masked)
    if extras.history_rows:
        _apply_history_edits(runner, target, metadata, extras.history_rows, step)


def _apply_history_edits(runner, target, metadata, rows: list[int], step) -> None:
    """Bad words, then presence/frequency/repetition penalties, per tree node of
    each request in ``rows``; node i's history is the request's output tokens +
    the draft tokens on the path root..i (the root is the last output token)."""
    from vllm.v1.sample.ops.bad_words import apply_bad_words
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    num_rows = target.shape[1]
    req_ids = runner.input_batch.req_ids
    for b in rows:
        output = runner.requests[req_ids[b]].output_token_ids
        paths = step.path_tokens(b) if step is not None else [[]] * num_rows
        histories = [output + path for path in paths]
        node_logits = target[b]  # [rows, V], a view: edited in place
        bad_words = metadata.bad_words_token_ids.get(b)
        if bad_words:
            apply_bad_words(
                node_logits, dict.fromkeys(range(num_rows), bad_words), histories
            )
        if not metadata.no_penalties:
            one = torch.full((num_rows,), b, dtype=torch.int64, device=target.device)
            # vLLM edits in place and returns the logits; copy only if it did not.
            penalised = apply_all_penalties(
                node_logits,
                metadata.prompt_token_ids[one],
                metadata.presence_penalties[one],
                metadata.frequency_penalties[one],
                metadata.repetition_penalties[one],
                histories,
            )
            if penalised.data_ptr() != node_logits.data_ptr():
                node_logits.copy_(penalised)


def _verify_batch(
    verifier: DDTreeVerifier,
    tree,
    flat_rows: torch.Tensor,
    logits: torch.Tensor,
    extras: _BatchExtras,
    step: StepTrees | None,
    width: int | None = None,
):
    """verify_tree with every request's own parameters -> (output, LogprobsTensors).

    ``flat_rows`` [R, rows] maps tree rows to rows of ``logits`` [num_logits, V].
    Without logit edits verification reads those rows in place; with edits, a
    private float32 copy ``target_logits`` [R, rows, V] is edited (vLLM's sampler
    edits float32 logits: a bf16 edit would round) and ``logits`` stays untouched
    for raw logprobs. ``step``: the step's trees (None: root-only rows).
    ``width``: committed columns the caller returns (logprobs rows per request)."""
    runner = verifier.runner
    metadata = runner.input_batch.sampling_metadata
    num_reqs = tree.num_reqs
    device = logits.device
    target_logits = None
    if extras.edits_logits(metadata):
        target_logits = logits[flat_rows.reshape(-1)].view(num_reqs, tree.num_rows, -1)
        target_logits = target_logits.float()  # (indexing made the copy)
        _apply_constraints(runner, target_logits, tree.depths, metadata, extras, step)
    params = _sampling_params(metadata, num_reqs, device, extras.min_p)
    ddtree = verifier.config
    method = ddtree.verify
    coins = None
    if extras.seeded_rows:
        coins = _seeded_coins(extras, tree, device)
        # With exact thresholds both rules accept a child with the children's
        # total target mass and emit the target's law; sample_walk's coin ->
        # token map does not depend on the tree, so a seeded request's output
        # is a function of (seed, prompt, target) only (_seeded_coins).
        if ddtree.threshold_single >= 1.0 and ddtree.threshold_acc >= 1.0:
            method = "sample_walk"
    out = verify_tree(
        tree,
        logits if target_logits is None else target_logits,
        params,
        method=method,
        coins=coins,
        threshold_single=ddtree.threshold_single,
        threshold_acc=ddtree.threshold_acc,
        backend=ddtree.kernel_backend,
        validate=False,
        row_index=flat_rows if target_logits is None else None,
        max_tree_depth=max(verifier.max_tree_depth, tree.max_depth),
    )
    logprobs = _logprobs_tensors(
        runner, metadata, logits, flat_rows, target_logits, out, params, width
    )
    return out, logprobs


# >>> auto budget
def _calibrate(verifier: DDTreeVerifier, step: StepTrees, out) -> None:
    """Feeds the auto budget what the target accepted of the verified trees."""
    tree = step.tree
    union = [False] * tree.num_reqs
    # >>> lookup
    if verifier.lookup is not None:
        req_ids = verifier.runner.input_batch.req_ids[: tree.num_reqs]
        union = verifier.lookup.union_rows(
            req_ids, step.parents, step.tokens, step.num_drafts
        )
    # <<< lookup
    # Requests verified as a chain (no path probabilities) count nowhere;
    # grammar-built trees (probabilities renormalised over the allowed tokens)
    # have their own calibration.
    # >>> lookup
    # So do trees holding lookup nodes (union rows; the lookup's calibration is
    # on the host, fed in before_propose): a step of lookup trees alone does no
    # device work here.
    # <<< lookup
    drafter_rows, grammar_rows = [], []
    for b, n in enumerate(step.num_drafts):
        scheduled = step.scheduled[b] if step.scheduled else None
        if n == 0 or scheduled is None or scheduled.path_probs is None:
            continue
        if scheduled.grammar_shaped:
            grammar_rows.append(b)
        elif not union[b]:
            drafter_rows.append(b)
    if not drafter_rows and not grammar_rows:
        return
    probs = torch.zeros(tree.num_reqs, tree.num_rows)
    verified = torch.zeros(tree.num_reqs, tree.num_rows, dtype=torch.bool)
    chosen = torch.zeros(2, tree.num_reqs, dtype=torch.bool)  # drafter, grammar
    for which, batch_rows in enumerate((drafter_rows, grammar_rows)):
        for b in batch_rows:
            n = step.num_drafts[b]
            probs[b, 1 : n + 1] = torch.tensor(step.scheduled[b].path_probs)
            verified[b, 1 : n + 1] = True
        chosen[which, batch_rows] = True
    device = tree.depths.device
    probs, verified, chosen = (
        torch_utils.async_tensor_h2d(x, device=device)
        for x in (probs, verified, chosen)
    )
    for calibration, rows in zip(
        (verifier.budget.calibration, verifier.budget.grammar_calibration),
        chosen,
        strict=True,
    ):
        calibration.update(
            probs, tree.depths, verified & rows.unsqueeze(1),
            torch.where(rows, out.num_accepted, 0),
        )


# <<< auto budget


def _finished_or_preempted(scheduler_output) -> list[str]:
    """The requests that left the batch this step."""
    return [
        *(scheduler_output.finished_req_ids or ()),
        *(scheduler_output.preempted_req_ids or ()),
    ]


_ROOT_TREES: dict[tuple[int, str], object] = {}


def _root_only_tree(num_reqs: int, device):
    """A batch of trees without drafts (the bonus row only), cached per shape."""
    from vllm_ddtree.tree import tree_from_parents

    key = (num_reqs, str(device))
    tree = _ROOT_TREES.get(key)
    if tree is None:
        if len(_ROOT_TREES) > 64:
            _ROOT_TREES.clear()
        tree = tree_from_parents(
            [[-1]] * num_reqs, [[0]] * num_reqs, max_depth=1, device=device
        )
        _ROOT_TREES[key] = tree
    return tree


def _splitmix64(x):
    """SplitMix64's output function on a numpy uint64 array (wrapping arithmetic)."""
    import numpy as np

    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def counter_uniforms(seeds, counters):
    """Uniforms in [0, 1) (float32, 24 random bits) that are a pure function of
    ``(seed, counter)``: element ``[s, c]`` is draw number ``counters[s, c]`` of
    the SplitMix64 stream keyed by ``splitmix64(seeds[s])``.

    Args:
        seeds: S Python ints (any sign or size; taken mod 2**64).
        counters: [S, C] non-negative integers.

    Returns:
        [S, C] numpy float32.
    """
    import numpy as np

    keys = _splitmix64(np.array([int(s) & _MASK64 for s in seeds], dtype=np.uint64))
    counters = np.asarray(counters, dtype=np.uint64)
    z = _splitmix64(keys[:, None] + counters * np.uint64(0x9E3779B97F4A7C15))
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)


def _seeded_coins(extras: _BatchExtras, tree, device):
    """(node_coins [R, rows], final_coins [R]): torch.rand for unseeded requests;
    for a seeded request the coin of a node at depth d is the draw
    ``(seed, 2 * (n + d))`` and its final (residual) coin ``(seed, 2 * n + 1)``,
    with n its output tokens before this step.

    A walk visits one node per depth and a step emits the tokens of output
    positions n .. n + k, so every coin is used at most once over a request's life
    (coins past the stopping depth are unused and serve the next step): exact
    sampling. With ``sample_walk`` (what _verify_batch uses for batches with seeded
    requests) the token at output position p is the target's inverse CDF at coin
    (seed, 2p) whatever the tree, drafter, budget, batch or step kind, so a seeded
    request's output depends on (seed, prompt, target, parameters) only. Nothing is
    drawn from a stateful generator, so discarded rows (partial prefill chunks)
    consume nothing."""
    import numpy as np

    num_reqs, rows = tree.num_reqs, tree.num_rows
    width = tree.max_depth + 1
    out_lens = np.array(extras.seeded_out_lens, dtype=np.int64)[:, None]
    counters = np.concatenate(
        [2 * (out_lens + np.arange(width)[None, :]), 2 * out_lens + 1], axis=1
    )
    seeded = torch_utils.async_tensor_h2d(counter_uniforms(extras.seeds, counters), device=device)
    coins = torch.rand(num_reqs, rows + 1, device=device)
    node_coins = coins[:, :rows].contiguous()
    final_coins = coins[:, rows].contiguous()
    idx = torch_utils.async_tensor_h2d(extras.seeded_rows, device=device, dtype=torch.int64)
    depths = tree.depths[idx].clamp(max=width - 1)
    node_coins[idx] = seeded[:, :width].gather(1, depths)
    final_coins[idx] = seeded[:, width]
    return node_coins, final_coins


def _logprobs_tensors(
    runner,
    metadata,
    logits,
    flat_rows,
    target_logits,
    out,
    params,
    width: int | None = None,
):
    """LogprobsTensors of the committed tokens, [R * W] rows (W = committed width,
    -1 placeholders included and filtered by vLLM's parse_output), like vLLM's
    rejection sampler: row j of request b is the target at the accepted node of
    depth j. Raw modes read the untouched logits, processed modes the edited ones
    (``target_logits``; None: no edits) after temperature, min-p, top-k and
    top-p."""
    num_logprobs = metadata.max_num_logprobs
    if num_logprobs is None:
        return None
    from vllm.v1.sample.sampler import Sampler

    from vllm_ddtree.sampling import apply_sampling_params

    committed = out.committed_tokens[:, :width]
    num_reqs, width = committed.shape
    nodes = out.accepted_indices[:, :width].clamp(min=0)
    tokens = committed.clamp(min=0).reshape(-1).to(torch.int64)
    mode = getattr(runner.sampler, "logprobs_mode", "raw_logprobs")
    if mode in ("raw_logprobs", "raw_logits"):
        rows = logits[flat_rows.gather(1, nodes).reshape(-1)].float()
        logprobs = rows.log_softmax(dim=-1) if mode == "raw_logprobs" else rows
    else:
        req = torch.arange(num_reqs, device=nodes.device).unsqueeze(1).expand(-1, width)
        req = req.reshape(-1)
        if target_logits is None:  # no edits: the raw rows
            rows = logits[flat_rows.gather(1, nodes).reshape(-1)].float()
        else:
            rows = target_logits[req, nodes.reshape(-1)].float()
        rows = apply_sampling_params(rows, params.select(req))
        logprobs = rows.log_softmax(dim=-1) if mode == "processed_logprobs" else rows
    return Sampler.gather_logprobs(logprobs, num_logprobs, tokens)
