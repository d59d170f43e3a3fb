"""Rollout engines, and only them: what they return (batch.py), their protocols and registry
(protocols.py), prompts as token ids (prompts.py), the engines (transformers_engine.py, its
decoders in decoding.py and static_decoder.py, vllm_engine.py, client.py for `grpokit serve`
processes), a generation split among several
(balance.py), what a trainer and a server exchange (wire.py) and weights (weights.py)."""

from grpokit.engines.batch import RolloutBatch, SamplingParams, from_completions
from grpokit.engines.prompts import PromptEncoder
from grpokit.engines.protocols import (ENGINES, AgentsEngine, PipelineEngine, RolloutEngine, ServedEngine, engine_class,
                                       make_engine)

__all__ = ["ENGINES", "AgentsEngine", "PipelineEngine", "PromptEncoder", "RolloutBatch", "RolloutEngine",
           "SamplingParams", "ServedEngine", "engine_class", "from_completions", "make_engine"]
