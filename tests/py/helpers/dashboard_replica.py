"""A replica group for the dashboard tests: a real manager, stepping.

    python dashboard_replica.py LIGHTHOUSE REPLICA_ID START_STEP STEP_SECONDS

Runs stepguard's ManagerServer (so the lighthouse's kill reaches a real
manager, whose default kill handler exits the process with status 1) and
asks it for a quorum every STEP_SECONDS, as a training loop's
``start_quorum`` would, from START_STEP on.  A quorum that says ``heal``
moves the step to the quorum's max step, as a recovery would.  Prints
``MANAGER <address>`` once, then ``STEP <quorum_id> <step>`` per quorum.
The auth token, if any, comes from STEPGUARD_AUTH_TOKEN.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

from stepguard.coordination import ManagerClient, ManagerServer


def main() -> None:
    lighthouse, replica_id = sys.argv[1], sys.argv[2]
    step, pause = int(sys.argv[3]), float(sys.argv[4])
    server = ManagerServer(replica_id, lighthouse, "127.0.0.1", "127.0.0.1:0",
                           "127.0.0.1:1", 1, timedelta(milliseconds=100),
                           timedelta(seconds=10))
    print("MANAGER", server.address(), flush=True)
    client = ManagerClient(server.address(), timedelta(seconds=10))
    deadline = time.monotonic() + 600  # the test kills it long before
    while time.monotonic() < deadline:
        try:
            r = client._quorum(group_rank=0, step=step, checkpoint_metadata="",
                               shrink_only=False, timeout=timedelta(seconds=10))
        except (TimeoutError, RuntimeError) as e:
            print("QUORUM FAILED", e, flush=True)
            time.sleep(pause)
            continue
        if r.heal:
            step = r.max_step
        print("STEP", r.quorum_id, step, flush=True)
        step += 1
        time.sleep(pause)


if __name__ == "__main__":
    main()
