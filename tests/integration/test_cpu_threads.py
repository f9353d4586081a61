"""`CpuShare` against torch itself: a compute thread's torch thread count is set on that thread only."""

from __future__ import annotations

from gpu_worker.cpu_threads import CpuShare


def test_cpu_share_sets_threads_on_the_reporting_thread_only():
    import threading

    import torch

    before = torch.get_num_threads()
    share = CpuShare(["short", "main"], cores=2)
    seen: list[int] = []

    def engine() -> None:
        share.report("main", True)
        seen.append(torch.get_num_threads())

    share.report("short", True)
    t = threading.Thread(target=engine)
    t.start()
    t.join()
    assert seen == [1]
    share.report("short", False)  # idle: nothing is set on this thread
    assert share._set == {"short": 2, "main": 1}
    torch.set_num_threads(before)
