"""Pure tensor math, no config objects: the loss (loss.py), advantages (advantages.py), the
learning-rate schedule (schedule.py), and which tokens the loss trains (masks.py)."""
