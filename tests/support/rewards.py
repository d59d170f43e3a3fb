"""Reward functions of the tests' runs. `grpokit train` processes load them by their path
("<tests>/support/rewards.py:shortness")."""


def shortness(completions, **columns):
    """A reward with variance on a random model: shorter completions score higher."""
    return [-float(len(c[0]["content"])) for c in completions]


def brevity(completions, **columns):
    """Shorter conversations score higher: every message's text counted (tool results too)."""
    return [-float(sum(len(m.get("content") or "") for m in c)) for c in completions]
