"""Shared by the hub tests: no silo thread of one test keeps running into the next."""

import pytest

from tests.silo_server.test_privacy import Silo


@pytest.fixture(autouse=True)
def end_silo_threads():
    yield
    for silo in Silo.started:
        silo.finished.set()
    for silo in Silo.started:
        if silo.is_alive():  # some tests build silos they never start
            silo.join(5)
    Silo.started.clear()
