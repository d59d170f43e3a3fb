"""Every framework example in examples/agents/ through one training step on the bundled model: what
each one's agents asked of the endpoint, and whether anything failed or was refused.

    pip install 'grpokit[agents]' openai-agents langchain langgraph langchain-openai smolagents dspy litellm
    python benchmarks/agent_frameworks.py      # about 20 minutes on 2 CPU cores

Each example runs as `grpokit train --config examples/agents/calculator.yaml
rollout.agent=<file>:<function>`, one step of 2 prompts x 2 rollouts, no evaluation (with
`reward.functions=[]` where the agent scores itself: smolagents and DSPy give their answer outside
a reply's text). Printed per example, from the step's metrics: requests per rollout
(`turns/mean`), and over the step's 4 rollouts the new sequences (requests that do not continue
the conversation token in, token out: a framework that rewrites the history), refused requests
and failed rollouts; the mean
reward and the step's seconds. A framework that is not installed is skipped, with the command that
installs it. The suite runs the Agents SDK and LangGraph examples on tiny-random
(tests/rollouts/test_agents.py); this runs every example on a real model.
Written to benchmarks/results/agent_frameworks.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "agents"

# (framework, the module it needs, example file, function, scores itself)
RUNS = [
    ("OpenAI Agents SDK (Responses API)", "agents", "openai_agents_sdk.py", "agent", False),
    ("OpenAI Agents SDK (chat completions)", "agents", "openai_agents_sdk.py", "agent_chat", False),
    ("OpenAI Agents SDK (streamed)", "agents", "openai_agents_sdk.py", "agent_streamed", False),
    ("LangGraph ReAct", "langgraph", "langgraph_react.py", "agent", False),
    ("LangGraph ReAct (streamed)", "langgraph", "langgraph_react.py", "agent_streamed", False),
    ("smolagents ToolCallingAgent", "smolagents", "smolagents_calculator.py", "agent", True),
    ("smolagents CodeAgent", "smolagents", "smolagents_calculator.py", "code_agent", True),
    ("DSPy ReAct", "dspy", "dspy_react.py", "agent", True),
    ("LiteLLM", "litellm", "litellm_tools.py", "agent", False),
    ("LiteLLM (streamed)", "litellm", "litellm_tools.py", "agent_streamed", False),
]
PIP = {"agents": "openai-agents", "langgraph": "langchain langgraph langchain-openai", "smolagents": "smolagents",
       "dspy": "dspy", "litellm": "litellm"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="framework names containing this text")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "agent_frameworks.md"))
    args = parser.parse_args()
    lines = ["| example | requests / rollout | new sequences | refused requests | failed rollouts | reward | "
             "step (s) |", "|---|---|---|---|---|---|---|"]
    skipped = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, module, file, function, own_reward in RUNS:
            if args.only and args.only.lower() not in name.lower():
                continue
            if importlib.util.find_spec(module) is None:
                skipped.append(f"{name}: not installed (pip install {PIP[module]})")
                continue
            out = Path(tmp) / f"{file}-{function}"
            command = [sys.executable, "-m", "grpokit", "train", "--config", str(EXAMPLES / "calculator.yaml"),
                       f"rollout.agent={EXAMPLES / file}:{function}", "train.max_steps=1", "train.prompts_per_step=2",
                       "rollout.num_generations=2", "data.eval_size=0", "train.eval_every=0", "train.save_every=0",
                       f"train.output_dir={out}", "train.resume=never", *(["reward.functions=[]"] if own_reward else [])]
            start = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                lines.append(f"| {name} | exit status {done.returncode}: {done.stderr.strip().splitlines()[-1]} |||||| ")
                print(lines[-1], flush=True)
                continue
            m = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
            lines.append(f"| {name} (`{file}:{function}`) | {m['turns/mean']:.2f} | {m['agents/new_sequences']:.0f} | "
                         f"{m['agents/refused_requests']:.0f} | {m['agents/failed']:.0f} | "
                         f"{m['reward']:.2f} | {m['step_time']:.0f} |")
            print(lines[-1], f"({time.perf_counter() - start:.0f} s with start-up)", flush=True)
    versions = []
    for dist in ("openai", "openai-agents", "langgraph", "langchain-openai", "smolagents", "dspy", "litellm"):
        try:
            from importlib.metadata import version

            versions.append(f"{dist} {version(dist)}")
        except Exception:
            pass
    text = "\n".join([f"`python benchmarks/agent_frameworks.py` ({time.strftime('%Y-%m-%d')}; "
                      f"{', '.join(versions)}): one step of 2 prompts x 2 rollouts each, the bundled model.", "",
                      *lines, *([""] + [f"- {s}" for s in skipped] if skipped else [])]) + "\n"
    Path(args.out).write_text(text)
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
