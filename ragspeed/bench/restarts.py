"""`ragspeed bench restarts`: registered prompts through SIGKILLs of the server.

A real `ragspeed serve --prompt-cache-dir DIR` holds registered prompts. Each round kills it
with SIGKILL while it saves one, starts it again on the same folder, and checks, once the server
is up and every prompt is pinned again:

- every prompt whose registration was answered is listed and answers exactly as it did when it
  was registered (greedy, token for token);
- the prompt whose registration the kill interrupted is absent, or answers as it did in the
  setup (the kill came after its record was written);
- no temporary file is left in the folder.

The kills come in four kinds, in turn:

- `register`: at a uniformly random moment of a registration (0 to 1.5x its measured time);
- `record-write`, `kv-write`: as soon as the temporary file of the registration's record, or of
  its KV, appears (the KV is written after the record), or when the registration answers if
  the write was too quick to be seen;
- `prefill-again`: the first prompt's KV file corrupted before the start, the server killed as
  soon as its start-up writes the KV it computed again (or once it is pinned).

What a kill left on disk is classified before the next start: `before-record` (nothing of the
prompt), `record` (its record, its KV not complete), `mid-write` (a temporary file),
`complete`, or for `prefill-again` `outside-write` (no temporary file left).
"""

from __future__ import annotations

import json
import random
import shlex
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx

from ragspeed.bench.common import machine_line, max_tokens_option, seed_option, write_json
from ragspeed.bench.launcher import ServerProcess
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME
from ragspeed.prompt_cache.store import TEMPORARY_GLOB

KINDS = ("register", "record-write", "kv-write", "prefill-again")
# The temporary files a kind waits for (prompt_cache.store's atomic writes).
TRIGGERS = {"record-write": ".*.prompt.json.*.tmp", "kv-write": ".*.safetensors*.tmp"}
QUESTION = "Where is my parcel, and when will it arrive?"
SERVED_NAME = "restarts"
BASE = "base"


def prompt_text(index: int) -> str:
    return (
        f"You are support assistant number {index} of the Example Company. Answer briefly, "
        "cite the documents you use, and say so when they do not hold the answer. "
    ) * 6


@dataclass
class Prompts:
    """The prompts of a run: their texts and the answers they gave when registered."""

    texts: dict[str, str] = field(default_factory=dict)
    answers: dict[str, str] = field(default_factory=dict)
    registered: set[str] = field(default_factory=set)  # answered 201, so they must survive


class Checker:
    """Talks to one running server of the run."""

    def __init__(self, server: ServerProcess, max_tokens: int):
        self.server = server
        self.max_tokens = max_tokens
        self.http = httpx.Client(base_url=server.url, timeout=120)

    def register(self, name: str, text: str) -> httpx.Response:
        return self.http.post("/v1/prompts", json={"name": name, "text": text})

    def delete(self, name: str) -> None:
        self.http.delete(f"/v1/prompts/{name}").raise_for_status()

    def listed(self) -> dict[str, int]:
        """Listed prompts and their pinned tokens."""
        response = self.http.get("/v1/prompts")
        response.raise_for_status()
        return {p["name"]: p["pinned_tokens"] for p in response.json()["data"]}

    def answer(self, name: str) -> str:
        body = {
            "model": SERVED_NAME,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ragspeed": {"system_prompt": name},
        }
        response = self.http.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"]

    def wait_until_pinned(self, timeout_s: float = 120.0) -> dict[str, int]:
        """The listing once no prompt waits for its prefill again."""
        deadline = time.monotonic() + timeout_s
        while True:
            listed = self.listed()
            if all(listed.values()) or time.monotonic() > deadline:
                return listed
            time.sleep(0.05)

    def close(self) -> None:
        self.http.close()


def _temporaries(directory: Path) -> list[Path]:
    return list(directory.glob(TEMPORARY_GLOB))


def _left_on_disk(directory: Path, name: str) -> str:
    if _temporaries(directory):
        return "mid-write"
    if not (directory / f"{name}.prompt.json").exists():
        return "before-record"
    if (directory / f"{name}.safetensors.json").exists():
        return "complete"
    return "record"


class Killer:
    """A thread that SIGKILLs the server `after_s` seconds from now, or as soon as a file
    matching `pattern` appears in `directory`, or at the latest when `done()` is called (the
    operation finished before any such file was seen)."""

    def __init__(
        self, server: ServerProcess, directory: Path, *, after_s: float | None = None, pattern: str = ""
    ):
        self._server, self._directory = server, directory
        self._after_s, self._pattern = after_s, pattern
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + (120.0 if self._after_s is None else self._after_s)
        stale = set(self._directory.glob(self._pattern)) if self._pattern else set()  # a kill's leftovers
        while time.monotonic() < deadline and not (self._after_s is None and self._done.is_set()):
            if self._pattern and set(self._directory.glob(self._pattern)) - stale:
                break
            if self._server.process is not None and self._server.process.poll() is not None:
                return
            time.sleep(0.0002)
        while self._server.process is None and not self._done.is_set():  # not spawned yet
            time.sleep(0.0002)
        if self._server.process is not None:
            self._server.process.kill()

    def done(self) -> None:
        self._done.set()
        self._thread.join()


def _killed(server: ServerProcess) -> None:
    assert server.process is not None  # start() spawns it before the killer can act
    server.process.wait()
    server.stop()


def _verify(checker: Checker, prompts: Prompts, directory: Path) -> dict:
    """Check a restarted server: every registered prompt there, pinned and answering as before
    (an interrupted registration that is there counts as registered from now on)."""
    listed = checker.wait_until_pinned()
    missing = sorted(prompts.registered - set(listed))
    changed, checked = [], 0
    for name in sorted(listed):
        if name not in prompts.texts:
            continue
        checked += 1
        if checker.answer(name) != prompts.answers[name]:
            changed.append(name)
    prompts.registered |= set(listed) & set(prompts.texts)
    return {
        "prompts_checked": checked,
        "missing": missing,
        "changed": changed,
        "unpinned": sorted(name for name, tokens in listed.items() if not tokens),
        "temporaries_left": len(_temporaries(directory)),
    }


def run_restarts_bench(model: str, kills: int, *, seed: int, max_tokens: int, server_args: list[str]) -> dict:
    """Register every prompt once, then `kills` starts each killed at a point of a write (the
    kinds in turn), each start checking what the last one left; a last start checks all."""
    rng = random.Random(seed)
    directory = Path(tempfile.mkdtemp(prefix="ragspeed-restarts-"))
    args = ["--engine", "native", "--model", model, "--served-model-name", SERVED_NAME]
    args += ["--prompt-cache-dir", str(directory), *server_args]
    names = [BASE, *(f"p{i}" for i in range(1, kills + 1))]
    prompts = Prompts(texts={name: prompt_text(i) for i, name in enumerate(names)})
    window_s = _register_all(args, prompts, names, max_tokens)

    rounds, start_s = [], []
    for index, name in enumerate(names[1:]):
        kind = KINDS[index % len(KINDS)]
        click.echo(f"bench restarts: kill {index + 1}/{kills} ({kind})", err=True)
        server = ServerProcess(args)
        if kind == "prefill-again":  # the base prompt's KV refused at the start, computed again
            rounds.append(_prefill_again_round(server, directory, max_tokens))
        else:
            t0 = time.perf_counter()
            server.start()
            start_s.append(time.perf_counter() - t0)
            killer_after_s = rng.uniform(0.0, window_s) if kind == "register" else None
            rounds.append(_kill_round(server, directory, prompts, name, kind, max_tokens, killer_after_s))

    # The last start: every prompt checked once more.
    with ServerProcess(args) as server:
        checker = Checker(server, max_tokens)
        final = _verify(checker, prompts, directory)
        checker.close()
    return _summary(rounds, final, start_s, window_s, kills)


def _register_all(args: list[str], prompts: Prompts, names: list[str], max_tokens: int) -> float:
    """Every prompt's answer when registered (only the base stays registered); the window a
    `register` kill falls in: 1.5 x the median registration's seconds."""
    durations = []
    with ServerProcess(args) as server:
        checker = Checker(server, max_tokens)
        for name in names:
            t0 = time.perf_counter()
            checker.register(name, prompts.texts[name]).raise_for_status()
            durations.append(time.perf_counter() - t0)
            prompts.answers[name] = checker.answer(name)
            if name != BASE:
                checker.delete(name)
        checker.close()
    prompts.registered.add(BASE)
    return 1.5 * statistics.median(durations[1:] or durations)


def _prefill_again_round(server: ServerProcess, directory: Path, max_tokens: int) -> dict:
    """The base prompt's KV file corrupted, the server killed at its KV write as it computes
    it again."""
    tensor_file = directory / f"{BASE}.safetensors"
    tensor_file.write_bytes(tensor_file.read_bytes()[:-7] + b"corrupt")
    killer = Killer(server, directory, pattern=TRIGGERS["kv-write"])
    started: Checker | None = None  # None when killed before it was ready
    try:
        started = Checker(server.start(), max_tokens)
        started.wait_until_pinned()
    except (RuntimeError, httpx.TransportError):  # killed before it was ready, or pinned
        pass
    killer.done()
    if started is not None:
        started.close()
    _killed(server)
    left = "mid-write" if _temporaries(directory) else "outside-write"
    return {"kind": "prefill-again", "prompt": BASE, "left": left}


def _kill_round(
    server: ServerProcess,
    directory: Path,
    prompts: Prompts,
    name: str,
    kind: str,
    max_tokens: int,
    killer_after_s: float | None,
) -> dict:
    """A started server checks what the last one left, then is killed registering `name`: at
    the trigger of `kind`, or after `killer_after_s` seconds (a `register` kill)."""
    checker = Checker(server, max_tokens)
    result = {"kind": kind, "prompt": name, **_verify(checker, prompts, directory)}
    if killer_after_s is not None:
        killer = Killer(server, directory, after_s=killer_after_s)
    else:
        killer = Killer(server, directory, pattern=TRIGGERS[kind])
    try:
        if checker.register(name, prompts.texts[name]).status_code == 201:
            prompts.registered.add(name)
    except httpx.TransportError:
        pass
    killer.done()
    checker.close()
    _killed(server)
    result["left"] = _left_on_disk(directory, name)
    return result


def _summary(rounds: list[dict], final: dict, start_s: list[float], window_s: float, kills: int) -> dict:
    checks = [r for r in rounds if "prompts_checked" in r] + [final]
    return {
        "kills": kills,
        "left_on_disk": dict(Counter(r["left"] for r in rounds)),
        "by_kind": dict(Counter(r["kind"] for r in rounds)),
        "restarts_checked": len(checks),
        "prompts_checked": sum(c["prompts_checked"] for c in checks),
        "prompts_missing": sum(len(c["missing"]) for c in checks),
        "answers_changed": sum(len(c["changed"]) for c in checks),
        "prompts_unpinned": sum(len(c["unpinned"]) for c in checks),
        "temporaries_left": sum(c["temporaries_left"] for c in checks),
        "prompts_at_end": final["prompts_checked"],
        "registration_window_ms": 1000 * window_s,
        "start_s_p50": statistics.median(start_s) if start_s else None,
        "rounds": rounds,
    }


@click.command(name="restarts")
@click.option("--model", default=DEFAULT_MODEL_NAME, show_default=True)
@click.option("--kills", type=click.IntRange(min=1), default=20, show_default=True)
@seed_option()
@max_tokens_option(12)
@click.option("--server-args", default="", help="More `ragspeed serve` flags, one string.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def bench_restarts(
    model: str, kills: int, seed: int, max_tokens: int, server_args: str, json_path: str | None
) -> None:
    """SIGKILL the server while it saves prompts; every registered prompt must answer alike after."""
    result = run_restarts_bench(
        model, kills, seed=seed, max_tokens=max_tokens, server_args=shlex.split(server_args)
    )
    click.echo(machine_line())
    click.echo(f"{kills} kills ({', '.join(f'{k} {n}' for k, n in result['by_kind'].items())}) on {model}")
    click.echo("left on disk: " + ", ".join(f"{k} {n}" for k, n in sorted(result["left_on_disk"].items())))
    for key in (
        "restarts_checked",
        "prompts_checked",
        "prompts_missing",
        "answers_changed",
        "prompts_unpinned",
        "temporaries_left",
        "prompts_at_end",
    ):
        click.echo(f"{key.replace('_', ' '):20} {result[key]}")
    write_json(json_path, result)
    click.echo(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
