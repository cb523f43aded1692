"""Evaluation: does a change to a model (a head-wise KV budget plan, an edit) keep what it could do?

- :mod:`~bhqk.evaluate.tasks`: retrieval tasks in the style of RULER (needle, multikey, multivalue,
  vartrack), one seeded prompt per (task, length, trial);
- :mod:`~bhqk.evaluate.grade`: every configuration (None or a :class:`bhqk.budget.Plan`) answers the
  same prompts; accuracies with Wilson intervals, paired differences with Newcombe's interval and
  McNemar's p; the KL divergence and perplexity on real text with bootstrap intervals (``bhqk grade``);
- :mod:`~bhqk.evaluate.needle`: the pass-key grid over lengths × depths (``bhqk needle``).

Prompts and text come from :mod:`bhqk.corpus`, replies from :func:`bhqk.integrations.greedy.greedy`.
This package sits above :mod:`bhqk.budget` (it takes its plans) and below the command line.
"""

from . import grade, needle, tasks

__all__ = ["grade", "needle", "tasks"]
