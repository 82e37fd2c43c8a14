# SPDX-License-Identifier: Apache-2.0
"""The plugin never breaks vLLM: on a vLLM other than 0.32 it patches nothing,
warns once, and ``"method": "ddtree"`` fails at start-up naming the version.

Runs in a child process (the plugin disabled there by ``VLLM_PLUGINS=``), where
the installed vLLM reports another ``__version__``.
"""

import pytest

from _server_utils import child_env, run_child_script
from vllm_ddtree import tiny_models

pytest.importorskip("vllm")

SCRIPT = r'''
import json, logging, sys

if __name__ == "__main__":
    args = json.load(open(sys.argv[1]))
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    import vllm
    vllm.__version__ = args["version"]
    from vllm.config.vllm import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    hooked = {
        "runner_init": (GPUModelRunner, "__init__"),
        "process_inputs": (InputProcessor, "process_inputs"),
        "v2_features": (VllmConfig, "_get_v2_model_runner_unsupported_features"),
        "dflash_k_norm": (DFlashQwen3Model, "_normalize_context_k"),
        "cpu_attn_blocks": (CPUAttentionBackend, "get_supported_kernel_block_sizes"),
    }
    before = {k: getattr(c, n) for k, (c, n) in hooked.items()}
    from vllm_ddtree.vllm_adapter import patches
    logging.getLogger(patches.__name__).addHandler(Keep())
    patches.install()
    patches.install()  # idempotent: still one warning
    out = {"unchanged": [k for k, (c, n) in hooked.items() if getattr(c, n) is before[k]],
           "warnings": records}
    plain = EngineArgs(model=args["target"], max_model_len=128, enforce_eager=True)
    out["plain_ok"] = plain.create_engine_config().speculative_config is None
    spec = {"method": "ddtree", "model": args["drafter"], "num_speculative_tokens": 4}
    try:
        EngineArgs(model=args["target"], max_model_len=128, enforce_eager=True,
                   speculative_config=spec).create_engine_config()
        out["ddtree_error"] = None
    except ValueError as e:
        out["ddtree_error"] = str(e)
    json.dump(out, open(sys.argv[2], "w"))
'''


def test_other_vllm_version_patches_nothing_and_refuses_ddtree(tmp_path):
    target = tiny_models.make_target(tmp_path / "target", kind="random", seed=1)
    drafter = tiny_models.make_dflash_drafter(tmp_path / "drafter", target, block_size=5)
    out = run_child_script(
        SCRIPT,
        {"version": "0.33.1", "target": str(target), "drafter": str(drafter)},
        tmp_path, "other_version", child_env(VLLM_PLUGINS=""), timeout=300,
    )
    assert sorted(out["unchanged"]) == sorted(
        ["runner_init", "process_inputs", "v2_features", "dflash_k_norm",
         "cpu_attn_blocks"])
    assert len(out["warnings"]) == 1 and "0.33.1" in out["warnings"][0]
    assert out["plain_ok"]
    assert out["ddtree_error"] is not None
    assert "supports vLLM 0.32.x only" in out["ddtree_error"]
    assert "0.33.1" in out["ddtree_error"]
