"""The built-in `judge` reward over real HTTP: against a scripted OpenAI-compatible server that
answers well, malformed, partly, slowly or with an error, and against `grpokit serve` with the
bundled model (a 135M judge: most of its replies do not parse, which is what is tested)."""

import asyncio
import json
import threading
import time

import pytest
from support.processes import free_port

from grpokit.rewards.judge import Judge, JudgeFailure, parse

pytest.importorskip("fastapi", reason="the scripted judge needs: pip install 'grpokit[server]'")


def test_replies_are_parsed_strictly():
    assert parse('{"scores": [0.25, 1, 0]}', 3) == [0.25, 1.0, 0.0]
    assert parse('```json\n{"score": 0.5}\n```', None) == [0.5]
    for reply, count, reason in [
        ("The first is better.", 2, "the reply is not JSON"),
        ('{"scores": [0.5]}', 2, "1 scores for 2 responses"),
        ('{"scores": [0.5, 1.5]}', 2, "score 1.5 is not a number from 0 to 1"),
        ('{"scores": [0.5, true]}', 2, "score True is not a number"),
        ('{"score": 0.5}', 2, "the reply has no 'scores'"),
        ('[0.5, 0.5]', 2, "the reply has no 'scores'"),
    ]:
        with pytest.raises(JudgeFailure, match=reason.replace("(", r"\(")):
            parse(reply, count)


class ScriptedJudge:
    """An OpenAI-compatible chat-completions server on 127.0.0.1 that answers each request with the
    next of `script`: ("ok" | "text" | "partial" | "error" | "slow": after `slow` seconds), counting the
    requests."""

    def __init__(self, script: list[str], slow: float = 3.0):
        import uvicorn
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        self.script, self.requests = list(script), []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(body)
            kind = self.script.pop(0) if self.script else "ok"
            responses = body["messages"][1]["content"].count("Response")
            reply = {"ok": json.dumps({"scores": [0.1 * (i + 1) for i in range(responses)]}),
                     "text": "Response 2 is better.", "partial": json.dumps({"scores": [0.5]})}.get(kind)
            if kind == "error":
                return JSONResponse(status_code=500, content={"error": "judge overloaded"})
            if kind == "slow":
                await asyncio.sleep(slow)
                reply = json.dumps({"scores": [0.5] * responses})
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True


def score(judge: Judge, prompts, completions):
    metrics, extra = {}, {}
    scores = asyncio.run(judge.score(prompts, completions, lambda k, v: metrics.setdefault(k, v),
                                     lambda k, v: extra.setdefault(k, v)))
    return scores, metrics, extra["judge"]


def test_the_judge_waits_as_long_as_reward_judge_timeout_says():
    """A judge that answers in 6 s is scored under reward.judge_timeout=20: the HTTP client's own
    default (5 s a phase) gave up first, whatever the setting said."""
    judge_server = ScriptedJudge(["slow"], slow=6.0)
    try:
        judge = Judge(judge_server.url, "j", None, "group", timeout=20.0, retries=0, concurrency=1, temperature=0.0)
        scores, metrics, notes = score(judge, ["1+1?", "1+1?"], ["2", "two"])
        assert scores == [0.5, 0.5] and metrics["judge/failed"] == 0, notes
    finally:
        judge_server.stop()


def test_a_group_s_scores_and_each_failure_as_none_counted_and_recorded(tmp_path):
    """Three groups of two, asked together (concurrency 1 keeps the script's order): a good reply,
    a reply for fewer completions than asked (retried, then None for the group), and a reply of
    prose after an HTTP error; a judge that hangs past its timeout gives None. The cache answers a
    second run's identical requests, also from a new Judge reading the run's cache file."""
    judge_server = ScriptedJudge(["ok", "partial", "partial", "error", "text", "text"])
    try:
        judge = Judge(judge_server.url, "j", "Prefer short answers.", "group", timeout=1.0, retries=1,
                      concurrency=1, temperature=0.0, cache_dir=tmp_path)
        prompts = ["1+1?", "1+1?", "2+2?", "2+2?", "3+3?", "3+3?"]
        completions = ["2", "two", "4", "four", "6", "six"]
        scores, metrics, notes = score(judge, prompts, completions)
        assert scores == [0.1, 0.2, None, None, None, None]
        assert metrics["judge/failed"] == pytest.approx(4 / 6)
        assert notes[2] == {"error": "1 scores for 2 responses", "reply": '{"scores": [0.5]}'}
        assert notes[4] == {"error": "the reply is not JSON", "reply": "Response 2 is better."}
        assert notes[0] == {"reply": '{"scores": [0.1, 0.2]}'}
        assert len(judge_server.requests) == 5  # 1 + 2 tries + 2 tries
        request = judge_server.requests[0]
        assert request["model"] == "j" and request["temperature"] == 0.0
        assert "Prefer short answers." in request["messages"][0]["content"]
        assert "Response 1:\n2" in request["messages"][1]["content"] and "1+1?" in request["messages"][1]["content"]

        again = Judge(judge_server.url, "j", "Prefer short answers.", "group", 1.0, 1, 1, 0.0, cache_dir=tmp_path)
        judge_server.script = ["ok", "ok"]
        scores, metrics, _ = score(again, prompts, completions)
        assert scores == [0.1, 0.2, 0.1, 0.2, 0.1, 0.2] and metrics["judge/failed"] == 0
        assert len(judge_server.requests) == 7  # only the two groups that failed were asked again
        assert score(again, prompts, completions)[0] == scores and len(judge_server.requests) == 7
        # Asked by what was asked: the same completions in another order are another question.
        judge_server.script = ["ok"]
        assert score(again, prompts[:2], completions[1::-1])[0] == [0.1, 0.2] and len(judge_server.requests) == 8

        judge_server.script = ["slow", "slow"]
        hung = Judge(judge_server.url, "j", None, "single", timeout=0.5, retries=1, concurrency=4, temperature=0.0)
        scores, metrics, notes = score(hung, ["1+1?"], ["2"])
        assert scores == [None] and notes[0]["error"] == "no reply within reward.judge_timeout=0.5 s"
    finally:
        judge_server.stop()


def test_a_training_run_records_the_judge_s_scores_and_failures(tmp_path):
    """reward.functions=[judge] in a run: the scripted judge's scores are the rewards, a failure is
    None (NaN in the record), judge/failed is in metrics.jsonl, and the raw replies in completions.jsonl."""
    from support.runs import completions_log, metric_rows

    from grpokit.cli import main

    judge_server = ScriptedJudge(["ok", "text", "text", "text"])
    try:
        assert main(["train", "--no-progress", "model.name=tiny-random", "reward.functions=[judge]",
                     f"reward.judge_url={judge_server.url}", "reward.judge_concurrency=1", "reward.judge_retries=0",
                     "train.max_steps=1", "train.prompts_per_step=4", "rollout.num_generations=2",
                     "rollout.max_completion_length=4", "data.eval_size=0", "monitor.log_completions=1",
                     f"train.output_dir={tmp_path}/run"]) == 0
    finally:
        judge_server.stop()
    row = next(r for r in metric_rows(tmp_path / "run") if "loss" in r)
    assert row["judge/failed"] == pytest.approx(0.75)
    records = completions_log(tmp_path / "run")
    assert [r["judge"].get("error") for r in records].count("the reply is not JSON") == 6
    assert sorted(r["rewards/judge"] for r in records if "error" not in r["judge"]) == [pytest.approx(0.1),
                                                                                       pytest.approx(0.2)]
    assert (tmp_path / "run" / "judge_cache.0.jsonl").read_text().count("\n") == 1  # the one group answered


def test_a_judge_that_never_answers_stops_the_run_with_its_reason(tmp_path, capsys):
    """Every reply unparsable for UNSCORED_STEPS steps: the run stops (exit 1), and the message
    gives the judge's first reason, not only that every value was None."""
    from grpokit.cli import main

    judge_server = ScriptedJudge(["text"] * 6)
    try:
        assert main(["train", "--no-progress", "model.name=tiny-random", "reward.functions=[judge]",
                     f"reward.judge_url={judge_server.url}", "reward.judge_retries=0", "train.max_steps=4",
                     "train.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_completion_length=2",
                     "data.eval_size=0", f"train.output_dir={tmp_path}/run"]) == 1
    finally:
        judge_server.stop()
    err = capsys.readouterr().err
    assert "scored no completion in 3 steps in a row (to step 3)" in err
    assert "The first reason logged at step 3: judge: the reply is not JSON (each is in failures.jsonl)" in err
    failures = [json.loads(line) for line in (tmp_path / "run" / "failures.jsonl").read_text().splitlines()]
    assert [r["step"] for r in failures] == [1] * 4 + [2] * 4 + [3] * 4
    assert {r["judge"]["error"] for r in failures} == {"the reply is not JSON"} and all(r["judge"]["reply"] for r in failures)


def test_a_judge_url_where_nothing_answers_is_a_start_up_error_naming_it(tmp_path, capsys):
    """Nothing listens at reward.judge_url: the run stops before its model loads (exit 2), naming
    the setting and the URL, and writes nothing."""
    from grpokit.cli import main

    url = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["train", "--no-progress", "model.name=tiny-random", "reward.functions=[judge]",
                 f"reward.judge_url={url}", "reward.judge_timeout=1", "train.max_steps=1",
                 f"train.output_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert f"reward.judge_url={url}: nothing answers there (" in err and "Connection refused" in err
    assert not (tmp_path / "run").exists()
    # A judge entry's own URL (which wins over reward.judge_url) is named as that entry's.
    assert main(["train", "--no-progress", "model.name=tiny-random", f"reward.functions=[{{name: judge, url: {url}}}]",
                 f"reward.judge_url=http://127.0.0.1:{free_port()}/v1", "reward.judge_timeout=1",
                 f"train.output_dir={tmp_path}/run"]) == 2
    assert f"reward.functions[0].url={url}: nothing answers there" in capsys.readouterr().err


@pytest.mark.process
def test_grpokit_serve_is_a_judge_whose_unparsable_replies_are_counted(server):
    """`grpokit serve` with the bundled model answers plain chat completions at /v1; as a judge (a
    135M model) its replies rarely parse: each is either scores in [0, 1] or None with its reply."""
    import urllib.request

    s = server("--model", "smollm2-135m-instruct")
    request = urllib.request.Request(s.url + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"messages": [{"role": "user", "content": "Say hi."}],
                                                      "max_tokens": 8, "temperature": 0}).encode())
    with urllib.request.urlopen(request, timeout=120) as r:
        reply = json.loads(r.read())
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
    assert 0 < reply["usage"]["completion_tokens"] <= 8
    judge = Judge(s.url + "/v1", "smollm2", None, "group", timeout=120, retries=0, concurrency=2, temperature=0.0)
    scores, metrics, notes = score(judge, ["What is 2 + 3?"] * 2, ["5", "7"])  # (single: the scripted tests)
    for value, note in zip(scores, notes):
        assert (value is None and note["error"] and note["reply"] is not None) or \
            (0 <= value <= 1 and "error" not in note)
    assert metrics["judge/failed"] == sum(v is None for v in scores) / 2
