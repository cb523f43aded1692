"""Attention as pure functions; backends live in a registry."""

from .api import attention, attention_weights
from .merge import merge
from .problem import Problem, prepare
from .registry import Backend, Choice, Estimate, choose_backend, get, names, register, resolve, unregister, why_not

__all__ = ["attention", "attention_weights", "merge", "why_not", "choose_backend", "Problem", "prepare", "Backend", "Choice",
           "Estimate", "register", "unregister", "get", "names", "resolve"]
