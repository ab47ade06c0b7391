"""The /proc process-tree helpers the launcher and the fault-injection tests share."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from arealite.utils import procs

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")


def test_descendants_alive_and_cmdline_of_a_real_process_tree():
    # A child that starts a grandchild, then both sleep.
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        # (Wait on the child's own tree: this process may have other children, e.g. a Ray
        # cluster a module fixture started.)
        while not procs.descendants(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        below = procs.descendants(child.pid)
        assert len(below) == 1 and below[0] in procs.descendants(os.getpid())
        assert procs.descendants(os.getpid()).index(child.pid) < procs.descendants(os.getpid()).index(below[0])
        assert "time.sleep(30)" in procs.cmdline(below[0])
        assert procs.is_alive(child.pid) and procs.is_alive(below[0])
        os.kill(below[0], 9)
        child.kill()
        time.sleep(0.2)
        # The killed child is a zombie until reaped: dead all the same.
        assert not procs.is_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not procs.is_alive(child.pid)
    assert procs.cmdline(child.pid) is None
