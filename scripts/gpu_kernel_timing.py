# SPDX-License-Identifier: Apache-2.0
"""Times tree build and verification backends on a CUDA device (scripts/gpu_check.sh).

Side by side in one process, CUDA events, medians over repeats, identical inputs;
integer outputs of every backend are compared with the torch reference.
"""

import argparse
import json
import statistics

import torch

from vllm_ddtree.commit import plan_commit
from vllm_ddtree.ops import available_backends
from vllm_ddtree.ops.kv_commit import commit_kv_triton
from vllm_ddtree.ops.tree_attention import tree_attention_triton
from vllm_ddtree.references import commit_kv_reference, tree_attention_reference
from vllm_ddtree.sampling import TreeSamplingParams, draw_coins
from vllm_ddtree.tree import build_ddtree, draft_top_k
from vllm_ddtree.verify import verify_tree


def cuda_ms(fn, repeats=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def flex_tree_attention(q, key_cache, value_cache, block_table, prefix_lens, tree_lens, visibility, scale):
    """torch's flex_attention with an equivalent block mask, or None if unavailable.

    flex_attention has no paged-cache input here: K/V are gathered into one
    contiguous [1, num_kv_heads, sum(p + t), head_dim] sequence beforehand (not
    timed, which favours flex). Returns (fn, output [num_tokens, heads, head_dim]).
    """
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    dev = q.device
    block_size = key_cache.shape[1]
    p_list, t_list = prefix_lens.tolist(), tree_lens.tolist()
    slots, kv_req, kv_pos = [], [], []
    for r, (p, t) in enumerate(zip(p_list, t_list)):
        pos = torch.arange(p + t, device=dev)
        slots.append(block_table[r].long()[pos // block_size] * block_size + pos % block_size)
        kv_req.append(torch.full_like(pos, r))
        kv_pos.append(pos)
    slots, kv_req, kv_pos = torch.cat(slots), torch.cat(kv_req), torch.cat(kv_pos)
    flat = (-1,) + tuple(key_cache.shape[2:])
    k = key_cache.reshape(flat)[slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
    v = value_cache.reshape(flat)[slots].transpose(0, 1).unsqueeze(0)
    q_req = torch.cat([torch.full((t,), r, device=dev) for r, t in enumerate(t_list)])
    q_row = torch.cat([torch.arange(t, device=dev) for t in t_list])
    prefix = prefix_lens.long()
    rows = visibility.shape[-1]

    def mask_mod(b, h, q_idx, kv_idx):
        r = q_req[q_idx]
        j = (kv_pos[kv_idx] - prefix[r]).clamp(0, rows - 1)
        in_prefix = kv_pos[kv_idx] < prefix[r]
        return (kv_req[kv_idx] == r) & (in_prefix | visibility[r, q_row[q_idx], j])

    block_mask = create_block_mask(mask_mod, None, None, q.shape[0], k.shape[2], device=dev)
    compiled = torch.compile(flex_attention)
    qf = q.transpose(0, 1).unsqueeze(0)  # [1, H, num_tokens, D]

    def fn():
        return compiled(qf, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)

    return fn, fn()[0].transpose(0, 1)


def time_tree_attention(dev):
    """Tree attention over the paged cache: Triton kernel vs torch reference vs flex."""
    num_kv_heads, group, head_dim, block_size, dtype = 8, 4, 128, 16, torch.bfloat16
    rows = []
    for num_reqs, prefix_len, tree_rows in ((8, 1024, 64), (1, 1024, 64), (8, 4096, 64),
                                            (32, 1024, 64)):
        g = torch.Generator(device=dev).manual_seed(0)
        tree = build_ddtree(torch.randn(num_reqs, 8, 1000, device=dev, generator=g),
                            tree_rows - 1, validate=False)
        tree_lens = (tree.num_nodes + 1).int()
        prefix_lens = torch.full((num_reqs,), prefix_len, dtype=torch.int32, device=dev)
        per_req = -(-(prefix_len + tree_rows) // block_size)
        num_blocks = num_reqs * per_req + 16
        block_table = torch.randperm(num_blocks, device=dev, generator=g)[:num_reqs * per_req]
        block_table = block_table.view(num_reqs, per_req).int()
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        key_cache = torch.randn(shape, device=dev, dtype=dtype, generator=g)
        value_cache = torch.randn(shape, device=dev, dtype=dtype, generator=g)
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev)
        qsl[1:] = tree_lens.cumsum(0)
        num_tokens = num_reqs * tree_rows
        q = torch.randn(num_tokens, num_kv_heads * group, head_dim, device=dev, dtype=dtype,
                        generator=g)
        scale = head_dim ** -0.5
        args = (q, key_cache, value_cache, block_table, prefix_lens, tree_lens, qsl,
                tree.visibility_packed, scale)
        ref = tree_attention_reference(*args)
        out = tree_attention_triton(*args)
        err = (out.float() - ref.float()).abs().max().item()
        row = {"kernel": "tree_attention", "num_reqs": num_reqs, "prefix_len": prefix_len,
               "tree_rows": tree_rows, "num_heads": num_kv_heads * group,
               "num_kv_heads": num_kv_heads, "head_dim": head_dim, "block_size": block_size,
               "dtype": str(dtype), "triton_max_abs_err": err, "triton_ok": err < 2e-2,
               "torch_ms": cuda_ms(lambda: tree_attention_reference(*args)),
               "triton_ms": cuda_ms(lambda: tree_attention_triton(*args))}
        try:
            flex = flex_tree_attention(q, key_cache, value_cache, block_table, prefix_lens,
                                       tree_lens, tree.visibility, scale)
        except Exception as e:  # noqa: BLE001 (compile failures must not stop the run)
            flex, row["flex_error"] = None, f"{type(e).__name__}: {e}"[:300]
        if flex is not None:
            fn, flex_out = flex
            flex_err = (flex_out.float() - ref.float()).abs().max().item()
            row.update(flex_max_abs_err=flex_err, flex_ok=flex_err < 2e-2,
                       flex_ms_kv_pregathered=cuda_ms(fn))
        print(json.dumps(row))
        rows.append(row)
        del key_cache, value_cache
    return rows


def time_kv_commit(dev):
    """KV commit of accepted paths in every layer: one Triton launch vs a torch
    index_select + index_copy_ per layer. Moves come from plan_commit on random
    accepted paths (8 moves per request), mapped to slots with a random block table."""
    num_layers, num_kv_heads, head_dim, block_size, dtype = 32, 8, 128, 16, torch.bfloat16
    prefix_len, tree_rows, moves_per_req = 1024, 64, 8
    rows = []
    for num_reqs in (64, 16, 1):
        g = torch.Generator(device=dev).manual_seed(0)
        nodes = torch.rand(num_reqs, tree_rows - 1, device=dev, generator=g).argsort(dim=1)
        nodes = nodes[:, :moves_per_req].sort(dim=1).values + 1  # increasing p_1 < p_2 ...
        accepted = torch.cat([torch.zeros_like(nodes[:, :1]), nodes], dim=1)
        plan = plan_commit(accepted, torch.arange(num_reqs, device=dev) * tree_rows,
                           num_reqs * tree_rows)
        per_req = -(-(prefix_len + tree_rows) // block_size)
        num_blocks = num_reqs * per_req + 16
        block_table = torch.randperm(num_blocks, device=dev, generator=g)[:num_reqs * per_req]
        block_table = block_table.view(num_reqs, per_req)

        def to_slots(flat_rows):
            req, pos = flat_rows // tree_rows, prefix_len + flat_rows % tree_rows
            return block_table[req, pos // block_size] * block_size + pos % block_size

        src, dst = to_slots(plan.src_rows), to_slots(plan.dst_rows)
        caches = list(torch.randn((num_layers, 2, num_blocks, block_size, num_kv_heads,
                                   head_dim), device=dev, dtype=dtype, generator=g).unbind(0))

        def torch_loop(kv_caches):
            for cache in kv_caches:
                flat = cache.view(2, -1, num_kv_heads, head_dim)
                flat.index_copy_(1, dst, flat.index_select(1, src))

        want = [c.clone() for c in caches]
        commit_kv_reference(want, src, dst)
        got = [c.clone() for c in caches]
        torch_loop(got)
        torch_equal = all(torch.equal(a, b) for a, b in zip(got, want))
        got = [c.clone() for c in caches]
        commit_kv_triton(got, src, dst, validate=True)
        triton_equal = all(torch.equal(a, b) for a, b in zip(got, want))
        del want, got
        moved = int((src != dst).sum())
        row = {"kernel": "kv_commit", "num_layers": num_layers, "num_reqs": num_reqs,
               "moves": src.numel(), "moved": moved, "num_kv_heads": num_kv_heads,
               "head_dim": head_dim, "block_size": block_size, "dtype": str(dtype),
               "torch_equal": torch_equal, "triton_equal": triton_equal,
               "torch_loop_ms": cuda_ms(lambda: torch_loop(caches))}
        for block_moves in (16, 32, 64):
            row[f"triton_ms_bm{block_moves}"] = cuda_ms(
                lambda: commit_kv_triton(caches, src, dst, block_moves=block_moves))
        # Every entry a self-move: what the kernel costs when nothing moves.
        row["triton_identity_ms"] = cuda_ms(lambda: commit_kv_triton(caches, dst, dst))
        bytes_moved = 2 * num_layers * 2 * moved * num_kv_heads * head_dim * caches[0].element_size()
        row["triton_bm32_GBps"] = bytes_moved / row["triton_ms_bm32"] / 1e6
        print(json.dumps(row))
        rows.append(row)
        del caches
    return rows


def _num_compiled(kernel) -> int | None:
    """Variants Triton holds compiled for ``kernel`` (None: not readable here)."""
    try:
        return sum(len(entry[0]) for entry in kernel.device_caches.values())
    except Exception:  # noqa: BLE001 (a Triton internal; the count is a bonus)
        return None


def first_run_compiles(dev, budget=64, vocab=151_936):
    """What a first GPU run compiles (issue 49): the start-up warm-up's wall
    time (every verify variant: both methods, bf16 and fp32 logits; tree
    attention at Qwen3-8B shapes with the engine's tiles), then a varied run
    of steps (trees of 2..B + 1 rows, 1..8 requests) that must compile
    nothing more: the slowest call's wall time and Triton's variant counts
    before and after. Run with a fresh TRITON_CACHE_DIR (gpu_check.sh does)."""
    import time

    from vllm_ddtree.ops import triton_verify, tree_attention
    from vllm_ddtree.ops.tree_attention import tree_attention_tiles
    from vllm_ddtree.ops.triton_verify import warm_up_tree_verify

    def wall(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    max_depth = max(budget, 15)  # the engine's: B, or the drafter's 15 drafts
    row = {"budget": budget, "vocab": vocab}
    row["verify_warm_up_s"] = wall(lambda: warm_up_tree_verify(
        vocab, (torch.bfloat16, torch.float32), max_depth, 1.0, 1.0, dev))
    num_kv_heads, group, head_dim, block_size, dtype = 8, 4, 128, 16, torch.bfloat16
    num_heads = num_kv_heads * group
    block_q, block_t = tree_attention_tiles(budget + 1, num_heads, num_kv_heads)
    g = torch.Generator(device=dev).manual_seed(0)
    num_blocks = 512
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, device=dev, dtype=dtype, generator=g)
    value_cache = torch.randn(shape, device=dev, dtype=dtype, generator=g)

    def attention_call(num_reqs, tree_rows, prefix_len=1000):
        tree = build_ddtree(torch.randn(num_reqs, 8, 1000, device=dev, generator=g),
                            tree_rows - 1, validate=False)
        tree_lens = (tree.num_nodes + 1).int()
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev)
        qsl[1:] = tree_lens.cumsum(0)
        per_req = -(-(prefix_len + tree_rows) // block_size)
        table = torch.randint(0, num_blocks, (num_reqs, per_req), device=dev,
                              generator=g).int()
        q = torch.randn(num_reqs * tree_rows, num_heads, head_dim, device=dev, dtype=dtype,
                        generator=g)
        prefix = torch.full((num_reqs,), prefix_len, dtype=torch.int32, device=dev)
        return lambda: tree_attention_triton(
            q, key_cache, value_cache, table, prefix, tree_lens, qsl,
            tree.visibility_packed, head_dim ** -0.5, block_q=block_q, block_t=block_t)

    row["tree_attention_warm_up_s"] = wall(attention_call(1, budget + 1))
    verify_kernel = triton_verify._tree_verify_kernel
    attention_kernel = tree_attention._tree_attention_kernel
    before = (_num_compiled(verify_kernel), _num_compiled(attention_kernel))
    slowest = 0.0
    for num_reqs in (1, 3, 8):
        for tree_rows in (2, 3, 5, 16, 17, 33, budget + 1):
            slowest = max(slowest, wall(attention_call(num_reqs, tree_rows)))
            draft = torch.randn(num_reqs, 15, vocab, device=dev, generator=g)
            tree = build_ddtree(draft, tree_rows - 1, validate=False)
            target = torch.randn(num_reqs * tree.num_rows, vocab, device=dev,
                                 dtype=torch.bfloat16, generator=g)
            rows = torch.arange(num_reqs * tree.num_rows, device=dev).view(num_reqs, -1)
            params = TreeSamplingParams.from_lists([0.6] * num_reqs, device=dev)
            for method in ("rejection", "sample_walk"):
                slowest = max(slowest, wall(lambda: verify_tree(  # noqa: B023
                    tree, target, params, method=method, backend="triton",
                    validate=False, row_index=rows, max_tree_depth=max_depth)))
    after = (_num_compiled(verify_kernel), _num_compiled(attention_kernel))
    row.update(steps_slowest_call_s=slowest,
               verify_variants_before_after=[before[0], after[0]],
               tree_attention_variants_before_after=[before[1], after[1]],
               no_compile_after_warm_up=before == after and slowest < 0.2)
    print(json.dumps(row))
    return [row]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="kernel_timing.json")
    parser.add_argument("--only", choices=("all", "verify", "tree_attention", "kv_commit",
                                           "first_run"), default="all")
    args = parser.parse_args()
    dev = torch.device("cuda")
    # First: before any other call compiles the same variants.
    first_run_rows = first_run_compiles(dev) if args.only in ("all", "first_run") else []
    tree_attention_rows = time_tree_attention(dev) if args.only in ("all", "tree_attention") else []
    kv_commit_rows = time_kv_commit(dev) if args.only in ("all", "kv_commit") else []
    depth, vocab = 15, 151_936
    rows = []
    for num_reqs in (1, 16, 64) if args.only in ("all", "verify") else ():
        for budget in (16, 64, 256, 512):
            g = torch.Generator(device=dev).manual_seed(0)
            draft = torch.randn(num_reqs, depth, vocab, device=dev, generator=g)
            draft[:, torch.arange(depth), torch.randint(0, vocab, (depth,), device=dev)] += 12
            shared = cuda_ms(lambda: draft_top_k(draft, min(budget, vocab)))
            tk = draft_top_k(draft, min(budget, vocab))
            build = cuda_ms(lambda: build_ddtree(draft, budget, top_k=tk, validate=False))
            tree = build_ddtree(draft, budget, top_k=tk, validate=False)
            target = torch.randn(num_reqs, tree.num_rows, vocab, device=dev,
                                 dtype=torch.bfloat16, generator=g)
            coins = draw_coins(num_reqs, tree.num_rows, dev)
            row = {"num_reqs": num_reqs, "budget": budget, "top_k_ms": shared,
                   "build_ms": build}
            for label, params, method in (
                ("greedy", None, "rejection"),
                ("t1_sample_walk", TreeSamplingParams.from_lists([1.0] * num_reqs, device=dev),
                 "sample_walk"),
                ("t1_rejection", TreeSamplingParams.from_lists([1.0] * num_reqs, device=dev),
                 "rejection"),
            ):
                ref = verify_tree(tree, target, params, method=method, coins=coins,
                                  backend="torch", validate=False)
                for backend in available_backends(dev):
                    fn = lambda: verify_tree(tree, target, params, method=method,  # noqa: E731
                                             coins=coins, backend=backend, validate=False)
                    out = fn()
                    same = torch.equal(out.committed_tokens, ref.committed_tokens)
                    row[f"{label}_{backend}_ms"] = cuda_ms(fn)
                    row[f"{label}_{backend}_equal"] = same
            print(json.dumps(row))
            rows.append(row)
            del draft, target
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows,
                   "tree_attention": tree_attention_rows, "kv_commit": kv_commit_rows,
                   "first_run": first_run_rows}, f, indent=1)


if __name__ == "__main__":
    main()
