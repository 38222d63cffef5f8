"""The manager against the real peer (torchft-nightly) in all four
directions, and mixed quorums where a torchft manager and ours decide the
same quorum: every field each side computes must agree.

torchft's bindings are loaded without importing torch (see load_torchft).
"""

from __future__ import annotations

import threading

import pytest

from lighthouse_util import load_torchft, start_torchft, td
from stepguard import coordination as sg

tf = load_torchft()

FIELDS = ("quorum_id", "replica_rank", "replica_world_size",
          "recover_src_manager_address", "recover_src_replica_rank",
          "recover_dst_replica_ranks", "store_address", "max_step",
          "max_replica_rank", "max_world_size", "heal", "replica_ids",
          "reconfigure_handles")


def fields(r) -> dict:
    return {f: getattr(r, f) for f in FIELDS}


def parallel(fns, timeout=60):
    out: list = [None] * len(fns)
    errs: list = []

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
        assert not t.is_alive(), f"a call did not return within {timeout} s"
    if errs:
        raise errs[0]
    return out


def server(mod, rid, lh_addr, world):
    return mod.ManagerServer(rid, lh_addr, "127.0.0.1", "127.0.0.1:0",
                             f"store-{rid}:1", world, td(0.05), td(5), 0)


def quorum(client, rank, step, handle):
    return client._quorum(group_rank=rank, step=step,
                          checkpoint_metadata=f"md{rank}-{step}",
                          shrink_only=False, init_sync=True, commit_failures=0,
                          timeout=td(30), reconfigure_handle=handle)


def expected(quorum_id, rids, steps, addrs, stores, rank, me, handles):
    """compute_quorum_results for replica `me`, from first principles."""
    order = sorted(range(len(rids)), key=lambda i: rids[i])
    max_step = max(steps)
    ups = [i for i in order if steps[i] == max_step]
    primary = ups[rank % len(ups)]
    force = max_step == 0
    dst = [k for k, i in enumerate(order)
           if steps[i] != max_step or (force and i != primary)]
    up = [k for k in range(len(order)) if k not in dst]
    assign: dict[int, list[int]] = {}
    src = None
    my_rank = order.index(me)
    for n, r in enumerate(dst):
        s = up[(n + rank) % len(up)]
        assign.setdefault(s, []).append(r)
        if r == my_rank:
            src = s
    return {
        "quorum_id": quorum_id, "replica_rank": my_rank,
        "replica_world_size": len(order),
        "recover_src_manager_address": addrs[order[src]] if src is not None else "",
        "recover_src_replica_rank": src,
        "recover_dst_replica_ranks": assign.get(my_rank, []),
        "store_address": stores[primary], "max_step": max_step,
        "max_replica_rank": ups.index(me) if me in ups else None,
        "max_world_size": len(ups), "heal": src is not None,
        "replica_ids": [rids[i] for i in order],
        "reconfigure_handles": [handles[i][rank] for i in order],
    }


@pytest.mark.parametrize("lighthouse", ["ours", "torchft"])
@pytest.mark.parametrize("steps", [(5, 5, 2), (0, 0, 0), (4, 1, 4)])
def test_mixed_managers_agree(procs, lighthouse, steps):
    """Replica a runs torchft's manager, b and c ours (2 group ranks each),
    under either lighthouse; our clients talk to torchft's manager and
    torchft's clients to ours."""
    if lighthouse == "ours":
        lh = sg.LighthouseServer("127.0.0.1:0", 3, join_timeout_ms=100)
        lh_addr = lh.address()
    else:
        lh = None
        lh_addr = start_torchft(procs, "--min_replicas", "3",
                                "--join_timeout_ms", "100").addr
    rids = ["a", "b", "c"]
    mods = [tf, sg, sg]
    servers = [server(m, r, lh_addr, 2) for m, r in zip(mods, rids)]
    # clients of the other implementation: ours -> torchft's manager and
    # torchft's -> ours
    client_mods = [sg, tf, sg]
    clients = [[cm.ManagerClient(s.address(), td(5)) for _ in range(2)]
               for cm, s in zip(client_mods, servers)]
    handles = [[f"H{r}{g}" for g in range(2)] for r in rids]
    try:
        res = parallel([
            (lambda i=i, g=g: quorum(clients[i][g], g, steps[i], handles[i][g]))
            for i in range(3) for g in range(2)])
        qid = res[0].quorum_id
        addrs = [s.address() for s in servers]
        stores = [f"store-{r}:1" for r in rids]
        for n, r in enumerate(res):
            i, g = divmod(n, 2)
            assert fields(r) == expected(qid, rids, steps, addrs, stores, g, i,
                                         handles), (rids[i], g)
        # metadata across implementations: the healer's view of its source
        for i in range(3):
            for g in range(2):
                assert clients[i][g]._checkpoint_metadata(g, td(5)) == \
                    f"md{g}-{steps[i]}"
        votes = parallel([
            (lambda i=i, g=g: clients[i][g].should_commit(
                g, steps[i], not (i == 1 and g == 1), td(10)))
            for i in range(3) for g in range(2)])
        assert votes == [True, True, False, False, True, True]
    finally:
        for cs in clients:
            for c in cs:
                if hasattr(c, "close"):
                    c.close()
        for s in servers:
            s.shutdown()
        if lh:
            lh.shutdown()


def test_our_manager_under_torchft_lighthouse_many_steps(procs):
    """Ours end to end under torchft's lighthouse: ids only grow, heal is
    assigned once and then everyone is in step."""
    lh = start_torchft(procs, "--min_replicas", "2", "--join_timeout_ms", "100")
    servers = [server(sg, r, lh.addr, 1) for r in ("x", "y")]
    clients = [sg.ManagerClient(s.address(), td(5)) for s in servers]
    steps = [3, 0]
    last = -1
    try:
        for n in range(5):
            res = parallel([lambda i=i: quorum(clients[i], 0, steps[i], "")
                            for i in range(2)])
            assert res[0].quorum_id == res[1].quorum_id >= last
            last = res[0].quorum_id
            assert res[1].heal == (n == 0)
            assert res[0].reconfigure_handles == []
            steps = [res[0].max_step + 1] * 2
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.shutdown()


@pytest.mark.parametrize("lighthouse", ["ours", "torchft"])
def test_wait_lost_against_each_manager(lighthouse):
    """stepguard's WaitLost long poll: a torchft manager answers
    UNIMPLEMENTED (what makes a Manager stop asking), ours waits out the
    deadline and reports nothing lost; under torchft's lighthouse, whose
    heartbeat answers never name a lost member, and under ours."""
    lh = (tf.LighthouseServer("127.0.0.1:0", 1) if lighthouse == "torchft"
          else sg.LighthouseServer("127.0.0.1:0", 1))
    try:
        addr = "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]
        for mod in (tf, sg):
            m = server(mod, f"wl-{mod.__name__}", addr, 1)
            try:
                c = sg.ManagerClient(m.address(), td(5))
                if mod is tf:
                    with pytest.raises(RuntimeError, match="UNIMPLEMENTED"):
                        c._wait_lost(0, td(2))
                else:
                    assert c._wait_lost(0, td(0.3)) is None
                c.close()
            finally:
                m.shutdown()
    finally:
        lh.shutdown()
