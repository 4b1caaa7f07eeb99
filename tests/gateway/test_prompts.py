"""The static prompt registry against real servers: register, pin, use, list, delete; restart
restores the pinned prefix (first request is a hit); a corrupt KV file is refused with a log
line and the prompt prefilled again from its record; tenants never share blocks; a server killed
while it saves keeps every prompt. The routes' validation and engines without a prefix cache (text
substituted, nothing pinned) are tested in-process: test_inprocess_prompts.py."""

from __future__ import annotations

import time

import httpx

from ragspeed.bench.launcher import ServerProcess

SYSTEM = (
    "You are the support assistant of the Example Company. Answer briefly, cite the "
    "documents you use, and say so when they do not hold the answer. "
) * 6


def native_server(model, prompt_dir) -> ServerProcess:
    return ServerProcess(
        [
            "--engine",
            "native",
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--block-size",
            "16",
            "--max-model-len",
            "1024",
            "--num-kv-cache-tokens",
            "4096",
            "--prompt-cache-dir",
            str(prompt_dir),
        ]
    )


def chat(url, question, *, prompt=None, system=None, salt=None, status=200):
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "temperature": 0,
        "messages": ([{"role": "system", "content": system}] if system else [])
        + [{"role": "user", "content": question}],
    }
    if prompt is not None:
        body["ragspeed"] = {"system_prompt": prompt}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    return response.json()


def cached_tokens(body) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_until_pinned(url, name, tokens, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while (pinned := httpx.get(f"{url}/v1/prompts/{name}").json()["pinned_tokens"]) != tokens:
        assert time.monotonic() < deadline, f"{name}: {pinned} tokens pinned, expected {tokens}"
        time.sleep(0.05)


def metric(url, name) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_register_use_restart_and_corrupt_file(tiny_model, tmp_path):
    prompt_dir = tmp_path / "prompts"
    with native_server(tiny_model, prompt_dir) as server:
        url = server.url
        created = httpx.post(f"{url}/v1/prompts", json={"name": "support", "text": SYSTEM})
        assert created.status_code == 201, created.text
        info = created.json()
        assert info["num_tokens"] > 100
        pinned = info["pinned_tokens"]
        assert pinned == info["num_tokens"] // 16 * 16 and pinned > 0
        assert httpx.post(f"{url}/v1/prompts", json={"name": "support", "text": "x"}).status_code == 400
        assert httpx.post(f"{url}/v1/prompts", json={"name": "../x", "text": "x"}).status_code == 400

        first = chat(url, "Where is my parcel?", prompt="support")
        assert cached_tokens(first) == pinned
        # The same text sent inline hits the same blocks (unsalted).
        assert cached_tokens(chat(url, "And my refund?", system=SYSTEM)) == pinned
        # Another tenant (salt) with the same system prompt never shares a block.
        assert cached_tokens(chat(url, "Where is my parcel?", prompt="support", salt="tenant-b")) == 0
        assert cached_tokens(chat(url, "Where is my refund?", prompt="support", salt="tenant-b")) > 0

        error = chat(url, "q", prompt="support", system="other", status=400)
        assert error["error"]["param"] == "ragspeed.system_prompt"
        assert chat(url, "q", prompt="nope", status=400)["error"]["code"] == "prompt_not_found"

        listed = httpx.get(f"{url}/v1/prompts").json()["data"]
        assert [(p["name"], p["hit_count"], p["pinned_tokens"]) for p in listed] == [("support", 3, pinned)]
        assert httpx.get(f"{url}/v1/prompts/support").json()["hit_count"] == 3
        assert httpx.get(f"{url}/v1/prompts/nope").status_code == 404
        assert httpx.delete(f"{url}/v1/prompts/nope").status_code == 404
        assert metric(url, "ragspeed_prefix_cache_hits_total") >= 2 * pinned
        assert metric(url, "ragspeed_prefix_cache_queries_total") > metric(
            url, "ragspeed_prefix_cache_hits_total"
        )
        assert 0 < metric(url, "ragspeed_prefix_cache_usage") < 1
    files = ["support.prompt.json", "support.safetensors", "support.safetensors.json"]
    assert sorted(p.name for p in prompt_dir.iterdir()) == files

    with native_server(tiny_model, prompt_dir) as server:
        url = server.url
        listed = httpx.get(f"{url}/v1/prompts").json()["data"]
        assert [(p["name"], p["hit_count"], p["pinned_tokens"]) for p in listed] == [("support", 0, pinned)]
        restarted = chat(url, "Where is my parcel?", prompt="support")
        assert cached_tokens(restarted) == pinned  # the first request after a restart is a hit
        assert restarted["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert metric(url, "ragspeed_prefix_cache_hits_total") == pinned

    tensor_file = prompt_dir / "support.safetensors"
    data = bytearray(tensor_file.read_bytes())
    data[-3] ^= 0xFF
    tensor_file.write_bytes(bytes(data))
    (prompt_dir / ".support.safetensors.0123.tmp").write_bytes(b"a write a kill interrupted")
    with native_server(tiny_model, prompt_dir) as server:
        url = server.url
        # Never dropped: listed at once, prefilled again from its record in the background.
        assert [p["name"] for p in httpx.get(f"{url}/v1/prompts").json()["data"]] == ["support"]
        wait_until_pinned(url, "support", pinned)
        log = server.log_tail(20000)
        assert "refusing saved prefix" in log and "prefilled saved prompt support again" in log
        assert "removed 1 temporary file(s)" in log
        again = chat(url, "Where is my parcel?", prompt="support")
        assert cached_tokens(again) == pinned
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert httpx.post(f"{url}/v1/prompts", json={"name": "support", "text": SYSTEM}).status_code == 400
    assert sorted(p.name for p in prompt_dir.iterdir()) == files  # the KV saved anew, intact
    with native_server(tiny_model, prompt_dir) as server:
        assert "refusing" not in server.log_tail(20000)
        assert httpx.get(f"{server.url}/v1/prompts/support").json()["pinned_tokens"] == pinned
        assert httpx.delete(f"{server.url}/v1/prompts/support").json()["deleted"] is True
    assert list(prompt_dir.iterdir()) == []
