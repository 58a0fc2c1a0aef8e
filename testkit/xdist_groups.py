"""Makes `--dist loadgroup` (pyproject addopts) see the suite's `xdist_group` marks, and hands
the workers the `slow` tests first.

pytest-xdist 3.8 tells the scheduler a test's group by renaming the collected item to
`nodeid@group` through the `_nodeid` attribute; pytest 9 keeps an item's id in `_id` instead,
so that rename no longer takes and every test was scheduled alone: the tests sharing the
`spark` session ran on all four workers at once, each starting its own Spark JVM (about 1.5 GB
and tens of seconds of CPU each on a 2-core machine). This renames the item the way pytest 9
keeps ids, after xdist's own hook, unless the name already carries the group.

The scheduler hands out groups (largest first), then single tests in collection order; the
worker that finishes last sets the run's wall time. So the tests that start processes or wait
on timers (`slow`, seconds each) go out first and the quick ones (milliseconds) fill the end,
instead of a story of tens of seconds starting when the other workers are nearly done.
"""

from __future__ import annotations

import pytest
from _pytest.nodeid import coerce_node_id


@pytest.hookimpl(trylast=True)  # after every hook that adds `xdist_group` marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # set on the workers of `loadgroup`
        return
    for item in items:
        groups = sorted({
            str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            for mark in item.iter_markers("xdist_group")
        })
        if not groups or _grouped(item.nodeid):
            continue
        item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")
    # stable: each part keeps its order (a module's tests, pytest's grouping by parameter)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _grouped(nodeid: str) -> bool:
    """Whether the id already names a group (the suffix xdist's scheduler splits off)."""
    return nodeid.rfind("@") > nodeid.rfind("]")
