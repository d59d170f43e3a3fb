"""How a step's scored batch comes to be: a step's prompts and completions (sampler.py), their rewards and
advantages (scoring.py), DAPO's dynamic sampling (dynamic_sampling.py), generating ahead of
training (pipeline.py), and the scoring of held-out prompts (evaluation.py)."""
