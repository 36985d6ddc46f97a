"""The longest GIL hold of the agent's censuses (issue #17), measured as a
second thread sees it: the leaky test service runs under the agent (so
censuses come on suspicion, with referrer chains), while a thread sleeping
1 ms times its wake-ups. Then, in the same process, the raw operations a
census cannot cut: one gc.get_objects() and one gc.get_referrers() pass.

    (sleep 25) | .venv/bin/python agent-python/bench/gil_probe.py URL [REQUESTS]

URL is a collector the test service reports to (its censuses land there:
`oomscope diagnose --agent gilprobe` shows the chain). The service waits
for stdin to close after its last request, so the censuses it owes run.
"""

import gc
import os
import runpy
import sys
import time

# Imported before the ticker starts: an import holds the GIL for long.
import torch
import oomscope

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import Ticker  # noqa: E402 (the side-by-side loop's GIL ticker)

SERVICE = os.path.join(os.path.dirname(__file__), "..", "tests", "programs", "leaky_service.py")


def timed(fn, n=5):
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return min(out) * 1e3, max(out) * 1e3


def main():
    url = sys.argv[1]
    requests = sys.argv[2] if len(sys.argv) > 2 else "500"
    ticker = Ticker()
    ticker.start()
    sys.argv = [SERVICE, "--collector", url, "--name", "gilprobe", "--requests", requests]
    # The agent's own account of its censuses, read before the service stops it.
    stats = {}
    real_stop = oomscope.stop

    def stop(*args, **kwargs):
        stats.update(oomscope.stats() or {})
        return real_stop(*args, **kwargs)

    oomscope.stop = stop
    try:
        runpy.run_path(SERVICE, run_name="__main__")
    except SystemExit:
        pass
    ticker.running = False
    stats = stats or oomscope.stats() or {}
    x = torch.randn(64, 512)
    keep = [x]  # noqa: F841 (a referrer to find)
    referrers = timed(lambda: gc.get_referrers(x))
    objects = timed(gc.get_objects)
    print(
        "%d censuses, their longest GIL hold (the agent's own account): %.1f ms "
        "(%.1f ms of it on CPU); longest GIL wait of a second thread: %.1f ms; "
        "one gc.get_objects(): %.1f-%.1f ms; one gc.get_referrers(): %.1f-%.1f ms; %d objects"
        % ((stats.get("censuses", 0), stats.get("census_longest_hold_ms", 0.0),
            stats.get("census_longest_hold_cpu_ms", 0.0), ticker.longest * 1e3)
           + objects + referrers + (len(gc.get_objects()),))
    )


if __name__ == "__main__":
    main()
