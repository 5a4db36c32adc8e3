"""The inference-server engines (``daemon/engines/server.py``) against a fake server that Reef starts and supervises
exactly as it would vLLM or SGLang (``tests/fake_servers/stub.py``): the same processes, sockets and streams,
with answers a test can predict and misbehaviour on demand. vLLM itself runs in ``tests/test_vllm.py``; SGLang
cannot be installed here, so its shapes are checked here against answers recorded from its source
(``tests/fixtures/sglang/``)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ROOT, Daemon, assert_canonical_error, make_home

STUB_PYTHON = ROOT / "tests" / "fake_servers" / "python"
FIXTURES = ROOT / "tests" / "fixtures" / "sglang"


def expected_ids(prompt: list[int], n: int, adapter: bool = False) -> list[int]:
    return [10 + (1000 if adapter else 0) + (sum(prompt) + i) % 3000 for i in range(n)]


class Stubbed:
    """A daemon whose ``fake`` (vLLM dialect) and ``fakesg`` (SGLang dialect) models are stub servers."""

    def __init__(self, tiny_model: Path, tmp: Path) -> None:
        self.control = tmp / "control.json"
        self.log = tmp / "requests.jsonl"
        self.set()
        extra = ""
        for name, engine in (("fake", "vllm"), ("fakesg", "sglang")):
            extra += (f'\n[models.{name}]\nengine = "{engine}"\npath = "{tiny_model}"\nserver = "{STUB_PYTHON}"\n'
                      f'server_log = "{tmp}/{name}.log"\nstartup_timeout_s = 120\nretry_after_s = 2\n'
                      f'max_tokens_limit = 8\ntimeout_s = 10\n')
        home, port, env = make_home(tiny_model, extra)
        env.update(REEF_STUB_CONTROL=str(self.control), REEF_STUB_LOG=str(self.log), REEF_STUB_PYTHON=sys.executable)
        self.d = Daemon(home=home, port=port, env=env, extra_config=extra).start()
        try:
            with self.d.http() as http:
                for name in ("fake", "fakesg"):
                    assert http.post("/reef/scenarios", json={"name": name, "model": name}).status_code == 201
        except BaseException:
            self.d.stop()
            raise

    def set(self, **ctl: Any) -> None:
        self.control.write_text(json.dumps(ctl))

    def requests(self, path: str) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        lines = [json.loads(x) for x in self.log.read_text().splitlines()]
        return [x["body"] for x in lines if x["path"] == path]

    def server(self, model: str) -> dict[str, Any]:
        with self.d.http() as http:
            return http.get("/reef/status").json()["models"][model].get("server", {})

    def wait_healthy(self, model: str, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout  # a hang guard: the loop waits on the server's state
        while time.monotonic() < deadline:
            s = self.server(model)
            if s.get("healthy"):
                return s
            time.sleep(0.1)
        raise AssertionError(f"{model} never healthy: {self.server(model)}\n{self.d.log_tail()}")


@pytest.fixture(scope="module")
def stubbed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stubbed]:
    tmp = tmp_path_factory.mktemp("stub")
    s = Stubbed(tiny_model, tmp)
    try:
        with s.d.http() as http:  # engines start on first use
            for name in ("fake", "fakesg"):
                http.post("/v1/chat/completions", headers={"x-reef-scenario": name},
                          json={"model": name, "messages": [{"role": "user", "content": "warm"}], "max_tokens": 1})
        s.wait_healthy("fake")
        s.wait_healthy("fakesg")
        yield s
    finally:
        s.d.stop()
        shutil.rmtree(s.d.home, ignore_errors=True)


_clients: list[openai.OpenAI] = []


def client(d: Daemon, scenario: str) -> openai.OpenAI:
    """An SDK client on the scenario, closed when the module's tests end (an unclosed pool warns)."""
    c = openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.token, max_retries=0,
                      default_headers={"x-reef-scenario": scenario})
    _clients.append(c)
    return c


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _clients:
        _clients.pop().close()


def record(d: Daemon, receipt: str) -> dict[str, Any]:
    with d.http() as http:
        r = http.get(f"/reef/records/{receipt}")
        assert r.status_code == 200, r.text
        return r.json()


def receipt_of(raw: Any) -> str:
    return raw.headers["x-reef-agent-record-id"]


@pytest.mark.parametrize("model", ["fake", "fakesg"])
def test_sdk_through_reef_records_the_servers_tokens(stubbed: Stubbed, model: str) -> None:
    """The official SDK, streaming and not: the record holds the ids and log-probs the server sampled (not
    re-tokenised text), the prompt Reef rendered and sent, and the weight version the server reported."""
    c = client(stubbed.d, model)
    before = len(stubbed.requests("/inference/v1/generate" if model == "fake" else "/generate"))
    raw = c.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=5)
    rec = record(stubbed.d, receipt_of(raw))
    sent = stubbed.requests("/inference/v1/generate" if model == "fake" else "/generate")[before:]
    assert len(sent) == 1
    prompt = sent[0]["token_ids" if model == "fake" else "input_ids"]
    assert rec["prompt_token_ids"] == prompt
    assert rec["token_ids"] == expected_ids(prompt, 5)
    assert rec["logprobs"] == pytest.approx([-(i + 1) / 100 for i in range(5)])
    assert rec["status"] == "complete" and rec["engine"] == ("vllm" if model == "fake" else "sglang")
    assert rec["runtime_load_id"] == stubbed.server(model)["weight_version"]
    answer = raw.parse().choices[0].message.content
    assert answer == rec["response"]["choices"][0]["message"]["content"]

    with c.chat.completions.with_streaming_response.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True) as resp:
        receipt = resp.headers["x-reef-agent-record-id"]
        chunks = [ch for ch in resp.parse()]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    rec = record(stubbed.d, receipt)
    assert rec["status"] == "complete" and rec["token_ids"] == expected_ids(prompt, 5)
    assert text == answer  # same prompt, same (deterministic) server: same text streamed as collected


def test_collected_answers_ask_vllm_for_few_chunks_and_pass_the_seed(stubbed: Stubbed) -> None:
    """A stream is read from vLLM token by token; an answer the client gets whole asks vLLM to gather its tokens
    (``stream_interval``: all of them in one chunk after the first, or 16 per chunk where Reef looks for stop
    strings), and is read the same from those chunks. The client's seed reaches the server (an ignored seed
    would make a seeded request irreproducible)."""
    c = client(stubbed.d, "fake")
    msgs = [{"role": "user", "content": "chunks"}]
    before = len(stubbed.requests("/inference/v1/generate"))
    whole = c.chat.completions.with_raw_response.create(model="fake", messages=msgs, max_tokens=7, seed=5)
    stopped = c.chat.completions.with_raw_response.create(model="fake", messages=msgs, max_tokens=7, stop=["\x00z"])
    with c.chat.completions.with_streaming_response.create(model="fake", messages=msgs, max_tokens=7,
                                                           stream=True) as resp:
        streamed = resp.headers["x-reef-agent-record-id"]
        list(resp.parse())
    sent = [b["sampling_params"] for b in stubbed.requests("/inference/v1/generate")[before:]]
    assert [sp.get("stream_interval") for sp in sent] == [7, 16, None]
    assert [sp.get("seed") for sp in sent] == [5, None, None]
    prompt = stubbed.requests("/inference/v1/generate")[-1]["token_ids"]
    for receipt in (receipt_of(whole), receipt_of(stopped), streamed):
        rec = record(stubbed.d, receipt)
        assert rec["token_ids"] == expected_ids(prompt, 7), receipt
        assert rec["logprobs"] == pytest.approx([-(i + 1) / 100 for i in range(7)]), receipt


def test_sglang_request_shapes(stubbed: Stubbed) -> None:
    """What Reef sends SGLang matches ``GenerateReqInput`` (SGLang's io_struct): input ids, max_new_tokens,
    return_logprob, stream; and the vLLM dialect sends vLLM's ``GenerateRequest``."""
    sg = stubbed.requests("/generate")[-1]
    assert set(sg) == {"input_ids", "sampling_params", "return_logprob", "stream"}
    assert sg["return_logprob"] is True and sg["stream"] is True
    assert {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids"} <= set(sg["sampling_params"])
    assert sg["sampling_params"]["top_k"] == -1  # SGLang's "off"
    v = stubbed.requests("/inference/v1/generate")[-1]
    assert v["output_mode"] == "tokens" and v["sampling_params"]["logprobs"] == 0
    assert v["sampling_params"]["detokenize"] is False
    argv = [x for x in stubbed.requests("argv") if x["dialect"] == "vllm"][-1]["argv"]
    assert "--enable-lora" in argv and "--enable-scale-out" in argv


def test_sglang_recorded_stream_is_read_exactly() -> None:
    """A stream as SGLang sends it by default (cumulative ``output_ids`` and ``output_token_logprobs``), and the
    same answer with ``--incremental-streaming-output``: both read as the same new tokens, log-probs and version."""
    from daemon.engines.sglang import SGLang
    from daemon.protocols.sse import SSEDecoder

    for name in ("generate_stream_cumulative.sse", "generate_stream_incremental.sse"):
        parser = SGLang().parser()
        ids: list[int] = []
        lps: list[float] = []
        versions: list[str] = []
        finish = None
        for _, data in SSEDecoder().feed((FIXTURES / name).read_bytes()):
            if data.strip() == "[DONE]":
                continue
            step = parser.feed(json.loads(data))
            ids += step.token_ids
            lps += step.logprobs
            versions += step.versions or []
            finish = step.finish or finish
        assert ids == [791, 1630, 315, 9822], name
        assert lps == pytest.approx([-0.5, -1.25, -0.0625, -2.0]), name
        assert set(versions) == {"a1b2c3d4:2"} and finish == "length", name


def test_sglang_update_calls_match_its_api() -> None:
    """The update calls' bodies are SGLang's ``UpdateWeightFromDiskReqInput`` / ``LoadLoRAAdapterReqInput`` (field
    names recorded in tests/fixtures/sglang/requests.json from SGLang's io_struct), and ``success: false`` with a
    200 is a failure."""
    from daemon.engines.sglang import SGLang
    from daemon.errors import EngineError

    recorded = json.loads((FIXTURES / "requests.json").read_text())
    sg = SGLang()
    calls = dict(sg.update_weights(Path("/releases/abc"), "v:7"))
    assert set(calls) == {"/update_weights_from_disk"}
    assert set(calls["/update_weights_from_disk"]) <= set(recorded["update_weights_from_disk"])
    path, body = sg.load_adapter("v:8", Path("/releases/ad"))
    assert path == "/load_lora_adapter" and set(body) <= set(recorded["load_lora_adapter"])
    with pytest.raises(EngineError, match="failed"):
        sg.check_update("/update_weights_from_disk", recorded["update_weights_from_disk_failed_answer"])
    sg.check_update("/update_weights_from_disk", {"success": True, "message": "ok"})


def test_version_mismatch_is_never_recorded_as_the_release(stubbed: Stubbed) -> None:
    """A server reporting other weights than the load the request was frozen to: the non-streamed answer is
    retried once, then fails; the stream ends with an error event; neither record is a complete answer."""
    c = client(stubbed.d, "fake")
    stubbed.set(report_version="someone-else:1")
    try:
        before = len(stubbed.requests("/inference/v1/generate"))
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=3)
        assert e.value.status_code == 502
        assert "weight version mismatch" in e.value.message
        assert len(stubbed.requests("/inference/v1/generate")) - before == 2  # retried once
        rec = record(stubbed.d, e.value.response.headers["x-reef-agent-record-id"])
        assert rec["status"] == "error" and rec["token_ids"] is None
        assert "someone-else:1" in json.dumps(rec["response"])

        with httpx.Client(base_url=stubbed.d.url, timeout=30,
                          headers={"Authorization": f"Bearer {stubbed.d.token}", "x-reef-scenario": "fake"}) as h:
            r = h.post("/v1/chat/completions", json={"model": "fake", "stream": True, "max_tokens": 3,
                                                      "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200 and "weight version mismatch" in r.text
        rec = record(stubbed.d, r.headers["x-reef-agent-record-id"])
        assert rec["status"] == "incomplete"
    finally:
        stubbed.set()


@pytest.mark.parametrize(("fault", "said"), [({"malformed_after": 2}, "malformed JSON"),
                                           ({"drop_after": 2}, "broke off")])
def test_bad_server_streams_end_in_the_clients_error(stubbed: Stubbed, fault: dict[str, int], said: str) -> None:
    """Malformed JSON, or a connection cut mid-stream: the client's stream ends with its format's error event
    (OpenAI and Anthropic), a collected answer is a 502 in its format, each record says what happened (incomplete
    or error, with the server's fault), the daemon's other models serve meanwhile, and the next request is
    served."""
    stubbed.set(**fault)
    body = {"model": "fake", "max_tokens": 6, "messages": [{"role": "user", "content": "x"}]}
    try:
        with httpx.Client(base_url=stubbed.d.url, timeout=30,
                          headers={"Authorization": f"Bearer {stubbed.d.token}", "x-reef-scenario": "fake"}) as h:
            r = h.post("/v1/chat/completions", json={**body, "stream": True})
            assert r.status_code == 200 and '"error"' in r.text and "[DONE]" not in r.text
            rec = record(stubbed.d, r.headers["x-reef-agent-record-id"])
            assert rec["status"] == "incomplete" and said in rec["response"]["error"]["message"]
            r = h.post("/v1/messages", json={**body, "stream": True})
            assert r.status_code == 200 and "event: error" in r.text and "message_stop" not in r.text
            assert record(stubbed.d, r.headers["x-reef-agent-record-id"])["status"] == "incomplete"
            r = h.post("/v1/chat/completions", json=body)
            assert said in assert_canonical_error(r, 502, "openai")["message"]
            rec = record(stubbed.d, r.headers["x-reef-agent-record-id"])
            assert rec["status"] == "error" and said in rec["response"]["error"]["message"]
            assert_canonical_error(h.post("/v1/messages", json=body), 502, "anthropic")
            r = h.post("/v1/chat/completions", json={**body, "model": "tiny"}, headers={"x-reef-scenario": "default"})
            assert r.status_code == 200, r.text
    finally:
        stubbed.set()
    c = client(stubbed.d, "fake")
    assert c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=2)


def test_killed_server_is_restarted_and_meanwhile_503(stubbed: Stubbed) -> None:
    """The server dies: requests get a 503 with Retry-After (never a hang) until the supervisor has it back, with
    a new weight version (a new load of the same weights); the records of answers before and after say which."""
    c = client(stubbed.d, "fake")
    before = stubbed.server("fake")
    stubbed.set(die_on_generate=True)
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert e.value.status_code in (502, 503)
    stubbed.set()
    deadline = time.monotonic() + 60  # a hang guard
    saw_503 = False
    while time.monotonic() < deadline:
        s = stubbed.server("fake")
        if s.get("healthy") and s["restarts"] > before["restarts"]:
            break
        with httpx.Client(base_url=stubbed.d.url, timeout=30,
                          headers={"Authorization": f"Bearer {stubbed.d.token}", "x-reef-scenario": "fake"}) as h:
            r = h.post("/v1/chat/completions", json={"model": "fake", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "x"}]})
        if r.status_code == 503:
            saw_503 = True
            assert r.headers["Retry-After"] == "2"
            assert_canonical_error(r, 503, "openai")
        time.sleep(0.05)
    assert saw_503
    after = stubbed.wait_healthy("fake")
    assert after["pid"] != before["pid"] and after["weight_version"] != before["weight_version"]
    raw = c.chat.completions.with_raw_response.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                                      max_tokens=2)
    assert record(stubbed.d, receipt_of(raw))["runtime_load_id"] == after["weight_version"]


def test_server_never_healthy_is_a_503_and_other_models_serve(tiny_model: Path, tmp_path: Path) -> None:
    """A server that never becomes healthy: its model answers 503 with Retry-After in the client's format, it is
    killed after startup_timeout_s and started again, and the daemon's other models keep serving."""
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"never_healthy": True}))
    extra = (f'\n[models.sick]\nengine = "vllm"\npath = "{tiny_model}"\nserver = "{STUB_PYTHON}"\n'
             f'server_log = "{tmp_path}/sick.log"\nstartup_timeout_s = 2\nretry_after_s = 7\n')
    home, port, env = make_home(tiny_model, extra)
    env.update(REEF_STUB_CONTROL=str(control), REEF_STUB_LOG=str(tmp_path / "log.jsonl"), REEF_STUB_PYTHON=sys.executable)
    d = Daemon(home=home, port=port, env=env, extra_config=extra).start()
    try:
        with d.http() as http:
            assert http.post("/reef/scenarios", json={"name": "sick", "model": "sick"}).status_code == 201
            body = {"model": "sick", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
            r = http.post("/v1/chat/completions", json=body, headers={"x-reef-scenario": "sick"})
            assert_canonical_error(r, 503, "openai")
            assert r.headers["Retry-After"] == "7"
            r = http.post("/v1/messages", json=body, headers={"x-reef-scenario": "sick"})
            assert_canonical_error(r, 503, "anthropic")
            deadline = time.monotonic() + 60  # a hang guard: wait for the second start of the server
            while time.monotonic() < deadline:
                s = http.get("/reef/status").json()["models"]["sick"]["server"]
                if s["restarts"] >= 1:
                    break
                time.sleep(0.1)
            assert s["restarts"] >= 1 and not s["healthy"] and "not healthy within" in (s["last_error"] or "")
            r = http.post("/v1/chat/completions", json={**body, "model": "tiny"})
            assert r.status_code == 200, r.text
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_doctor_reports_the_servers_health_and_version(stubbed: Stubbed, tiny_model: Path) -> None:
    """``reef doctor`` names each inference server: healthy with its version and weight version from the running
    daemon; and, with no daemon, a server interpreter that does not exist is a failure with the install fix."""
    from tests.test_doctor import by_name, doctor

    out, data = doctor(stubbed.d.env, "--json")
    checks = by_name(data)
    assert checks["vllm (fake)"]["status"] == "ok", checks["vllm (fake)"]
    assert "0.0-stub" in checks["vllm (fake)"]["detail"]
    assert stubbed.server("fake")["weight_version"] in checks["vllm (fake)"]["detail"]
    assert checks["sglang (fakesg)"]["status"] == "ok"

    extra = f'\n[models.gone]\nengine = "vllm"\npath = "{tiny_model}"\nserver = "/nonexistent/bin/python"\n'
    home, _, env = make_home(tiny_model, extra)
    try:
        out, data = doctor(env, "--json")
        gone = by_name(data)["vllm (gone)"]
        assert gone["status"] == "fail" and "install.sh --vllm" in gone["fix"]
        assert out.returncode == 1
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("model", ["fake", "fakesg"])
def test_full_weight_release_goes_live_without_failing_requests(stubbed: Stubbed, tiny_model: Path, tmp_path: Path,
                                                                model: str) -> None:
    """A full-weights release under load: SGLang loads it with ``update_weights_from_disk`` (its weight version
    the new load id), vLLM is restarted on the release's directory (its default; see daemon/engines/vllm.py)
    while arriving requests wait; no request fails and the records after it name the new load."""
    import threading

    from daemon.releases import ReleaseStore, files_from_dir
    from tests.test_release_serving import make_weights

    c = client(stubbed.d, model)
    c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    before = stubbed.server(model)
    failures: list[str] = []
    receipts: list[str] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=stubbed.d.url, timeout=60, headers={"Authorization": f"Bearer {stubbed.d.token}",
                                                                      "x-reef-scenario": model}) as h:
            while not stop.is_set():
                r = h.post("/v1/chat/completions", json={"model": model, "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "x"}]})
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text[:200]}")
                else:
                    receipts.append(r.headers["x-reef-agent-record-id"])

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    store = ReleaseStore(stubbed.d.home / "artifacts.git")
    rel = store.publish(model, files_from_dir(make_weights(tiny_model, tmp_path / "w", 3)),
                        expected_head=store.head(model), operation="train", kind="weights", recipe="record")
    try:
        deadline = time.monotonic() + 120  # a hang guard: until answers from the new release come back
        while time.monotonic() < deadline and not failures:
            if receipts and record(stubbed.d, receipts[-1])["release_id"] == rel.release_id:
                break
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not failures, failures[:3]
    after = stubbed.server(model)
    assert after["weight_version"] != before["weight_version"]
    last = record(stubbed.d, receipts[-1])
    assert last["release_id"] == rel.release_id and last["runtime_load_id"] == after["weight_version"]
    if model == "fakesg":
        update = stubbed.requests("/update_weights_from_disk")[-1]
        assert update["weight_version"] == after["weight_version"] and update["abort_all_requests"] is False
        assert after["pid"] == before["pid"]  # loaded in place
    else:
        assert after["pid"] != before["pid"] and after["restarts"] == before["restarts"]  # planned, not a crash
        argv = [x for x in stubbed.requests("argv") if x["dialect"] == "vllm"][-1]["argv"]
        assert str(stubbed.d.home) in argv[argv.index("--model") + 1]  # started on the release's checkout


def test_a_client_that_leaves_aborts_the_servers_request(stubbed: Stubbed) -> None:
    """A whole answer from a slow server (a token every 2 s): the client closes its socket mid-answer, Reef records the
    exchange cancelled and closes its request to the server, which sees it aborted long before its last token."""
    from tests.test_long_requests import Records, _inflight, _leave, _post

    d = stubbed.d
    stubbed.set(token_delay_s=2)
    records = Records(d)
    try:
        with d.http() as c:
            sock = _post(d, {"model": "fake", "messages": [{"role": "user", "content": "slowly"}]},
                         path="/s/fake/v1/chat/completions")
            # until the server has sent its first token: an exchange is in flight before its request reaches the
            # server (a client that leaves then has nothing there to abort)
            got = _inflight(c, 60, lambda xs: len(xs) == 1 and (xs[0]["output_tokens"] or 0) >= 1)
            receipt = got[0]["receipt"]
            _leave(sock)
            assert records.wait(lambda r: r["id"] == receipt)["status"] == "cancelled"
            deadline = time.monotonic() + 60  # a hang guard: the stub notes the abort when its next write fails
            while not stubbed.requests("/inference/v1/generate#aborted"):
                assert time.monotonic() < deadline, "the server's request was not aborted"
                time.sleep(0.05)
            assert stubbed.requests("/inference/v1/generate#aborted")[-1]["at_token"] < 8  # max_tokens_limit 8
    finally:
        records.close()
        stubbed.set()
