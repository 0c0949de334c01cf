import os

import pytest

# Inductor's parallel compile workers would compete with the ranks for this machine's 2 cores
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Files whose module-scoped fixture is expensive: their tests stay on one pytest-xdist worker.
_ONE_WORKER = ("test_cli.py",)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups off the markers
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup`` (the README's test command): every test that starts
    processes of its own (``multirank``: real gloo ranks, 2 to 4 of them) is in one group, so one worker
    runs them one rank group at a time while the other worker runs the single-process tests beside them:
    on 2 cores the rank groups are the longest path, and two of them side by side (4 to 8 ranks on 2 cores)
    took longer than one after the other (CI's log has the times). Without xdist the markers do nothing."""
    for item in items:
        if item.get_closest_marker("multirank") is not None:
            item.add_marker(pytest.mark.xdist_group("ranks"))
        elif item.path.name in _ONE_WORKER:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
