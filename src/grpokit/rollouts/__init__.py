"""Rollouts of more than one generation: conversations with tools or an environment
(conversation.py, tools.py), agents through the run's OpenAI-compatible endpoint (agents.py,
endpoint.py), and the one choice between the kinds of rollout (kinds.py)."""
