"""Hostile input against the embedded server (issue 19, server side): one real server,
started from the launcher's own command line and environment, attacked over real
sockets. Every case asserts the refusal (status and reason) and, through the autouse
``unharmed`` fixture, that the server still answers ``/health`` within a second and
generates the same greedy tokens as before the attack.

Classes: 1 resource limits, 2 a loop that never blocks, 3 weight files trusted by no
route, 4 clean errors and unforgeable logs, 5 no browser can drive the server, 6 the
key never on a command line.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from arealite.config.schema import ArealiteConfig, RolloutConfig
from arealite.launcher.common import server_env
from arealite.server.command_line import embedded_server_command

from conftest import free_port, run_env, stop_process

pytestmark = pytest.mark.timeout(120)

KEY = "sk-hostile-5e1d0c"
CAP = 1 << 20  # the body cap the server runs with
ALLOWED = "http://allowed.example:8080"
GREEDY = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}


class Server:
    """The server under attack: its address, process and log, and small HTTP helpers."""

    def __init__(self, port: int, proc: subprocess.Popen, log: Path):
        self.port, self.proc, self.log = port, proc, log
        self.baseline: list[int] = []

    def request(self, method: str, path: str, body: bytes | dict | list | None = None,
                headers: dict | None = None, key: str | None = KEY, timeout: float = 30) -> tuple[int, object]:
        """(status, parsed JSON or raw text) of one request."""
        h = {} if body is None else {"Content-Type": "application/json"}
        if key:
            h["Authorization"] = f"Bearer {key}"
        h.update(headers or {})
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=data, headers={k: v for k, v in h.items() if v is not None})
            r = conn.getresponse()
            raw = r.read()
        finally:
            conn.close()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw.decode(errors="replace")

    def post(self, path: str, body, **kw) -> tuple[int, object]:
        return self.request("POST", path, body, **kw)

    def raw(self, data: bytes, timeout: float = 10, then_close: bool = True) -> bytes:
        """Send raw bytes, return whatever the server answers until it closes (or `timeout`)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall(data)
            out = b""
            try:
                while chunk := s.recv(65536):
                    out += chunk
            except (socket.timeout, ConnectionResetError):
                pass
        return out

    def greedy(self) -> list[int]:
        status, out = self.post("/generate", GREEDY)
        assert status == 200, out
        return out["output_ids"]

    def healthy_within(self, seconds: float = 1.0) -> float:
        t0 = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=seconds) as r:
            assert r.status == 200
        return time.monotonic() - t0

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def state(self) -> dict:
        return self.request("GET", "/server_info")[1]["internal_states"][0]


def message(out) -> str:
    assert isinstance(out, dict), out
    err = out.get("error")
    return err["message"] if isinstance(err, dict) else out.get("message") or out.get("error_message") or ""


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """One server, launched exactly as the local launcher launches it (command and environment)."""
    cfg = ArealiteConfig.model_validate({
        "actor": {"model_path": str(tiny_model_dir)},
        "server": {"api_key": KEY, "max_body_bytes": CAP, "max_prompts_per_request": 8,
                   "max_request_tokens": 4096, "idle_timeout_s": 2, "body_timeout_s": 2,
                   "allowed_origins": [ALLOWED]},
        "weight_sync": {"timeout_s": 4},
    })
    port = free_port()
    cmd = embedded_server_command(cfg, port)
    log = tmp_path_factory.mktemp("hostile") / "server.log"
    env = run_env(**server_env(cfg))
    env.pop("AREALITE_STRICT_SGLANG")  # non-strict: /health answers at once, as the check below wants
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    s = Server(port, proc, log)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                s.healthy_within(2)
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
        s.baseline = s.greedy()
        yield s
    finally:
        stop_process(proc, 15)


@pytest.fixture(autouse=True)
def unharmed(server):
    """After every attack: alive, /health within a second, the same greedy tokens."""
    yield
    assert server.proc.poll() is None, server.log.read_text()[-3000:]
    assert server.healthy_within(1.0) < 1.0
    assert server.greedy() == server.baseline


# ------------------------------------------------------------ 1. resource limits


def test_content_length_over_cap_refused_before_the_body(server):
    # Only the head is sent: the answer must come without the server waiting for the body.
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {CAP + 1}\r\n\r\n").encode()
    t0 = time.monotonic()
    out = server.raw(head, timeout=5)
    assert out.startswith(b"HTTP/1.1 413") and b"max_body_bytes" in out
    assert time.monotonic() - t0 < 3  # answered and closed (1 s of lingering), not waiting for 1 MiB


@pytest.mark.parametrize("length", ["10000000000000", "99999999999999999999999999"])
def test_absurd_content_length_refused(server, length):
    out = server.raw((f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n{{}}").encode(), timeout=5)
    assert out.split(b" ", 2)[1] in (b"413", b"400")


@pytest.mark.parametrize("length", ["-5", "12abc"])
def test_malformed_content_length_is_400(server, length):
    out = server.raw((f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {length}\r\n\r\n{{}}").encode(), timeout=5)
    assert out.split(b" ", 2)[1] == b"400"  # answered by the HTTP parser, before any handler


def test_chunked_body_over_cap_refused_while_reading(server):
    rss0 = server.rss_mb()
    chunk = b"[" * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(CAP // len(chunk) + 4)) + b"0\r\n\r\n"
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    try:
        out = server.raw(head + body, timeout=10)
    except (BrokenPipeError, ConnectionResetError):  # the server hung up mid-upload: also a refusal
        out = b"HTTP/1.1 413"
    assert out.startswith(b"HTTP/1.1 413")
    assert server.rss_mb() - rss0 < 50


def test_body_just_under_cap_is_served(server):
    body = json.dumps(GREEDY).encode()
    body = body[:-1] + b" " * (CAP - len(body)) + b"}"
    assert len(body) == CAP
    status, out = server.post("/generate", body)
    assert status == 200 and out["output_ids"] == server.baseline


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_compressed_bodies_refused(server, encoding):
    import gzip

    status, out = server.post("/generate", gzip.compress(json.dumps(GREEDY).encode()),
                              headers={"Content-Encoding": encoding})
    assert status == 415 and "Content-Encoding" in message(out)


def test_gzip_bomb_refused_without_inflating(server):
    import gzip

    rss0 = server.rss_mb()
    bomb = gzip.compress(b"[" + b"0," * (32 << 20) + b"0]", compresslevel=9)  # 64 MiB inflated
    assert len(bomb) < CAP
    status, out = server.post("/generate", bomb, headers={"Content-Encoding": "gzip"})
    assert status == 415
    assert server.rss_mb() - rss0 < 50


def test_too_many_prompts_in_a_batch(server):
    status, out = server.post("/generate", {"input_ids": [[5, 6]] * 9, "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and "cap of 8" in message(out) and "max_prompts" in message(out)


def test_too_many_tokens_in_a_request(server):
    body = {"input_ids": [[5] * 600] * 8, "sampling_params": {"max_new_tokens": 1}}
    status, out = server.post("/generate", body)
    assert status == 400 and "4096" in message(out) and "max_request_tokens" in message(out)


def test_prompts_plus_completions_count_against_the_cap(server):
    body = {"input_ids": [[5] * 100] * 8, "sampling_params": {"max_new_tokens": 500}}
    status, out = server.post("/generate", body)
    assert status == 400 and "max_request_tokens" in message(out)


def test_huge_id_list_refused_cheaply_and_rss_bounded(server):
    rss0 = server.rss_mb()
    ids = b"[" + b",".join([b"5"] * (CAP // 2 - 8)) + b"]"
    body = b'{"input_ids": ' + ids + b"}"
    for _ in range(5):
        t0 = time.monotonic()
        status, out = server.post("/generate", body)
        assert status == 400 and "max_request_tokens" in message(out)
        assert time.monotonic() - t0 < 5
    assert server.rss_mb() - rss0 < 50


def test_n_above_one_refused(server):
    status, out = server.post("/generate", {"input_ids": [5], "sampling_params": {"n": 64}})
    assert status == 400 and "n=64" in message(out)


def test_text_too_long_is_refused_before_tokenizing(server):
    t0 = time.monotonic()
    status, out = server.post("/generate", {"text": "ab " * 300_000})
    assert status == 400 and "characters" in message(out) and "context length" in message(out)
    assert time.monotonic() - t0 < 2


def test_error_quotes_only_a_prefix_of_a_huge_value(server):
    status, out = server.post("/generate", {"input_ids": [5], "sampling_params": {"stop_token_ids": "x" * 500_000}})
    assert status == 400 and len(message(out)) < 300 and "stop_token_ids" in message(out)
    status, out = server.post("/generate", {"input_ids": [5], "rid": ["r" * 100_000]})
    assert status == 400 and len(message(out)) < 300


def test_slow_header_connection_is_closed(server):
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for _ in range(20):  # trickle a header line every half second: never completes
            try:
                s.sendall(b"X-Slow: 1\r\n")
                s.settimeout(0.5)
                if s.recv(1024) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
    assert closed and time.monotonic() - t0 < 6  # idle timeout 2 s


def test_idle_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=8) as s:
        t0 = time.monotonic()
        assert s.recv(1) == b""
    assert 1 < time.monotonic() - t0 < 6


def test_slow_body_times_out_with_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall((f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                   "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"inp").encode())
        t0 = time.monotonic()
        out = s.recv(4096)
    assert out.startswith(b"HTTP/1.1 408") and 1 < time.monotonic() - t0 < 6


@pytest.mark.parametrize("head", [
    "X-Big: " + "a" * 100_000 + "\r\n",
    "".join(f"X-H{i}: v\r\n" for i in range(500)),
])
def test_oversized_headers_refused(server, head):
    out = server.raw(f"GET /health HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode(), timeout=5)
    assert out.split(b" ", 2)[1] in (b"400", b"431")


# ------------------------------------------------------------ 2. the loop never blocks


def test_health_answers_within_a_second_during_big_requests(server):
    ids = json.dumps({"input_ids": [[7] * 500] * 8, "sampling_params": {"max_new_tokens": 2}}).encode()
    big = ids[:-1] + b" " * (CAP - len(ids) - 1) + b"}"
    bodies = [big, b'{"input_ids": [' + b"5," * (CAP // 2 - 20) + b"5]}", b'{"text": ["' + b"a" * (CAP - 20) + b'"]}']
    worst = 0.0
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(server.post, "/generate", b) for b in bodies]
        while not all(f.done() for f in futures):
            worst = max(worst, server.healthy_within(1.0))
            time.sleep(0.02)
        statuses = [f.result()[0] for f in futures]
    assert statuses == [200, 400, 400]
    assert worst < 1.0


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("batch", [False, True])
def test_disconnected_client_leaves_the_batch(server, batch):
    ids = [[5, 6, 7], [8, 9, 10]] if batch else [5, 6, 7]
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}).encode()
    before = server.state()["generated_tokens"]
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall((f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
    n = len(ids) if batch else 1
    _wait(lambda: server.state()["num_running_reqs"] == n, 10, "the request to run")
    s.close()
    _wait(lambda: server.state()["num_running_reqs"] == 0, 5, "the batch to shrink")
    # It left long before its 1000 tokens: the work stopped with the client.
    assert server.state()["generated_tokens"] - before < 1000 * len(ids) * 0.8


# ------------------------------------------------------------ 3. weight files


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _disk_update(server, path, timeout: float = 10) -> tuple[int, str]:
    t0 = time.monotonic()
    status, out = server.post("/update_weights_from_disk", {"model_path": str(path)}, timeout=timeout)
    assert time.monotonic() - t0 < 5  # refused without blocking on the file
    return status, message(out)


def test_disk_update_refuses_a_fifo_shard(server, tmp_path):
    _fifo(tmp_path / "m" / "model.safetensors")
    status, msg = _disk_update(server, tmp_path / "m")
    assert status == 400 and "model.safetensors" in msg and "FIFO" in msg


def test_disk_update_refuses_a_symlink_to_a_fifo(server, tmp_path):
    fifo = _fifo(tmp_path / "elsewhere" / "pipe")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").symlink_to(fifo)
    status, msg = _disk_update(server, tmp_path / "m")
    assert status == 400 and "FIFO" in msg


def test_disk_update_refuses_a_device(server, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").symlink_to("/dev/zero")
    status, msg = _disk_update(server, tmp_path / "m")
    assert status == 400 and "character device" in msg


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_index_cannot_point_outside_its_directory(server, tmp_path, tiny_model_dir, target):
    (tmp_path / "m").mkdir()
    shutil.copy(tiny_model_dir / "model.safetensors", tmp_path / "outside.safetensors")
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": target}}))
    status, msg = _disk_update(server, tmp_path / "m")
    assert status == 400 and "outside the checkpoint directory" in msg


@pytest.mark.parametrize("index", ["{not json", '{"weight_map": ["a"]}', "[1, 2]", "[" * 100_000])
def test_bad_index_is_a_400_naming_it(server, tmp_path, index):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors.index.json").write_text(index)
    status, msg = _disk_update(server, tmp_path / "m")
    assert status == 400 and "index" in msg


def test_fifo_index_refused(server, tmp_path):
    _fifo(tmp_path / "m" / "model.safetensors.index.json")
    status, msg = _disk_update(server, tmp_path / "m")
    assert status == 400 and "FIFO" in msg


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "huge_header"])
def test_corrupt_safetensors_is_a_400_naming_the_file(server, tmp_path, tiny_model_dir, damage):
    (tmp_path / "m").mkdir()
    good = (tiny_model_dir / "model.safetensors").read_bytes()
    bad = {"garbage": os.urandom(4096), "truncated": good[: len(good) // 2], "empty": b"",
           "huge_header": (2 ** 60).to_bytes(8, "little") + b"{}"}[damage]
    (tmp_path / "m" / "model.safetensors").write_bytes(bad)
    status, msg = _disk_update(server, tmp_path / "m")
    assert status == 400 and "model.safetensors" in msg


@pytest.mark.parametrize("path", ["/nonexistent/dir", "/etc/hostname", "bad\x00path"])
def test_disk_update_bad_directory(server, path):
    status, msg = _disk_update(server, path)
    assert status == 400 and msg


@pytest.mark.parametrize("target", ["fifo", "/dev/zero", "dir"])
def test_shm_update_refuses_non_regular_files(server, tmp_path, target):
    path = {"fifo": lambda: _fifo(tmp_path / "shm"), "/dev/zero": lambda: Path("/dev/zero"),
            "dir": lambda: tmp_path}[target]()
    t0 = time.monotonic()
    status, out = server.post("/update_weights_from_shm", {"path": str(path), "names": ["x"], "dtypes": ["float32"],
                                                          "shapes": [[1]], "offsets": [0]})
    assert status == 400 and "not a regular file" in message(out)
    assert time.monotonic() - t0 < 5


def test_lora_load_refuses_fifos_without_holding_up_other_loads(server, tmp_path):
    _fifo(tmp_path / "a" / "adapter_config.json")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    _fifo(tmp_path / "b" / "adapter_model.safetensors")
    for name in ("a", "b"):
        t0 = time.monotonic()
        status, out = server.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(tmp_path / name)})
        assert status == 400 and "FIFO" in message(out) and time.monotonic() - t0 < 5


@pytest.mark.parametrize("damage", ["garbage", "config_list", "config_deep"])
def test_lora_load_corrupt_files_are_400(server, tmp_path, damage):
    d = tmp_path / "ad"
    d.mkdir()
    config = {"garbage": json.dumps({"r": 2, "lora_alpha": 4}), "config_list": "[1]",
              "config_deep": "[" * 100_000}[damage]
    (d / "adapter_config.json").write_text(config)
    (d / "adapter_model.safetensors").write_bytes(os.urandom(1000))
    status, out = server.post("/load_lora_adapter", {"lora_name": "bad", "lora_path": str(d)})
    assert status == 400 and str(d) in message(out)


GROUP = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, "group_name": "g"}


@pytest.mark.parametrize("field,value,words", [
    ("master_port", 0, "TCP port"), ("master_port", 70000, "TCP port"), ("master_port", -1, "TCP port"),
    ("world_size", 1, "world_size"), ("world_size", 10 ** 9, "world_size"), ("world_size", 2 ** 70, "world_size"),
    ("rank_offset", 0, "rank_offset"), ("rank_offset", 5, "rank_offset"), ("rank_offset", -3, "rank_offset"),
    ("group_name", "g\nFORGED", "group_name"), ("group_name", "", "group_name"),
    ("master_address", "x" * 1000, "master_address"), ("master_port", "29500", "wrong type"),
])
def test_group_join_numbers_are_range_checked(server, field, value, words):
    status, out = server.post("/init_weights_update_group", {**GROUP, field: value})
    assert status == 400 and words in message(out)


def test_distributed_update_with_absurd_shapes_is_refused_before_receiving(server):
    status, out = server.post("/update_weights_from_distributed", {
        "names": ["model.embed_tokens.weight"], "dtypes": ["float32"], "shapes": [[2 ** 20, 2 ** 20]]})
    assert status == 400 and "refused without receiving" in message(out)


@pytest.mark.slow
def test_slow_group_joins_do_not_starve_admin_routes(server, tmp_path):
    with socket.socket() as sink:  # accepts connections into its backlog, never answers
        sink.bind(("127.0.0.1", 0))
        sink.listen(64)
        body = {**GROUP, "master_port": sink.getsockname()[1]}
        with ThreadPoolExecutor(4) as pool:
            joins = [pool.submit(server.post, "/init_weights_update_group", {**body, "group_name": f"slow{i}"})
                     for i in range(4)]
            time.sleep(0.5)  # all four are waiting for their rendezvous now
            status, out = server.post("/init_weights_update_group", {**body, "group_name": "fifth"})
            assert status == 429 and "retry later" in message(out)
            # Other admin routes, disk loads included, answer meanwhile.
            t0 = time.monotonic()
            assert server.post("/update_weight_version", {"new_version": "7"})[0] == 200
            assert server.post("/update_weights_from_disk", {"model_path": str(tmp_path)})[0] == 400
            assert server.post("/destroy_weights_update_group", {"group_name": "nope"})[0] == 400
            assert time.monotonic() - t0 < 2
            results = [f.result() for f in joins]
    assert all(status == 400 for status, _ in results)
    assert server.post("/update_weight_version", {"new_version": "0"})[0] == 200


def test_seeds_are_range_checked(server):
    for seed in (-1, 2 ** 64, 10 ** 30):
        status, out = server.post("/generate", {"input_ids": [5], "sampling_params": {"sampling_seed": seed}})
        assert status == 400 and "sampling_seed" in message(out)


# ------------------------------------------------------------ 4. clean errors


def test_deeply_nested_json_is_a_400(server):
    status, out = server.post("/generate", b"[" * 200_000 + b"]" * 200_000)
    assert status == 400 and "nested too deeply" in message(out)


def test_nesting_inside_a_field_is_a_400(server):
    deep = "[" * 900 + "]" * 900
    status, out = server.post("/generate", f'{{"input_ids": [5], "sampling_params": {{"stop_token_ids": {deep}}}}}'
                              .encode())
    assert status == 400 and len(message(out)) < 300


def test_lone_surrogate_in_text_is_a_400(server):
    status, out = server.post("/generate", b'{"text": "abc \\ud800 def"}')
    assert status == 400 and "surrogate" in message(out)


def test_lone_surrogate_in_rid_is_harmless(server):
    status, out = server.post("/generate", b'{"input_ids": [5, 6], "rid": "r\\udfff", '
                                           b'"sampling_params": {"max_new_tokens": 2}}')
    assert status in (200, 400) and isinstance(out, dict)


def test_non_ascii_authorization_is_a_401(server):
    out = server.raw(b"POST /generate HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer \xff\xfe\xc3\x28\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}", timeout=5)
    assert out.startswith(b"HTTP/1.1 401")


def test_invalid_utf8_body_is_a_400(server):
    status, out = server.post("/generate", b'{"text": "\xff\xfe"}')
    assert status == 400 and "not valid JSON" in message(out)


@pytest.mark.parametrize("body", [
    b"[1, 2]", b'"text"', b"null", b"12", b'{"input_ids": "abc"}', b'{"input_ids": [[]]}',
    b'{"input_ids": [5], "sampling_params": [1]}', b'{"input_ids": [5], "sampling_params": {"temperature": "hot"}}',
    b'{"input_ids": [5], "sampling_params": {"temperature": 1' + b"0" * 400 + b"}}",
    b'{"input_ids": [5], "sampling_params": {"max_new_tokens": 1e400}}',
    b'{"input_ids": [1' + b"0" * 4000 + b"]}", b'{"input_ids": [5], "return_logprob": "yes"}',
    b'{"input_ids": [5], "lora_path": {"a": 1}}', b"{\"input_ids\": [NaN]}",
], ids=lambda b: b[:40].decode())
def test_wrong_json_types_on_generate_are_400(server, body):
    status, out = server.post("/generate", body)
    assert status == 400 and message(out) and len(message(out)) < 400


ADMIN_ROUTES = ["/update_weights_from_disk", "/update_weights_from_shm", "/init_weights_update_group",
                "/update_weights_from_distributed", "/destroy_weights_update_group", "/get_weights_by_name",
                "/update_weight_version", "/load_lora_adapter", "/unload_lora_adapter", "/pause_generation",
                "/abort_request", "/begin_weight_update"]


@pytest.mark.parametrize("route", ADMIN_ROUTES)
def test_admin_routes_answer_wrong_types_with_4xx(server, route):
    for body in (b"[]", b'"x"', b'{"model_path": 5, "path": [], "names": "x", "name": {}, "lora_name": 1, '
                                 b'"new_version": [1], "mode": 3, "rid": 4, "group_name": 5, "selector": 6}'):
        status, out = server.post(route, body)
        assert 400 <= status < 500 and isinstance(out, dict), (route, body, out)
    server.post("/end_weight_update", {})  # a begin that succeeded must not stay open
    server.post("/continue_generation", {})


def test_unknown_route_and_wrong_method_are_json(server):
    status, out = server.request("GET", "/nope")
    assert status == 404 and message(out)
    status, out = server.request("GET", "/generate")
    assert status == 405 and message(out)


def test_user_values_cannot_forge_log_lines(server):
    forged = "FORGED-LINE-7c1 ERROR arealite.server: fake"
    server.post("/update_weights_from_disk", {"model_path": f"/nope\n{forged}"})
    server.post("/load_lora_adapter", {"lora_name": f"x\r\n{forged}", "lora_path": f"/nope\n{forged}"})
    server.post("/generate", {"input_ids": [5], "sampling_params": {"stop": f"\n{forged}"}})
    time.sleep(0.2)
    lines = server.log.read_text(errors="replace").splitlines()
    assert any("FORGED-LINE-7c1" in line for line in lines)  # it was logged ...
    assert not any(line.startswith("FORGED-LINE-7c1") for line in lines)  # ... never as a line of its own


# ------------------------------------------------------------ 5. browsers


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x",
                                   None, "application/jsonp"])
def test_json_routes_need_the_json_content_type(server, ctype):
    status, out = server.post("/generate", json.dumps(GREEDY).encode(), headers={"Content-Type": ctype})
    assert status == 415 and "application/json" in message(out)


def test_json_content_type_with_charset_is_served(server):
    status, out = server.post("/generate", GREEDY, headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert status == 200 and out["output_ids"] == server.baseline


def test_empty_body_post_needs_no_content_type(server):
    status, _ = server.post("/continue_generation", b"", headers={"Content-Type": None})
    assert status == 200


def test_form_post_with_empty_body_refused(server):
    status, _ = server.post("/pause_generation", b"", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 415


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1", "http://allowed.example"])
def test_foreign_origin_refused_even_with_the_key(server, origin):
    status, out = server.post("/generate", GREEDY, headers={"Origin": origin})
    assert status == 403 and "origin" in message(out)
    status, _ = server.request("GET", "/health", headers={"Origin": origin}, key=None)
    assert status == 403


def test_configured_origin_allowed(server):
    status, out = server.post("/generate", GREEDY, headers={"Origin": ALLOWED + "/"})
    assert status == 200 and out["output_ids"] == server.baseline


def test_key_still_required(server):
    assert server.post("/generate", GREEDY, key=None)[0] == 401
    assert server.post("/generate", GREEDY, key="wrong")[0] == 401


async def test_arealite_client_still_works(server):
    from arealite.api.types import GenerationRequest, SamplingParams
    from arealite.inference_client.sglang_client import SGLangClient

    eng = SGLangClient([f"127.0.0.1:{server.port}"], RolloutConfig(request_retries=0), api_key=KEY)
    try:
        await eng.initialize(timeout=30)
        c = await eng.agenerate(GenerationRequest(input_ids=GREEDY["input_ids"],
                                                  sampling=SamplingParams(max_new_tokens=8, greedy=True)))
        await eng.pause_generation()  # admin routes with and without bodies
        await eng.continue_generation()
    finally:
        await eng.aclose()
    assert list(c.output_ids) == server.baseline


# ------------------------------------------------------------ 6. the key


def test_key_not_in_the_launched_servers_command_line(server):
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
    assert b"arealite.server" in cmdline and KEY.encode() not in cmdline
    assert server.post("/generate", GREEDY)[0] == 200  # and yet the key is enforced and known


def test_key_file_flag(tmp_path):
    from arealite.server.args import parse_args

    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert parse_args(["--model-path", "m", "--api-key-file", str(f)]).api_key == "from-file"
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--api-key-file", str(tmp_path / "missing")])
