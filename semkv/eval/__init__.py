"""Evaluation: tasks (`task.py`), the runner (`semkv.eval.run`), reports and the HTML view of one sample."""
from semkv.eval.runner import run, run_config

__all__ = ["run", "run_config"]
