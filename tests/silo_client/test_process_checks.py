"""Start-up checks that depend on the run and the process only run once per process (silo-sim hosts hundreds of
silos in one), and a failed one is never remembered."""

import pytest

from silo_client.run_checks import ProcessChecks


def test_a_passed_check_runs_once_per_key_and_a_failed_one_runs_again() -> None:
    checks, calls = ProcessChecks(), []
    for _ in range(3):
        checks.once(("rehearse", "small_cnn", "cpu"), lambda: calls.append("small_cnn"))
    checks.once(("rehearse", "wrn28_2", "cpu"), lambda: calls.append("wrn28_2"))
    assert calls == ["small_cnn", "wrn28_2"]

    def broken() -> None:
        calls.append("broken")
        raise RuntimeError("CUDA out of memory")

    for _ in range(2):
        with pytest.raises(RuntimeError, match="out of memory"):
            checks.once(("rehearse", "big", "cuda"), broken)
    assert calls.count("broken") == 2  # every silo that tries a failing check fails alike
