# SPDX-License-Identifier: Apache-2.0
"""ddtree with the multiprocess engine (VLLM_ENABLE_V1_MULTIPROCESSING=1).

The offline ``LLM`` then runs the engine core and the worker in spawned
processes: the plugin must load there through its ``vllm.general_plugins`` entry
point, and the ``DDTreeConfig`` hung on the ``SpeculativeConfig`` must survive
pickling to them. Everything runs in one child process (spawned engines need a
``__main__`` guard, and the test session keeps its in-process default), which
computes plain greedy references and ddtree outputs for the random and the
oracle pair.

The oracle pair proves the worker runs the DDTree runner, not vLLM's plain
DFlash path: with budget B = 16 > L = block_size - 1 = 4, DDTree accepts exactly
L + 1 tokens per step (no accepted position >= L), whereas DFlash with
``num_speculative_tokens=16`` would accept all 16 drafts.
"""

import pytest

from _server_utils import child_env, run_child_script

pytest.importorskip("vllm")

BLOCK_SIZE = 5
L = BLOCK_SIZE - 1
BUDGET = {"random": 8, "oracle": 16}
MAX_TOKENS = 32

CHILD = r'''
import json, pickle, sys


def refused_prebuilt_request(llm, vllm, params):
    """A request built past the frontend check (a thinking budget set after
    process_inputs) sent to the engine core process as LLMEngine would: the
    engine answers it with FinishReason.ERROR and serves the next request."""
    engine = llm.llm_engine
    request = engine.input_processor.process_inputs(
        "prebuilt", {"prompt_token_ids": [1, 2, 3]}, vllm.SamplingParams(max_tokens=4),
        supported_tasks=engine.get_supported_tasks())
    request.sampling_params.thinking_token_budget = 8
    engine.input_processor.assign_request_id(request)
    engine.output_processor.add_request(request, None, None, 0)
    engine.engine_core.add_request(request)
    finished = []
    for _ in range(200):
        finished += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    after = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    return {"finished": [(o.request_id.split("-")[0], o.outputs[0].finish_reason, list(o.outputs[0].token_ids))
                         for o in finished],
            "next_request_tokens": len(after[0].outputs[0].token_ids)}


def main():
    args = json.load(open(sys.argv[1]))
    import vllm
    from vllm_ddtree.vllm_adapter.config import DDTreeConfig

    result = {}
    params = vllm.SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in args["prompts"]]
    for kind, (target, drafter, budget) in args["pairs"].items():
        for mode in ("plain", "ddtree"):
            spec = None
            if mode == "ddtree":
                # The drafter's trees (depth <= L) alone: lookup paths may run deeper.
                spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget,
                        "ddtree_budget": "fixed", "ddtree_lookup": "off"}
            llm = vllm.LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=512,
                           disable_log_stats=False, speculative_config=spec, seed=0)
            outs = llm.generate(prompts, params, use_tqdm=False)
            metrics = {}
            for m in llm.get_metrics():
                if m.name.startswith("vllm:spec_decode"):
                    metrics[m.name] = m.values if hasattr(m, "values") else m.value
            entry = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "metrics": metrics,
                     "engine_client": type(llm.llm_engine.engine_core).__name__}
            if spec is not None and kind == "random":
                entry["prebuilt_refused"] = refused_prebuilt_request(llm, vllm, params)
            if spec is not None:
                sc = llm.llm_engine.vllm_config.speculative_config
                ddt = getattr(sc, "ddtree", None)
                again = pickle.loads(pickle.dumps(sc))
                entry["method"] = sc.method
                entry["ddtree"] = repr(ddt)
                entry["ddtree_is_config"] = isinstance(ddt, DDTreeConfig)
                entry["ddtree_pickles"] = getattr(again, "ddtree", None) == ddt
            result[f"{kind}/{mode}"] = entry
            llm.llm_engine.engine_core.shutdown()
            del llm
    json.dump(result, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import random

    from vllm_ddtree import tiny_models

    root = tmp_path_factory.mktemp("mp")
    pairs = {}
    for kind in ("random", "oracle"):
        target = tiny_models.make_target(root / f"{kind}_target", kind=kind, seed=1)
        drafter = tiny_models.make_dflash_drafter(
            root / f"{kind}_drafter", target, kind=kind, block_size=BLOCK_SIZE, seed=2
        )
        pairs[kind] = (target, drafter, BUDGET[kind])
    rng = random.Random(0)
    prompts = [[rng.randrange(250) for _ in range(rng.randrange(2, 40))] for _ in range(4)]
    env = child_env(VLLM_ENABLE_V1_MULTIPROCESSING="1")
    args = {"pairs": pairs, "prompts": prompts, "max_tokens": MAX_TOKENS}
    return run_child_script(CHILD, args, root, "mp_child", env, timeout=480)


def test_engine_core_runs_in_another_process(run):
    for key, entry in run.items():
        assert "MPClient" in entry["engine_client"], (key, entry["engine_client"])


def test_ddtree_config_attached_and_pickles(run):
    for kind in BUDGET:
        entry = run[f"{kind}/ddtree"]
        assert entry["method"] == "dflash", entry
        assert entry["ddtree_is_config"], entry
        assert entry["ddtree_pickles"], entry
        assert f"budget={BUDGET[kind]}" in entry["ddtree"] and f"draft_len={L}" in entry["ddtree"]


def test_prebuilt_refused_request_fails_alone(run):
    """Issue 12.5: a request that skipped the frontend check and asks for a
    parameter ddtree does not honour finishes with an error, with no token, and
    the engine core process keeps serving."""
    entry = run["random/ddtree"]["prebuilt_refused"]
    assert entry["finished"] == [["prebuilt", "error", []]], entry
    assert entry["next_request_tokens"] == MAX_TOKENS, entry


@pytest.mark.parametrize("kind", ["random", "oracle"])
def test_greedy_equals_plain(run, kind):
    plain, tree = run[f"{kind}/plain"], run[f"{kind}/ddtree"]
    assert all(len(t) == MAX_TOKENS for t in plain["tokens"])
    assert tree["tokens"] == plain["tokens"]
    assert not plain["metrics"].get("vllm:spec_decode_num_drafts")
    assert tree["metrics"]["vllm:spec_decode_num_drafts"] > 0, tree["metrics"]


def test_oracle_accepts_full_depth_in_spawned_worker(run):
    m = run["oracle/ddtree"]["metrics"]
    drafts = m["vllm:spec_decode_num_drafts"]
    accepted = m["vllm:spec_decode_num_accepted_tokens"]
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert m["vllm:spec_decode_num_draft_tokens"] == drafts * BUDGET["oracle"], m
    assert len(per_pos) == BUDGET["oracle"], m
    # DDTree: depth at most L, so nothing is accepted at draft positions >= L ...
    assert sum(per_pos[L:]) == 0, m
    assert sum(per_pos) == accepted, m
    # ... and the oracle drafter's path is accepted to full depth nearly always.
    mean_acceptance_length = 1 + accepted / drafts
    assert 0.9 * (L + 1) <= mean_acceptance_length <= L + 1, m
