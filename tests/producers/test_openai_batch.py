"""Pure tests of the OpenAI Batch API line formats (parsing, records, resume scan)."""

from __future__ import annotations

import json

from producers.openai_batch import (
    CHAT_URL,
    BadLine,
    BatchRequest,
    Completion,
    bad_line_record,
    dumps_record,
    failed_record,
    parse_line,
    plan,
    result_record,
    scan_output,
)


def line(cid="a", url=CHAT_URL, **body) -> str:
    body.setdefault("messages", [{"role": "user", "content": "hi"}] if url == CHAT_URL else None)
    if body["messages"] is None:
        del body["messages"]
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_chat_line_parses_with_sampling():
    r = parse_line(line(max_tokens=7, temperature=0, stop="x", seed=3, model="gpt-4o"), 1)
    assert isinstance(r, BatchRequest)
    assert r.messages[0].content == "hi"
    assert (r.sampling.max_tokens, r.sampling.greedy, r.sampling.stop, r.sampling.seed) == (7, True, ("x",), 3)


def test_completion_prompt_forms():
    for prompt in ("hello", ["hello"]):
        r = parse_line(line(url="/v1/completions", prompt=prompt), 2)
        assert isinstance(r, BatchRequest) and r.prompt == "hello"
    r = parse_line(line(url="/v1/completions", prompt=[1, 2, 3]), 3)
    assert r.prompt_token_ids == (1, 2, 3)
    r = parse_line(line(url="/v1/chat/completions", messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]), 4)
    assert r.messages[0].content == "ab"


def test_bad_lines_name_the_line():
    cases = {
        "{not json": None,
        json.dumps([1, 2]): None,
        json.dumps({"url": CHAT_URL, "body": {}}): None,  # missing custom_id
        line(url="/v1/embeddings"): "a",
        line(temperature=-1): "a",
        line(n=2): "a",
        line(stream=True): "a",
        line(logprobs=True): "a",  # unsupported parameter
        line(messages=[]): "a",
        line(messages=[{"role": "robot", "content": "x"}]): "a",
        line(url="/v1/completions", prompt=""): "a",
    }
    for text, cid in cases.items():
        r = parse_line(text, 9)
        assert isinstance(r, BadLine), text
        assert r.custom_id == cid and r.message.startswith("line 9: "), (text, r)


def test_records_have_openai_shape():
    req = parse_line(line(), 1)
    rec = result_record(req, "m", Completion("rid", "out", "stop", 5, 2, 1), 123)
    assert rec["custom_id"] == "a" and rec["error"] is None
    body = rec["response"]["body"]
    assert rec["response"]["status_code"] == 200 and rec["response"]["request_id"] == "rid"
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {"role": "assistant", "content": "out"}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    comp = parse_line(line(url="/v1/completions", prompt="p"), 2)
    assert result_record(comp, "m", Completion("r", "t", "length", 1, 1), 0)["response"]["body"]["object"] == "text_completion"
    f = failed_record(req, "rid", "overloaded", "busy")
    assert f["response"]["status_code"] == 503 and f["response"]["body"]["error"]["code"] == "overloaded"
    b = bad_line_record(BadLine(4, None, "line 4: bad"), "job")
    assert b["response"] is None and b["error"]["line"] == 4 and "line 4" in b["error"]["message"]
    assert dumps_record(b).endswith(b"\n") and dumps_record(b).count(b"\n") == 1


def test_scan_output_tolerates_torn_last_line_and_plan_skips_done():
    ok = dumps_record({"custom_id": "a", "response": {}, "error": None})
    err = dumps_record({"custom_id": None, "response": None, "error": {"line": 3, "message": "x"}})
    data = ok + err + b'{"custom_id": "b", "resp'
    done = scan_output(data)
    assert done.custom_ids == {"a"} and done.lines == {3} and done.records == 2
    assert done.valid_bytes == len(ok) + len(err)
    lines = [line("a"), line("b"), "{bad", "", line("b"), line("c")]
    todo, total = plan(lines, done)
    assert total == 5  # blank line not counted
    assert [(t.line, t.custom_id) for t in todo] == [(2, "b"), (5, None), (6, "c")]
    assert "duplicate custom_id 'b'" in todo[1].message
    assert scan_output(ok + b"garbage\n" + ok).records == 1  # nothing after a torn line is trusted
