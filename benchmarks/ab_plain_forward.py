# SPDX-License-Identifier: Apache-2.0
"""The plain-step target forward of ddtree-auto engines vs no speculation, batch 1.

Diagnostic for bench_budget's per-engine bias: engines are created in the order
given (e.g. ``auto,nospec,auto2``: names starting with "auto" are ddtree with the
default auto budget, B = 64; others run without speculation), all stay alive,
and 8 prompts (2 per dataset) x 64 tokens run on each, interleaved, twice (the
second pass in reverse engine order). Per engine: ``_model_forward`` seconds of
steps without a tree ("plain") and with one, and the wall time.

    .venv/bin/python benchmarks/ab_plain_forward.py auto,nospec,auto2
"""
import os, sys, time, json
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, "benchmarks")
import bench_real  # noqa
from bench_real import DEFAULT_DRAFTER
import vllm, vllm_ddtree
vllm_ddtree.register()
from vllm_ddtree import assets
from transformers import AutoTokenizer
order = sys.argv[1].split(",")
tgt = assets.smollm2_target()
tok = AutoTokenizer.from_pretrained(tgt)
prompts = []
for ds in ("humaneval", "mtbench", "gsm8k", "sharegpt"):
    try:
        texts = assets.load_prompts(ds, 2, tok, seed=1, max_prompt_tokens=256, split="eval" if ds == "sharegpt" else "all")
    except Exception as e:  # a dataset package missing: the others still run
        print("skip", ds, e); continue
    prompts += [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
engines = {}
for name in order:
    spec = None
    if name.startswith("auto"):
        spec = {"method": "ddtree", "model": str(DEFAULT_DRAFTER), "num_speculative_tokens": 64}
    llm = vllm.LLM(model=tgt, dtype="float32", enforce_eager=True, seed=0, max_model_len=512, max_num_seqs=1,
                   enable_prefix_caching=False, speculative_config=spec)
    r = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    st = {"plain_s": 0.0, "plain_n": 0, "tree_s": 0.0, "tree_n": 0, "wall": 0.0}
    orig = r._model_forward
    def wrapped(*a, _orig=orig, _r=r, _st=st, **k):
        t = time.perf_counter(); out = _orig(*a, **k); dt = time.perf_counter() - t
        tree = getattr(getattr(_r, "ddtree", None), "_step", None) is not None
        _st["tree_s" if tree else "plain_s"] += dt; _st["tree_n" if tree else "plain_n"] += 1
        return out
    r._model_forward = wrapped
    engines[name] = (llm, st)
p = vllm.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
for llm, _ in engines.values():
    llm.generate([{"prompt_token_ids": prompts[0]}], p, use_tqdm=False)
for llm, st in engines.values():
    for k in st: st[k] = 0 if k.endswith("_n") else 0.0
for rep in range(2):
    for pr in prompts:
        for name in (order if rep % 2 == 0 else order[::-1]):
            llm, st = engines[name]
            t = time.perf_counter(); llm.generate([{"prompt_token_ids": pr}], p, use_tqdm=False); st["wall"] += time.perf_counter() - t
res = {}
for name, (_, st) in engines.items():
    res[name] = dict(st, plain_ms=1e3 * st["plain_s"] / max(st["plain_n"], 1))
    print(name, json.dumps({k: round(v, 3) for k, v in res[name].items()}))
