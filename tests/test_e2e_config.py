# SPDX-License-Identifier: Apache-2.0
"""Bad ddtree configurations fail at start-up with an error that names the problem."""

import json

import pytest

from vllm_ddtree import tiny_models

vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def root(tmp_path_factory, vllm_patched):
    return tmp_path_factory.mktemp("config")


@pytest.fixture(scope="module")
def pair(root):
    target = tiny_models.make_target(root / "target", kind="random", seed=5)
    drafter = tiny_models.make_dflash_drafter(root / "drafter", target, block_size=5, seed=6)
    return str(target), str(drafter)


def start(target, spec):
    return vllm.LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=256,
                    speculative_config=spec)


def ddtree(drafter, budget=8, **extra):
    return {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget,
            "ddtree_budget": "fixed", **extra}


def test_drafter_hidden_size_must_match(root, pair):
    other = tiny_models.make_target(root / "wide_target", kind="random", hidden_size=192,
                                    num_heads=3, seed=7)
    with pytest.raises(ValueError, match="hidden_size"):
        start(str(other), ddtree(pair[1]))


def test_drafter_vocab_must_match(root, pair):
    other = tiny_models.make_target(root / "big_vocab_target", kind="random",
                                    vocab_size=384, seed=8)
    with pytest.raises(ValueError, match="vocab_size"):
        start(str(other), ddtree(pair[1]))


def test_mask_token_must_be_in_vocab(root, pair):
    bad = tiny_models.make_dflash_drafter(root / "bad_mask_drafter", pair[0], block_size=5)
    cfg_path = root / "bad_mask_drafter" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dflash_config"]["mask_token_id"] = 100_000
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mask_token_id"):
        start(pair[0], ddtree(str(bad)))


def test_draft_len_needs_block_size_or_key(root, pair):
    bad = tiny_models.make_dflash_drafter(root / "no_block_drafter", pair[0], block_size=5)
    cfg_path = root / "no_block_drafter" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("block_size", None)
    cfg["dflash_config"].pop("block_size", None)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="ddtree_draft_len"):
        start(pair[0], ddtree(str(bad)))


def test_target_without_aux_hidden_states_is_refused(root, pair):
    """A target architecture that cannot return aux hidden states cannot feed DFlash."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = root / "gpt2_target"
    config = GPT2Config(n_embd=128, n_head=2, n_layer=4, vocab_size=320, n_positions=512,
                        bos_token_id=tiny_models.EOS_TOKEN_ID,
                        eos_token_id=tiny_models.EOS_TOKEN_ID)
    GPT2LMHeadModel(config).save_pretrained(path)
    tiny_models.write_tokenizer(path)
    with pytest.raises(ValueError, match="aux"):
        start(str(path), ddtree(pair[1]))


def test_refused_engine_options(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match="disable_padded_drafter_batch"):
        start(target, ddtree(drafter, disable_padded_drafter_batch=True))
    with pytest.raises(ValueError, match="async"):
        vllm.LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=256,
                 async_scheduling=True, speculative_config=ddtree(drafter))


def test_stray_ddtree_keys_need_the_method(pair):
    target, drafter = pair
    # (Not the default value: in-tree, a typed field cannot tell "set to the
    # default" from "unset".)
    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": 4,
            "ddtree_verify": "sample_walk"}
    with pytest.raises(ValueError, match="need \"method\": \"ddtree\""):
        start(target, spec)


def test_gpu_platform_is_refused_until_tree_attention_lands(pair, monkeypatch):
    """Without a tree attention backend the GPU verify pass would be causal: refuse."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    with pytest.raises(ValueError, match="CPU attention backend only"):
        start(pair[0], ddtree(pair[1]))


def test_pipeline_parallel_is_refused_at_start_up(pair):
    """PP = 2: only the last rank proposes, so rank 0 would verify causal chains."""
    target, drafter = pair
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        vllm.LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=256,
                 pipeline_parallel_size=2, speculative_config=ddtree(drafter))


def test_auto_budget_with_tensor_parallelism_is_refused_at_start_up(pair):
    """Each worker would time its own steps and trim its own trees."""
    target, drafter = pair
    with pytest.raises(ValueError, match="ddtree_budget='auto'.*tensor_parallel_size=2"):
        vllm.LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=256,
                 tensor_parallel_size=2,
                 speculative_config={**ddtree(drafter), "ddtree_budget": "auto"})


def test_budget_defaults_to_auto(pair):
    """ddtree_budget unset: "auto" on one worker (tensor parallelism resolves it to
    "fixed": tests/test_tensor_parallel.py)."""
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = pair
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 8}
    config = EngineArgs(model=target, dtype="float32", enforce_eager=True, max_model_len=256,
                        speculative_config=spec).create_engine_config()
    assert config.speculative_config.ddtree.budget_mode == "auto"
    pinned = {**spec, "ddtree_budget": "fixed"}
    config = EngineArgs(model=target, dtype="float32", enforce_eager=True, max_model_len=256,
                        speculative_config=pinned).create_engine_config()
    assert config.speculative_config.ddtree.budget_mode == "fixed"


def test_start_up_says_ddtree_is_on_with_its_settings(pair):
    """vLLM's engine log names the DFlash plumbing ("dflash"); ddtree's own line,
    through vLLM's logger, says ddtree verifies the trees and with what."""
    import logging

    from vllm.engine.arg_utils import EngineArgs

    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    vllm_logger = logging.getLogger("vllm")
    handler, level = Keep(logging.INFO), vllm_logger.level
    vllm_logger.addHandler(handler)
    vllm_logger.setLevel(logging.INFO)
    try:
        EngineArgs(model=pair[0], dtype="float32", enforce_eager=True, max_model_len=256,
                   speculative_config=ddtree(pair[1], ddtree_max_children=3)
                   ).create_engine_config()
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(level)
    (line,) = [m for m in messages if m.startswith("ddtree: DDTree tree verification on")]
    assert "budget=8" in line and "max_children=3" in line and "draft_len=4" in line, line


def test_dynamic_sd_table_is_refused_at_start_up(pair):
    """vLLM's num_speculative_tokens_per_batch_size with ddtree: a clear error
    naming the key and what to use instead."""
    target, drafter = pair
    spec = {**ddtree(drafter), "num_speculative_tokens_per_batch_size": [(1, 4, 2)]}
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size.*auto"):
        vllm.LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=256,
                 speculative_config=spec)


def test_quantized_kv_cache_is_refused_at_start_up(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        vllm.LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=256,
                 kv_cache_dtype="fp8", speculative_config=ddtree(drafter))


def test_hybrid_target_gets_prefix_caching_off(root, pair):
    """A Qwen3-Next-shaped target (Gated DeltaNet + full attention layers) with
    prefix caching (vLLM's default) starts with prefix caching off and a warning
    saying why, before the model's config hooks pick the recurrent-state cache
    mode: vLLM caches recurrent states per block with copies keyed to linear
    draft positions. Only the config is built (no weights); without ddtree the
    same target keeps vLLM's default."""
    import logging

    from transformers import Qwen3NextConfig
    from vllm.engine.arg_utils import EngineArgs

    path = root / "qwen3_next_target"
    Qwen3NextConfig(
        architectures=["Qwen3NextForCausalLM"], vocab_size=320, hidden_size=128,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        intermediate_size=256, moe_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, linear_num_key_heads=1, linear_num_value_heads=1,
        linear_key_head_dim=128, linear_value_head_dim=128,
        layer_types=["linear_attention", "full_attention"] * 2, dtype="bfloat16",
    ).save_pretrained(str(path))
    tiny_models.write_tokenizer(path)
    warnings = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    vllm_logger = logging.getLogger("vllm")
    handler = Keep(logging.WARNING)
    vllm_logger.addHandler(handler)
    try:
        configs = [
            EngineArgs(model=str(path), dtype="bfloat16", enforce_eager=True,
                       max_model_len=256, speculative_config=spec).create_engine_config()
            for spec in (ddtree(pair[1]), None)
        ]
    finally:
        vllm_logger.removeHandler(handler)
    with_ddtree, without = (c.cache_config for c in configs)
    assert not with_ddtree.enable_prefix_caching
    assert with_ddtree.mamba_cache_mode == "none"
    assert without.enable_prefix_caching  # vLLM's default, untouched
    assert any("prefix caching turned off" in w and "hybrid" in w for w in warnings)


def test_layer_refusals_fail_the_engine_start_not_a_request(pair, monkeypatch):
    """A layer feature only the built model knows fails LLM(...) itself."""
    from vllm_ddtree.vllm_adapter.cpu_attention import DDTreeCPUAttentionImpl

    monkeypatch.setattr(DDTreeCPUAttentionImpl, "tree_refusals",
                        lambda self: {"attention sinks": True})
    with pytest.raises(Exception, match="model.layers.0.self_attn.attn: DDTree tree "
                                        "attention on CPU does not support attention "
                                        "sinks"):
        start(pair[0], ddtree(pair[1]))


def test_options_reach_the_engine_config(pair):
    """The ddtree options as the engine sees them. In vLLM with ddtree in-tree
    (the patch series), ``"ddtree"`` is the config's method, its options are
    typed fields, and they are part of the config's hash and repr; the plugin
    runs vLLM's DFlash config with the options attached."""
    from vllm.config.speculative import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = pair

    def engine_spec(**extra):
        return EngineArgs(model=target, dtype="float32", enforce_eager=True,
                          max_model_len=256, speculative_config=ddtree(drafter, **extra)
                          ).create_engine_config().speculative_config

    spec = engine_spec(ddtree_verify="sample_walk", ddtree_max_children=3)
    assert spec.ddtree.verify == "sample_walk" and spec.ddtree.max_children == 3
    assert spec.ddtree.draft_len == 4  # block_size 5 - 1, resolved at start-up
    if hasattr(SpeculativeConfig, "use_ddtree"):  # in-tree
        assert spec.method == "ddtree" and spec.use_ddtree() and spec.use_dflash()
        assert "method='ddtree'" in repr(spec)
        assert spec.ddtree_verify == "sample_walk" and spec.ddtree_draft_len == 4
        assert spec.compute_hash() != engine_spec().compute_hash()
    else:  # the plugin
        assert spec.method == "dflash"


def test_a_cuda_ddtree_engine_resolves_piecewise_graphs(pair, monkeypatch):
    """On CUDA (faked: the platform's ``is_cuda`` and static-graph support, the
    opt-in set) a ddtree engine is compiled, captures piecewise CUDA graphs
    only (its tree plans are built on the host per step: a full graph would
    replay one step's), fuses no quantization into attention, and runs
    TRITON_ATTN; asked for eager, it stays eager. The series used to run the
    check after vLLM had resolved compilation and graphs (they stayed full)."""
    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from vllm.plugins import load_general_plugins

    target, drafter = pair

    def config(**kwargs):
        return EngineArgs(model=target, dtype="float32", max_model_len=256,
                          speculative_config=ddtree(drafter), **kwargs
                          ).create_engine_config()

    # Once on the real platform: the plugin's and the model registry's imports
    # (they import CUDA-only modules on a faked CUDA).
    load_general_plugins()
    config()
    monkeypatch.setenv("VLLM_DDTREE_UNVALIDATED_GPU", "1")
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    # The CPU platform's own settings (no CUDA graphs there) would hide ours.
    monkeypatch.setattr(type(current_platform), "check_and_update_config",
                        classmethod(lambda cls, vllm_config: None))
    monkeypatch.setattr(type(current_platform), "support_static_graph_mode",
                        classmethod(lambda cls: True))
    resolved = config()
    assert not resolved.model_config.enforce_eager
    assert resolved.compilation_config.mode == CompilationMode.VLLM_COMPILE
    assert resolved.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert resolved.compilation_config.pass_config.fuse_attn_quant is False
    assert resolved.attention_config.backend.name == "TRITON_ATTN"
    eager = config(enforce_eager=True)
    assert eager.compilation_config.mode == CompilationMode.NONE
    assert eager.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    # Without ddtree's settings the same faked engine would capture full graphs.
    plain = EngineArgs(model=target, dtype="float32", max_model_len=256
                       ).create_engine_config()
    assert plain.compilation_config.cudagraph_mode.has_full_cudagraphs()

