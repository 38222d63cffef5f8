"""Moving a replica's state to the replicas that heal from it."""

from stepguard.checkpointing.transport import CheckpointTransport

__all__ = ["CheckpointTransport"]
