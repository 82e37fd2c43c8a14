# SPDX-License-Identifier: Apache-2.0
"""The V1 model-runner hooks of a ddtree step.

A step of vLLM's V1 runner with ddtree on:

1. ``_prepare_inputs``: vLLM lays out each request's ``[root] + drafts`` rows with
   linear positions and slots. The tree structure is re-attached to the
   scheduled drafts (:mod:`.step`), the RoPE positions of tree rows become
   ``root position + depth``, and the tree attention batch is described.
2. ``_model_forward``: the target runs with ancestor-only attention inside each
   tree (the attention backend reads the active tree batch).
3. ``_sample``: tree verification (:func:`vllm_ddtree.verify.verify_tree`)
   instead of the chain rejection sampler; its committed tokens have the chain
   sampler's ``[R, W]`` ``-1``-padded shape, so vLLM's bookkeeping and scheduler
   work unchanged (the scheduler rolls back ``drafts - accepted`` tokens). The
   accepted path's K/V is then moved to contiguous slots (:mod:`vllm_ddtree.commit`).
4. ``propose_draft_token_ids``: linear positions are restored and the accepted
   path's hidden states are moved first in each block, so the DFlash drafter sees
   exactly the committed sequence as context; the new trees are stashed.
"""

from __future__ import annotations

import torch
from vllm.v1.outputs import SamplerOutput

from vllm_ddtree.commit import CommitPlan, plan_commit
from vllm_ddtree.sampling import TreeSamplingParams
from vllm_ddtree.verify import verify_tree
from vllm_ddtree.vllm_adapter import attn_context
from vllm_ddtree.vllm_adapter.config import DDTreeConfig
from vllm_ddtree.vllm_adapter.step import StepTrees, TreeStash, build_step_trees

__all__ = ["DDTreeRunnerMixin", "enable_ddtree"]

_MIXED_CLASSES: dict[type, type] = {}


def enable_ddtree(runner, ddtree: DDTreeConfig) -> None:
    """Turns a constructed V1 runner into a ddtree runner (class swap + drafter)."""
    from vllm_ddtree.vllm_adapter.proposer import DDTreeProposer

    cls = type(runner)
    if cls not in _MIXED_CLASSES:
        _MIXED_CLASSES[cls] = type(f"DDTree{cls.__name__}", (DDTreeRunnerMixin, cls), {})
    runner.__class__ = _MIXED_CLASSES[cls]
    runner.drafter = DDTreeProposer(runner.vllm_config, runner.device, ddtree, runner)
    runner._ddtree = ddtree
    runner._ddtree_stash = TreeStash()
    runner._ddtree_step = None
    runner._ddtree_linear_positions = None
    runner._ddtree_plan = None
    runner._ddtree_attn = None
    # Device-side counters (no sync): verify steps with a tree, and requests
    # whose accepted path left the chain (a sibling was accepted somewhere).
    runner.ddtree_num_tree_verifies = torch.zeros((), dtype=torch.int64, device=runner.device)
    runner.ddtree_num_branch_paths = torch.zeros((), dtype=torch.int64, device=runner.device)


class DDTreeRunnerMixin:
    _ddtree: DDTreeConfig
    _ddtree_stash: TreeStash
    _ddtree_step: StepTrees | None
    _ddtree_linear_positions: torch.Tensor | None
    _ddtree_plan: CommitPlan | None

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._ddtree_step = None
        self._ddtree_plan = None
        self._ddtree_linear_positions = None
        spec_decode_metadata = out[1]
        num_reqs = self.input_batch.num_reqs
        req_ids = list(self.input_batch.req_ids[:num_reqs])
        self._ddtree_stash.retain(req_ids)
        if spec_decode_metadata is None:
            return out

        total = scheduler_output.total_num_scheduled_tokens
        query_start = self.query_start_loc.cpu[: num_reqs + 1].tolist()
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        num_drafts = [len(scheduled.get(r, ())) for r in req_ids]
        starts = [query_start[b + 1] - n - 1 for b, n in enumerate(num_drafts)]
        input_ids = self.input_ids.gpu[:total]
        roots = input_ids[torch.tensor(starts, device=input_ids.device)].tolist()
        step = build_step_trees(
            req_ids, scheduled, query_start[1:], roots, self._ddtree_stash,
            self.positions.device,
        )

        # RoPE positions of tree rows: root position + depth (slots stay linear).
        linear = self.positions[:total].clone()
        tree = step.tree
        offsets = torch.arange(tree.num_rows, device=linear.device)
        counts = torch.tensor(num_drafts, device=linear.device)
        real = offsets.unsqueeze(0) <= counts.unsqueeze(1)
        rows = (step.block_starts.unsqueeze(1) + offsets.unsqueeze(0))[real]
        root_pos = linear[step.block_starts]
        self.positions[rows] = (root_pos.unsqueeze(1) + tree.depths)[real]

        self._ddtree_attn = attn_context.TreeAttentionBatch(tuple(
            attn_context.TreeRequest(
                req_index=b,
                row_offset=starts[b] - query_start[b],
                num_rows=num_drafts[b] + 1,
                prefix_len=int(root_pos[b]),
                visibility=tree.visibility[b, : num_drafts[b] + 1, : num_drafts[b] + 1],
            )
            for b in range(num_reqs)
            if num_drafts[b] > 0
        ))
        self._ddtree_step = step
        self._ddtree_linear_positions = linear
        return out

    def _model_forward(self, *args, **kwargs):
        batch = self._ddtree_attn if self._ddtree_step is not None else None
        if batch is None or not batch.requests:
            return super()._model_forward(*args, **kwargs)
        with attn_context.tree_attention(batch):
            return super()._model_forward(*args, **kwargs)

    def _sample(self, logits, spec_decode_metadata):
        step = self._ddtree_step
        if step is None or spec_decode_metadata is None:
            return super()._sample(logits, spec_decode_metadata)
        tree = step.tree
        num_reqs = tree.num_reqs
        device = logits.device
        # logits: per request its n_r + 1 verify rows, request-major.
        counts = torch.tensor(step.num_drafts, device=device) + 1
        first = torch.cumsum(counts, 0) - counts
        offsets = torch.arange(tree.num_rows, device=device).unsqueeze(0)
        index = first.unsqueeze(1) + torch.minimum(offsets, (counts - 1).unsqueeze(1))
        target_logits = logits[index.reshape(-1)].view(num_reqs, tree.num_rows, -1)

        out = verify_tree(
            tree.to(device),
            target_logits,
            _sampling_params(self.input_batch.sampling_metadata, num_reqs, device),
            method=self._ddtree.verify,
            threshold_single=self._ddtree.threshold_single,
            threshold_acc=self._ddtree.threshold_acc,
            backend=self._ddtree.kernel_backend,
            validate=False,
        )
        total = int(self._ddtree_linear_positions.shape[0])
        plan = plan_commit(out.accepted_indices, step.block_starts.to(device), total)
        if self._ddtree_attn.requests:
            self._ddtree_attn.commit_kv((plan.src_rows, plan.dst_rows), row_space="batch")
        self._ddtree_attn.release()
        self._ddtree_plan = plan
        self.ddtree_num_tree_verifies += len(self._ddtree_attn.requests)
        self.ddtree_num_branch_paths += plan.moved().view(num_reqs, -1).any(dim=1).sum()
        return SamplerOutput(
            sampled_token_ids=out.committed_tokens.to(torch.int32),
            logprobs_tensors=None,
        )

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids,
                                sampling_metadata, hidden_states, sample_hidden_states,
                                aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        plan = self._ddtree_plan
        if plan is not None:
            total = plan.hidden_perm.shape[0]
            # The drafter reads linear positions; depth positions would put rejected
            # siblings' draft K/V on the accepted path's slots.
            self.positions[:total] = self._ddtree_linear_positions
            if aux_hidden_states is not None:
                aux_hidden_states = [_permute_rows(h, plan.hidden_perm) for h in aux_hidden_states]
        draft = super().propose_draft_token_ids(
            scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
            sample_hidden_states, aux_hidden_states, spec_decode_metadata,
            common_attn_metadata, slot_mappings,
        )
        if self.drafter.last_tree is not None:
            num_reqs = self.input_batch.num_reqs
            self._ddtree_stash.put(list(self.input_batch.req_ids[:num_reqs]),
                                   self.drafter.last_tree)
            self.drafter.last_tree = None
        self._ddtree_step = None
        self._ddtree_plan = None
        return draft


def _permute_rows(hidden: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """hidden[:T] reordered by perm; rows past T (padding) untouched."""
    out = hidden.clone()
    out[: perm.shape[0]] = hidden.index_select(0, perm.to(hidden.device))
    return out


def _sampling_params(metadata, num_reqs: int, device) -> TreeSamplingParams:
    """vLLM SamplingMetadata -> TreeSamplingParams (min-p is off under spec decode)."""
    if metadata.all_greedy or metadata.temperature is None:
        return TreeSamplingParams.greedy(num_reqs, device)
    top_k = metadata.top_k
    return TreeSamplingParams(
        temperature=metadata.temperature[:num_reqs].float(),
        top_k=None if top_k is None else top_k[:num_reqs].to(torch.int64),
        top_p=None if metadata.top_p is None else metadata.top_p[:num_reqs].float(),
        min_p=None,
        generators=dict(metadata.generators),
    )
