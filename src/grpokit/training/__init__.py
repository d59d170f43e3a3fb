"""Training: the one place that wires a run (setup.py, for train, eval and serve), the loop
(trainer.py), its state (state.py: progress, what a failure saves), the step's metrics
(metrics.py), and how the model is held over processes (sharding.py). (Not `train/`: that name is
`grpokit.train`, the function.)"""
