"""Suite-wide fixtures."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True, scope="module")
def _earlier_modules_garbage_collected():
    """Whatever earlier modules' tests left for the garbage collector (an HTTP client, a stream not
    closed) is closed before this module's tests open sockets: collected later, mid-test, it would close
    socket numbers the kernel has since given to a new connection of this test (a store's, a router's)
    and unregister them from the event loop, which then waits on them until a deadline passes."""
    gc.collect()
    yield
