"""The chaos soak: per-step state logs, a seeded fault schedule, the
history checker and goodput (``docs/soak.md``).

- :mod:`.steplog`: what every replica logs per step (a hash of its state in
  a fixed order, the quorum it saw, the incarnation).
- :mod:`.schedule`: the seeded schedule of faults the runner injects.
- :mod:`.checker`: reads the launcher's timeline and the step logs and
  lists every violation.
- :mod:`.goodput`: the one definition of goodput (also used by
  ``bench/e2e.py``).
- :mod:`.runner`: ``make soak`` / ``make soak-short``.
"""
