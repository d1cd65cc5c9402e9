"""Waking the long-polls: a change wakes every waiting silo's poll only when it can change what a silo is told
(a round opens, the run ends); joins and accepted results wake the round loop alone, so that a thousand waiting
silos are not polled again for each of a thousand joins and every upload."""

from tests.silo_server.test_hub import make_hub, result, start_round, upload, wait_task


def test_joins_and_uploads_wake_the_round_loop_but_not_the_waiting_polls(tmp_path) -> None:
    hub = make_hub(tmp_path, min_silos=3, total_rounds=1)
    wakes = []
    hub.cond.listeners.append(lambda: wakes.append(hub.rounds.phase))
    for name in ("a", "b", "c"):
        hub.join(name, 10, 0, "cpu")
    assert wakes == []  # three joins: no poll's answer changed
    thread, out = start_round(hub)  # the round loop, waiting for silos, still saw the joins
    tasks = {name: wait_task(hub, name) for name in ("a", "b", "c")}
    opened = len(wakes)
    assert opened >= 1 and "training" in wakes  # the task opening woke them: their answer is TRAIN now
    for name, task in tasks.items():
        upload(hub, name, task, result(1.0))
    thread.join(timeout=10)
    assert out["state"].round == 1 and hub.records.history[0].silos_reported == 3
    assert len(wakes) == opened  # three uploads and the round's end: no waiting silo's answer changed
    hub.rounds.set_phase("done")  # the run ending does change it (DONE): every poll is woken
    assert wakes[-1] == "done" and len(wakes) == opened + 1
