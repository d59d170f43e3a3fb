"""The run folder: its files, lock and logs (folder.py), checkpoints (checkpoint.py), metrics sinks
and live alerts (monitor.py), `grpokit doctor` (diagnose.py), `grpokit report` (report.py), and
the model card of final/ (model_card.py)."""

from grpokit.rundir.folder import TrainResult

__all__ = ["TrainResult"]
