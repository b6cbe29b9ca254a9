"""Fault injection, the test infrastructure that kills the recipe's trainer: ``fault_injection`` (the kill -9
trials against checkpoint/resume) and ``fault_train`` (the recipe, killed at one point of one save), run from the
repository root as ``python -m tests.fault.<name>``; their trainers are forked through ``tests/forked.py``."""
