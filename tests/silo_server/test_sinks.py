"""A round's record reaches every sink through one interface: history.json, Prometheus, TensorBoard, a callback."""

from __future__ import annotations

import json

import pytest

from silo_server.rounds.sinks import HistoryFile, TensorBoardSink
from tests.silo_server.test_hub import make_hub, result, upload, wait_task


def _rounds(hub, n):
    import threading

    for s in ("a", "b"):
        hub.join(s, 10, 0, "cpu")
    state = hub.rounds.resume_or_init()
    for r in range(1, n + 1):
        out = {}
        thread = threading.Thread(target=lambda st=state, o=out: o.setdefault("state", hub.rounds.run_round(st)),
                                  daemon=True)
        thread.start()
        for s, value in (("a", 1.0 * r), ("b", 3.0 * r)):
            upload(hub, s, wait_task(hub, s), result(value))
        thread.join(30)
        state = out["state"]


def test_every_sink_gets_each_round_in_order_and_tensorboard_holds_the_records_numbers(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen = []
    hub = make_hub(tmp_path / "state", on_round=lambda r: seen.append(("callback", r.round)))
    assert [type(s) for s in hub.rounds.sinks] == [HistoryFile]
    board = TensorBoardSink(tmp_path / "tb" / hub.run_id, initial=lambda: hub.records.initial)
    hub.rounds.sinks.append(board)

    class Recording:
        def round_done(self, record):
            history = json.loads((tmp_path / "state" / "history.json").read_text())["rounds"]
            seen.append(("recording", record.round, len(history)))  # history.json is written before

        def attempt_failed(self, failed):
            seen.append(("failed", failed.round))

        def close(self):
            seen.append(("closed",))

    hub.rounds.sinks.append(Recording())
    _rounds(hub, 2)
    hub.rounds.close_sinks()
    assert seen == [("recording", 1, 1), ("callback", 1), ("recording", 2, 2), ("callback", 2), ("closed",)]
    events = EventAccumulator(str(tmp_path / "tb" / hub.run_id))
    events.Reload()
    rounds = [s.step for s in events.Scalars("silos/reported")]
    assert rounds == [1, 2] and [s.value for s in events.Scalars("silos/reported")] == [2.0, 2.0]
    wire = [s.value for s in events.Scalars("wire/bytes_up")]
    assert wire == [float(r.bytes_up) for r in hub.records.history]
    assert [s.step for s in events.Scalars("time/round_seconds")] == [1, 2]


def test_a_missing_tensorboard_package_is_one_clear_line(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def without_tensorboard(name, *args, **kw):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", without_tensorboard)
    with pytest.raises(ValueError, match=r'run.tensorboard needs the tensorboard package .*pip install '
                                         r'"silokit\[tensorboard\]"'):
        TensorBoardSink(tmp_path / "tb")
