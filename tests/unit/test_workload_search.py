"""Search-R1: answer normalisation and exact match (right and wrong answers), format-aware reward,
turn parsing, the BM25 retriever over the sample corpus, and the HTTP client against a real local
server speaking the Search-R1 /retrieve protocol (good answers, HTTP errors, bad bodies, timeouts,
a server that is down)."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time

import pytest

from libra.errors import ConfigError
from libra.services.rollout.engines.client import Generation
from libra.redis_server import free_port
from libra.workloads.base import FinalAnswer, Malformed, ToolCall, ToolStatus, TurnBudget, build_workload
from libra.workloads.config import RetrieverConfig, SearchR1Config
from libra.workloads.retrieval import TOOL, Bm25Retriever, HttpRetriever, parse_response
from libra.workloads.search_r1 import exact_match, normalize_answer

BUDGET = TurnBudget(4, 48, 384)


@pytest.fixture(scope="module")
def search():
    return build_workload(SearchR1Config())


def test_normalisation_and_exact_match():
    assert normalize_answer("  The Grey  Sea. ") == "grey sea"
    assert exact_match("the grey sea!", ["Grey Sea"]) and exact_match("Crown", ["vessian crown", "crown"])
    for wrong in ("Grey", "grey sea water", "", "...", "the"):
        assert not exact_match(wrong, ["Grey Sea"])


def test_reward_exact_match_plus_format(search):
    prompt_id = next(i for i in range(search.num_prompts) if search.prompt(i).answer == "Mira Solt")
    prompt = search.prompt(prompt_id)
    assert search.reward(prompt, FinalAnswer("mira solt")) == 1.0
    assert search.reward(prompt, FinalAnswer("Oren Vale")) == 0.0 and search.reward(prompt, None) == 0.0
    shaped = build_workload(SearchR1Config(format_reward=0.2))
    clean = shaped.episode(prompt_id, 0, 0, BUDGET)
    assert clean.reward(FinalAnswer("Oren Vale")) == 0.2 and clean.reward(FinalAnswer("Mira Solt.")) == 1.0
    sloppy = shaped.episode(prompt_id, 1, 0, BUDGET)
    assert isinstance(sloppy.parse_turn("Mira</search>"), Malformed)
    assert sloppy.reward(FinalAnswer("Oren Vale")) == 0.0 and sloppy.reward(FinalAnswer("Mira Solt")) == 1.0


def test_parse_turn(search):
    assert search.parse_turn("<think>hmm</think><search> Calder port </search>") == ToolCall(TOOL, "Calder port")
    assert search.parse_turn("<answer>Tolmar</answer>\n") == FinalAnswer("Tolmar")
    for text in ("Tolmar", "<search>x</answer>", "<answer></answer>", "<search>a<answer>b</search>", "<search>q"):
        turn = search.parse_turn(text)
        assert isinstance(turn, Malformed), text
        assert "<" not in turn.reason


def test_bm25_finds_the_right_passage_and_reports_failures(search):
    result = asyncio.run(search.call_tool(ToolCall(TOOL, "which animals live on Pennick island"), 5.0))
    assert result.status is ToolStatus.SUCCESS
    assert result.payload.startswith("Doc 1(Title: Pennick island)") and "grey seals" in result.payload
    assert search.render_tool_result(result).startswith("<information>Doc 1")
    assert asyncio.run(search.call_tool(ToolCall(TOOL, "   "), 5.0)).status is ToolStatus.FAILURE
    assert asyncio.run(search.call_tool(ToolCall(TOOL, "x" * 600), 5.0)).status is ToolStatus.FAILURE
    nothing = asyncio.run(search.call_tool(ToolCall(TOOL, "zzzz qqqq"), 5.0))
    assert nothing.status is ToolStatus.SUCCESS and nothing.payload == "no documents found"
    assert asyncio.run(search.call_tool(ToolCall("calculator", "1+1"), 5.0)).status is ToolStatus.FAILURE


def test_bm25_corpus_errors(tmp_path):
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"contents": "\\"A\\"\\ntext"}\n{"body": "no contents"}\n')
    with pytest.raises(ConfigError, match="line 2.*contents"):
        Bm25Retriever(bad, 3, 100)
    flat = tmp_path / "flat.jsonl"
    flat.write_text(json.dumps({"title": "Only", "text": "one document about owls"}) + "\n")
    assert [d.title for d in Bm25Retriever(flat, 5, 100).search_now("owls")] == ["Only"]  # k clamps to the corpus


def test_demonstrations_show_real_retrieval(search):
    for demo in search.demonstrations(4, 0):
        assert [trained for _, trained in demo] == [False, True, False, True]
        assert isinstance(search.parse_turn(demo[1][0]), ToolCall) and isinstance(search.parse_turn(demo[3][0]), FinalAnswer)
        assert demo[2][0].startswith("<information>Doc 1(Title: ")


class _RetrievalHandler(http.server.BaseHTTPRequestHandler):
    mode = "ok"

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/retrieve" and body["return_scores"] is True and isinstance(body["queries"], list)
        if self.mode == "slow":
            time.sleep(1.0)
        if self.mode == "error":
            self.send_response(500)
            self.end_headers()
            return
        docs = [{"document": {"id": str(i), "contents": f'"Title {i}"\nanswer to {body["queries"][0]}'}, "score": 1.0 / (i + 1)}
                for i in range(body["topk"])]
        payload = {"result": [docs]} if self.mode != "garbage" else {"unexpected": True}
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _RetrievalHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("mode, status, text", [
    ("ok", ToolStatus.SUCCESS, "Doc 1(Title: Title 0) answer to capital of Vessia\nDoc 2(Title: Title 1)"),
    ("error", ToolStatus.FAILURE, "HTTP 500"), ("garbage", ToolStatus.FAILURE, "unexpected answer"),
    ("slow", ToolStatus.TIMEOUT, "timed out"),
])
def test_http_retriever_protocol(server, mode, status, text):
    _RetrievalHandler.mode = mode
    retriever = HttpRetriever(server, topk=2, max_doc_chars=200)

    async def ask():
        try:
            return await retriever.search("capital of Vessia", timeout_s=0.3)
        finally:
            await retriever.close()
    result = asyncio.run(ask())
    assert result.status is status and text in result.payload


def test_http_retriever_down_is_a_failure_and_config_checks_the_url():
    retriever = HttpRetriever(f"http://127.0.0.1:{free_port()}", topk=2, max_doc_chars=200)
    result = asyncio.run(retriever.search("anything", 2.0))
    assert result.status is ToolStatus.FAILURE and result.payload == "the retriever is unreachable" and result.detail
    with pytest.raises(ValueError, match="retriever.url must be an http"):
        RetrieverConfig(kind="http", url="localhost:8000")


def test_parse_response_shapes():
    scored = {"result": [[{"document": {"contents": '"T"\nbody'}, "score": 0.5}]]}
    assert [(d.title, d.text, d.score) for d in parse_response(scored)] == [("T", "body", 0.5)]
    plain = {"result": [[{"id": "1", "contents": "no title line"}]]}
    assert [(d.title, d.text) for d in parse_response(plain)] == [("", "no title line")]
    for bad in ({}, {"result": []}, {"result": ["x"]}, {"result": [[{"document": {"x": 1}}]]}, [1]):
        with pytest.raises(ValueError):
            parse_response(bad)


class _HangingRetriever:
    """A retriever that never answers and ignores its own time limit (the runner must cut it off)."""

    async def search(self, query, timeout_s):
        await asyncio.sleep(3600)


def test_runner_records_a_hung_tool_as_timeout_and_a_malformed_call_as_failure(monkeypatch):
    from libra.services.rollout.agent import AgentRunner
    from libra.services.rollout.config import RolloutConfig
    from libra.tiny_model import stop_token_ids, train_tokenizer, wrap_tokenizer
    from libra.v1 import common_pb2 as pb

    hung = build_workload(SearchR1Config())
    hung.retriever = _HangingRetriever()
    tokenizer = wrap_tokenizer(train_tokenizer(hung, 400, 0), 512)
    script = iter(["<search>Calder</search>", "<search>x</answer>", "<answer>Tolmar</answer>"])
    seen = []

    class Router:
        async def route(self, *args):
            return type("Decision", (), {"worker_id": "w0", "bucket": "short"})()

        async def turn_done(self, *args):
            pass

        async def tool_returned(self, trajectory_id, tool, status, payload_tokens):
            seen.append((tool, status))

    async def generate(decision, ids, budget, seed):
        out = tokenizer(next(script), add_special_tokens=False).input_ids
        return Generation(token_ids=out, logprobs=[-0.1] * len(out), finish_reason="stop", seconds=0.0,
                          versions=[1] * len(out))  # sampled by version 1, the version the worker holds

    monkeypatch.setattr("libra.services.rollout.agent.TOOL_GRACE_S", 0.05)
    runner = AgentRunner(hung, tokenizer, Router(), generate, lambda w: 1, RolloutConfig(tool_timeout_s=0.1),
                         stop_token_ids(tokenizer, hung), seed=0)
    started = time.monotonic()
    traj = asyncio.run(runner.play(pb.Trajectory(trajectory_id="g0-s0", prompt_id="0", group_id="g0")))
    assert time.monotonic() - started < 5
    assert traj.status == pb.TRAJECTORY_STATUS_COMPLETED and traj.turns == 3 and traj.reward == 1.0  # prompt 0: Tolmar
    assert seen == [("search", pb.TOOL_STATUS_TIMEOUT), ("format", pb.TOOL_STATUS_FAILURE)]
    assert [e.status for e in traj.tool_events] == [pb.TOOL_STATUS_TIMEOUT, pb.TOOL_STATUS_FAILURE]
    assert "<information>error: timed out</information>" in tokenizer.decode(list(traj.token_ids))
