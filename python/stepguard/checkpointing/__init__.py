"""Moving a replica's state to the replicas that heal from it.

``HTTPTransport`` (the Manager's default) serves the state dict over HTTP in
torchft's wire format; ``PGTransport`` sends it over the replicas' process
group.
"""

from stepguard.checkpointing.http_transport import HTTPTransport
from stepguard.checkpointing.pg_transport import PGTransport
from stepguard.checkpointing.transport import CheckpointTransport

__all__ = ["CheckpointTransport", "HTTPTransport", "PGTransport"]
