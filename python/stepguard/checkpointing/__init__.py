"""Moving a replica's state to the replicas that heal from it.

``NativeTransport`` (the Manager's default) serves tensor bytes straight
from memory with libstepguard's checkpoint server, and a healer fetches
striped across every up-to-date replica, and also serves torchft's HTTP
format so that torchft replicas can heal from it.  ``HTTPTransport``
serves the state dict over HTTP in torchft's wire format only;
``PGTransport`` sends it over the replicas' process group.
"""

from stepguard.checkpointing.http_transport import HTTPTransport
from stepguard.checkpointing.native_transport import NativeTransport
from stepguard.checkpointing.pg_transport import PGTransport
from stepguard.checkpointing.transport import CheckpointTransport

__all__ = ["CheckpointTransport", "HTTPTransport", "NativeTransport", "PGTransport"]
