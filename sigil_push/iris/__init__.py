"""Iris targets' pushes (issue 33, CONTRACT 3b): what they carry (`payload`) and the authors'
names and pictures they show (`profiles`, a bounded kind 0 cache filled from relays on demand).

Below `push/` in the layer order: the Web Push and webhook senders (push/iris_senders.py) and
the planner (delivery/plan.py) build Iris bodies from here; nothing here names a provider.
"""
