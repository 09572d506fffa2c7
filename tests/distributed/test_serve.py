"""``tools/serve.py`` through the ``openai`` client, as users ask it, and ``tools/generate.py`` on ranks:
a tiny random MoE model imported from a Hugging Face checkpoint, answers compared with transformers'
``generate`` on that checkpoint, streamed against whole, batched against alone, one process against
TP = 2 (and EP = 2 for generate); bad requests answered with a 4xx naming the field while the server
goes on."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import openai
import pytest
import torch
from hf_checkpoints import write_hf_checkpoint
from hf_generate import hf_greedy
from tiny_processor import QWEN35_CHAT_TEMPLATE, build_processor, png_bytes, tiny_shape_for

from examples.multimodal_dev.tools import convert_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "tiny-vl"
LIMITS = ["--max-tokens", "24", "--max-request-bytes", "60000", "--max-images", "2", "--max-image-pixels", "10000"]
LIMITS += ["--request-timeout", "2"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, mcore):
    """An imported tiny MoE checkpoint whose vocabulary is the tiny tokenizer's (answers read as text)."""
    root = tmp_path_factory.mktemp("serve")
    processor_dir = build_processor(str(root / "hf"), chat_template=QWEN35_CHAT_TEMPLATE)
    shape = tiny_shape_for(processor_dir, moe=True)
    shape = replace(shape, text=replace(shape.text, vocab_size=128))
    write_hf_checkpoint(root / "hf", shape, dtype=torch.float32)
    assert convert_checkpoint.main(["import", "--hf-path", str(root / "hf"), "--megatron-path", str(root / "mg")]) == 0
    (root / "red.png").write_bytes(png_bytes((64, 48), (200, 40, 40)))
    return root


@contextlib.contextmanager
def running(root, *flags, stop_with=signal.SIGINT):
    """A server on a free port: (base URL, its stderr lines so far). At the end ``stop_with`` goes to
    the PID started (Ctrl-C's SIGINT, or a supervisor's SIGTERM), and every process of the server (its
    torchrun and ranks) must be gone within 30 s; whatever is left is killed and the test fails."""
    import psutil

    argv = [sys.executable, "-m", "examples.multimodal_dev.tools.serve", "--megatron-path", str(root / "mg")]
    argv += ["--hf-processor-path", str(root / "hf"), "--port", "0", "--served-model-name", NAME, *LIMITS, *flags]
    proc = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    tree = [psutil.Process(proc.pid)]
    lines: list[str] = []
    listening = threading.Event()

    def drain():
        for line in proc.stderr:
            lines.append(line)
            if "serve: listening on" in line:
                listening.set()
        listening.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert listening.wait(300) and proc.poll() is None, "".join(lines[-30:])
        tree += tree[0].children(recursive=True)
        url = re.search(r"listening on (http://\S+)", "".join(lines)).group(1)
        yield url, lines
        proc.send_signal(stop_with)
        _, left = psutil.wait_procs(tree, timeout=30)
        assert not left, f"{stop_with.name} left {[p.pid for p in left]} of the server's {len(tree)} processes"
    finally:
        for process in tree:  # whatever failed, nothing of the server outlives the test
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        proc.wait(60)


@pytest.fixture(scope="module")
def server(checkpoint):
    with running(checkpoint) as (url, lines):
        yield url, lines


def post(url: str, body: bytes) -> tuple[int, dict]:
    """(status, JSON answer) of a raw POST: what a client other than openai's sends."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def image_url(root) -> str:
    return "data:image/png;base64," + base64.b64encode((root / "red.png").read_bytes()).decode()


def ask(url, content, **settings):
    settings = {"max_tokens": 12, "temperature": 0, **settings}
    return client(url).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": content}], extra_body={"return_token_ids": True}, **settings
    )


def image_question(root):
    return [{"type": "image_url", "image_url": {"url": image_url(root)}}, {"type": "text", "text": "What colour?"}]


def test_greedy_answers_equal_transformers_generate(checkpoint, server):
    from examples.multimodal_dev.data.jsonl import prompt_reader
    from examples.multimodal_dev.data.processor import answer_text

    url, _ = server
    reader = prompt_reader(str(checkpoint / "hf"), 8192)
    for content, record_content in (
        ("Hello there?", [{"type": "text", "text": "Hello there?"}]),
        (
            image_question(checkpoint),
            [{"type": "image", "image": image_url(checkpoint)}, image_question(checkpoint)[1]],
        ),
    ):
        answer = ask(url, content)
        record = {"messages": [{"role": "user", "content": record_content}]}
        sample, _ = reader.prompt_sample(json.dumps(record), str(checkpoint), "test")
        expected = hf_greedy(
            checkpoint / "hf", sample["input_ids"].tolist(), 12, sample["pixel_values"], sample["image_grid_thw"]
        )
        choice = answer.choices[0]
        assert choice.token_ids == expected
        assert choice.message.content == answer_text(reader.processor, expected)
        assert answer.usage.prompt_tokens == len(sample["input_ids"]) and answer.usage.completion_tokens == len(
            expected
        )
        assert choice.finish_reason == ("length" if len(expected) == 12 else "stop")


def _streamed(url, content, **settings):
    chunks = list(
        client(url).chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": content}],
            stream=True,
            stream_options={"include_usage": True},
            **{"max_tokens": 12, "temperature": 0, **settings},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, finish, chunks[-1].usage, sum(1 for c in chunks if c.choices and c.choices[0].delta.content)


def test_streamed_equals_whole_with_and_without_stop_strings(checkpoint, server):
    url, _ = server
    whole = ask(url, "Say something.", max_tokens=20)
    text = whole.choices[0].message.content
    assert len(text) >= 6, f"the tiny model's answer is too short to cut: {text!r}"
    stop = text[3:5]
    cut = ask(url, "Say something.", max_tokens=20, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    for settings, answer in (({}, whole), ({"stop": [stop]}, cut)):
        streamed, finish, usage, pieces = _streamed(url, "Say something.", max_tokens=20, **settings)
        assert (streamed, finish) == (answer.choices[0].message.content, [answer.choices[0].finish_reason])
        assert usage.completion_tokens == answer.usage.completion_tokens
        assert pieces > 1 or len(streamed) <= 1  # it came as it grew, not at once


def test_concurrent_requests_are_batched_and_each_equals_alone(checkpoint, server):
    url, lines = server
    asks = [("Count %d." % i, {"max_tokens": 4 + i}) for i in range(6)]
    asks += [(image_question(checkpoint), {}), ("Pick.", {"temperature": 0.8, "top_p": 0.9, "seed": 7})]
    alone = [ask(url, content, **settings).choices[0].token_ids for content, settings in asks]
    before = len(lines)
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda a: ask(url, a[0], **a[1]).choices[0].token_ids, asks))
    assert together == alone
    batches = [int(m) for m in re.findall(r"a batch of (\d+) request", "".join(lines[before:]))]
    assert max(batches) > 1, batches


BAD = [
    ("not json", b"{'model':", 400, None),
    ("unknown model", {"model": "other"}, 404, "model"),
    ("over max_tokens", {"max_tokens": 25}, 400, "max_tokens"),
    ("a file path", {"image": "/etc/passwd"}, 400, "messages[0].content[0].image_url.url"),
    ("a text data URL", {"image": "data:text/plain;base64,aGVsbG8="}, 400, "messages[0].content[0].image_url.url"),
    ("too many pixels", {"image": "big"}, 400, "messages[0].content[0].image_url.url"),
    ("too large a body", {"padding": "x" * 70000}, 413, None),
    ("a prompt past the limit", {"text": "many words " * 1000}, 400, "messages"),
]


def _bad_body(checkpoint, change) -> bytes:
    if isinstance(change, bytes):
        return change
    image = change.get("image")
    if image == "big":
        image = "data:image/png;base64," + base64.b64encode(png_bytes((200, 100), (1, 2, 3))).decode()
    content = [{"type": "text", "text": change.get("text", "Hi")}]
    if image:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    body = {"model": change.get("model", NAME), "messages": [{"role": "user", "content": content}]}
    body.update({k: v for k, v in change.items() if k in ("max_tokens", "padding")})
    return json.dumps(body).encode()


@pytest.mark.parametrize("what,change,status,param", BAD, ids=[b[0] for b in BAD])
def test_a_bad_request_is_a_4xx_naming_the_field_and_the_server_goes_on(
    checkpoint, server, what, change, status, param
):
    url, _ = server
    code, answer = post(f"{url}/v1/chat/completions", _bad_body(checkpoint, change))
    assert code == status, answer
    error = answer["error"]
    assert error["param"] == param and "\n" not in error["message"], error
    assert param is None or param.split("[")[0].split(".")[0] in error["message"], error
    assert ask(url, "Still there?", max_tokens=2).choices[0].token_ids  # the next request is answered


def test_a_misspelt_field_is_refused_by_name_through_the_openai_client(server):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as refused:
        client(url).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Hi"}], extra_body={"max_token": 2}
        )
    error = refused.value.body
    assert error["param"] == "max_token" and "did you mean 'max_tokens'?" in error["message"], error


def _raw_exchange(url: str, head: bytes, body_parts=(), wait_s: float = 10.0) -> bytes:
    """What the server answers on a connection that sends ``head`` and ``body_parts``, then waits (a
    client that stalls), until the server closes it or ``wait_s`` passes."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as conn:
        conn.sendall(head)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused mid-body, the rest unread
            for part in body_parts:
                conn.sendall(part)
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := conn.recv(65536):
                answer += chunk
        return answer


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize(
    "sent",
    [HEAD, HEAD + b"Content-Length: 500\r\n\r\n" + b'{"model": '],
    ids=["half the headers", "part of the body"],
)
def test_a_request_sent_in_part_is_answered_408_at_the_request_timeout(server, sent):
    url, _ = server
    answer = _raw_exchange(url, sent)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]  # the server's answer: not the client giving up
    assert ask(url, "Still there?", max_tokens=2).choices[0].token_ids


def test_a_chunked_body_past_the_limit_is_refused_while_it_is_read(server):
    url, _ = server
    chunk = b"x" * 16384
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 64 + [b"0\r\n\r\n"]  # 1 MiB against 60,000 bytes
    answer = _raw_exchange(url, HEAD + b"Transfer-Encoding: chunked\r\n\r\n", parts)
    assert answer.startswith(b"HTTP/1.1 413") and b"passed 60000 bytes" in answer, answer[:300]


def test_unknown_routes_and_the_model_list(server):
    url, _ = server
    assert [m.id for m in client(url).models.list()] == [NAME]
    code, answer = post(f"{url}/v1/completions", b"{}")
    assert code == 404 and "no route" in answer["error"]["message"], answer


def test_the_documented_curl_and_openai_examples_run(checkpoint, server, tmp_path, monkeypatch):
    url, _ = server
    page = open(os.path.join(ROOT, "docs", "generation.md")).read()
    section = page[page.index("## Serve a checkpoint") :]
    port = url.rsplit(":", 1)[1]
    curl = re.search(r"curl (\S+) .*?-d '(\{.*?\})'", section, re.S)
    assert curl, "docs/generation.md shows a curl request"
    body = {**json.loads(curl.group(2).replace("run1", NAME)), "max_tokens": 8}  # under the test's --max-tokens
    code, answer = post(curl.group(1).replace("8000", port), json.dumps(body).encode())
    assert code == 200 and answer["choices"][0]["message"]["role"] == "assistant", answer
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    example = example.replace("8000", port).replace('"run1"', repr(NAME)).replace("max_tokens=64", "max_tokens=8")
    assert "max_tokens=8" in example
    monkeypatch.chdir(checkpoint)
    (checkpoint / "receipt.png").write_bytes((checkpoint / "red.png").read_bytes())
    exec(compile(example, "docs/generation.md", "exec"), {})


def test_a_server_at_tp2_answers_as_one_process(checkpoint, server):
    url, _ = server
    questions = ["Hello there?", image_question(checkpoint)]
    alone = [ask(url, q).choices[0].token_ids for q in questions]
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    with running(checkpoint, *tp2, stop_with=signal.SIGTERM) as (tp_url, lines):  # every rank gone after
        assert [ask(tp_url, q).choices[0].token_ids for q in questions] == alone
        assert "2 rank(s)" in "".join(lines)


RECORDS = [
    {"messages": [{"role": "user", "content": "<image>What colour?"}], "images": ["red.png"]},
    {"messages": [{"role": "user", "content": "Hello there?"}]},
    {"messages": [{"role": "user", "content": "Count."}]},
]


def _generate_argv(checkpoint, output) -> list[str]:
    (checkpoint / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    argv = ["--megatron-path", str(checkpoint / "mg"), "--hf-processor-path", str(checkpoint / "hf")]
    return argv + [
        "--prompts",
        str(checkpoint / "p.jsonl"),
        "--max-new-tokens",
        "8",
        "--with-token-ids",
        "--output",
        output,
    ]


@pytest.fixture(scope="module")
def one_process_answers(checkpoint):
    from examples.multimodal_dev.tools import generate

    assert generate.main(_generate_argv(checkpoint, str(checkpoint / "one.jsonl"))) == 0
    return [json.loads(line)["token_ids"] for line in open(checkpoint / "one.jsonl")]


LAYOUTS = [["--tensor-model-parallel-size", "2", "--sequence-parallel"], ["--expert-model-parallel-size", "2"]]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2-sp", "ep2"])
def test_generate_on_ranks_equals_one_process(checkpoint, one_process_answers, layout, tmp_path):
    argv = [sys.executable, "-m", "examples.multimodal_dev.tools.generate"]
    argv += _generate_argv(checkpoint, str(tmp_path / "ranks.jsonl")) + layout
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 rank(s)" in done.stderr
    answers = [json.loads(line)["token_ids"] for line in open(tmp_path / "ranks.jsonl")]
    assert len(answers) == len(RECORDS) and answers == one_process_answers


def test_a_full_queue_refuses_the_next_request():
    from examples.multimodal_dev.generation.decode import Prompt, Sampling
    from examples.multimodal_dev.serving.engine import Engine, Job, QueueFull, Row

    engine = Engine(None, str, [], 0, max_batch=1, max_queue=1)
    job = Job(Row(Prompt([1]), Sampling(), 1, []), lambda event: None)
    engine.submit(job)
    with pytest.raises(QueueFull, match="1 requests are waiting already"):
        engine.submit(job)


def test_bench_serve_runs_both_sides_on_the_same_prompts(checkpoint):
    """The benchmark's generate and server sides answer the same prompts greedily: the same tokens."""
    from examples.multimodal_dev.benchmarks import bench_serve

    rows = bench_serve.run(str(checkpoint / "mg"), str(checkpoint / "hf"), (1, 3), 4, reps=1)
    assert set(rows) == {1, 3} and all(r["tokens"][0] == r["tokens"][1] > 0 for r in rows.values()), rows


@pytest.mark.parametrize(
    "tool, layout, said",
    [
        ("serve", ["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 does not divide the"),
        ("generate", ["--expert-model-parallel-size", "3"], "--expert-model-parallel-size 3 does not divide the"),
    ],
)
def test_a_layout_the_model_cannot_split_is_refused_before_any_rank_starts(checkpoint, tool, layout, said):
    argv = [sys.executable, "-m", f"examples.multimodal_dev.tools.{tool}", "--megatron-path", str(checkpoint / "mg")]
    argv += ["--hf-processor-path", str(checkpoint / "hf"), *layout]
    argv += ["--prompt", "Hi"] if tool == "generate" else []
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    said_lines = [line for line in done.stderr.splitlines() if line.startswith(f"{tool}:")]
    assert done.returncode == 2 and len(said_lines) == 1, done.stderr[-2000:]
    assert said_lines[0].startswith(f"{tool}: error: {said}") and str(checkpoint / "mg") in said_lines[0]
    assert "Traceback" not in done.stderr and "torchrun" not in done.stderr  # no rank was started
