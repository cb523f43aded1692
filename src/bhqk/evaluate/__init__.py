"""Evaluation: does a change to a model (a head-wise KV budget plan, an edit) keep what it could do?
:mod:`~bhqk.evaluate.tasks` (retrieval tasks in the style of RULER, one seeded prompt per task, length
and trial), :mod:`~bhqk.evaluate.grade` (accuracies, paired differences, KL and perplexity, each with
its interval: ``bhqk grade``), :mod:`~bhqk.evaluate.board` (the KV-compression table: methods at the same
bytes, ``bhqk grade --ratio``) and :mod:`~bhqk.evaluate.needle` (the pass-key grid: ``bhqk needle``).
Prompts and text come from :mod:`bhqk.corpus`, replies from :func:`bhqk.integrations.greedy.greedy`.
This package sits above :mod:`bhqk.budget` (it takes its plans) and below the command line.
"""

from . import board, grade, needle, tasks

__all__ = ["board", "grade", "needle", "tasks"]
