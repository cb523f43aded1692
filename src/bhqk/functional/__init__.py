"""Attention as pure functions; backends live in a registry."""

from .api import attention, attention_weights
from .merge import merge
from .problem import Problem, prepare
from .registry import Backend, choose, get, names, register, resolve, why_not

__all__ = ["attention", "attention_weights", "merge", "why_not", "Problem", "prepare", "Backend", "register", "get", "names", "choose", "resolve"]
