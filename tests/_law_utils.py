# SPDX-License-Identifier: Apache-2.0
"""Two-sample law tests and engine helpers shared by the end-to-end tests."""

import gc
import math
from collections import Counter

DELTA = 1e-6


def tv_bound(num_cells: int, n1: int, n2: int, delta: float = DELTA) -> float:
    """TV between the empirical laws of two independent samples (n1, n2 draws) of
    one law on at most k cells exceeds this with probability < delta:
    E|p1_i - p2_i| <= sqrt(p_i (1 - p_i) (1/n1 + 1/n2)) and, by Cauchy-Schwarz,
    sum_i sqrt(p_i (1 - p_i)) <= sqrt(k - 1), so E[TV] <= 0.5 sqrt((k - 1) s) with
    s = 1/n1 + 1/n2; a draw moves TV by at most 1/n1 (resp. 1/n2), so McDiarmid gives
    P(TV > E[TV] + t) <= exp(-2 t^2 / s): t = sqrt(ln(1/delta) s / 2)."""
    s = 1.0 / n1 + 1.0 / n2
    return 0.5 * math.sqrt((num_cells - 1) * s) + math.sqrt(math.log(1 / delta) * s / 2)


def joint_tv(a_outs, b_outs, cut) -> tuple[float, int]:
    """TV between the empirical laws of ``o[cut]`` over two lists of outputs, and
    the number of cells the first one visits."""
    a = Counter(tuple(o[cut]) for o in a_outs)
    b = Counter(tuple(o[cut]) for o in b_outs)
    cells = set(a) | set(b)
    tv = 0.5 * sum(abs(a[c] / len(a_outs) - b[c] / len(b_outs)) for c in cells)
    return tv, len(a)


def sample_engine(target, prompt, params, n, spec=None, seed=0, **engine_kw):
    """``n`` outputs of ``prompt`` from an in-process engine of ``target`` (with
    ``spec`` as its speculative config), and, for ddtree, the engine's accepted
    tokens and sibling paths (``branch_paths``)."""
    import vllm

    engine_kw = {
        "enforce_eager": True,
        "max_model_len": 256,
        "max_num_batched_tokens": 2048,
        **engine_kw,
    }
    llm = vllm.LLM(
        model=target,
        disable_log_stats=False,
        speculative_config=spec,
        seed=seed,
        **engine_kw,
    )
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    stats = {}
    if spec is not None:
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        core = llm.llm_engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        stats = {
            "accepted": metrics.get("vllm:spec_decode_num_accepted_tokens", 0),
            "branch_paths": int(runner.ddtree.num_branch_paths),
        }
        del runner, core
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], stats


def _emitted_logprobs(completion) -> list[float]:
    """The logprob of each emitted token ([] without logprobs)."""
    if completion.logprobs is None:
        return []
    steps = zip(completion.token_ids, completion.logprobs, strict=True)
    return [step[token].logprob for token, step in steps]


def generate_turns(llm, prompt_ids, params, turns=1, logprobs=None):
    """Outputs (token ids) of ``prompt_ids`` on ``llm`` and, with ``turns=2``,
    of a second turn on the same engine: each prompt + its first answer + 5 more
    tokens (a list per turn). With ``logprobs`` (a list; ``params`` asks for
    logprobs), the emitted tokens' logprobs are appended to it in the same
    shape."""
    tokens, scores = [], []
    for _ in range(turns):
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False
        )
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
        scores.append([_emitted_logprobs(o.outputs[0]) for o in outs])
        prompt_ids = [
            p + t + [1, 2, 3, 4, 5] for p, t in zip(prompt_ids, tokens[-1], strict=True)
        ]
    if logprobs is not None:
        logprobs.extend(scores[0] if turns == 1 else scores)
    return tokens[0] if turns == 1 else tokens
