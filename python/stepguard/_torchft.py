"""The names of torchft's native module, ``torchft._torchft``, in stepguard.

torchft's Python modules import their coordination classes from here, and
its ``torchft_lighthouse`` console script imports ``lighthouse_main``; in
torchft mode (:mod:`stepguard.as_torchft`) ``torchft._torchft`` is this
module.
"""

from stepguard.coordination import (
    LighthouseClient,
    LighthouseServer,
    ManagerClient,
    ManagerServer,
    Quorum,
    QuorumMember,
    QuorumResult,
    Timestamp,
    lighthouse_main,
)

__all__ = [
    "LighthouseClient",
    "LighthouseServer",
    "ManagerClient",
    "ManagerServer",
    "Quorum",
    "QuorumMember",
    "QuorumResult",
    "Timestamp",
    "lighthouse_main",
]
