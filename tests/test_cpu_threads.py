"""The CPU thread plan: count from the free cores, --threads override, wait policy set before torch loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ninfer.engine import cpu_threads
from ninfer.engine.cpu_threads import LoadProbe, ThreadPlan, choose


@pytest.mark.parametrize("cores, busy, threads", [
    (2, 0.0, 2), (2, 0.3, 2), (2, 0.4, 1), (2, 1.0, 1), (2, 2.0, 1), (2, 5.0, 1),
    (8, 0.0, 8), (8, 2.9, 5), (8, 3.2, 5), (8, 3.5, 4), (1, 0.0, 1), (4, None, 4),
])
def test_choose_counts_the_cores_others_leave_free(cores: int, busy: float | None, threads: int) -> None:
    assert choose(cores, busy) == threads


def test_requested_threads_win_without_measuring() -> None:
    plan = cpu_threads.plan(3)
    assert plan.threads == 3 and plan.source == "--threads" and plan.busy_elsewhere is None
    assert "set by --threads" in plan.describe()


def test_probe_measures_other_processes_not_this_one() -> None:
    """This process spinning for the whole interval is not counted as load from elsewhere."""
    probe = LoadProbe()
    import time
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    busy = probe.busy_elsewhere(os.cpu_count() or 1)
    if busy is None:
        pytest.skip("no /proc here")
    assert 0.0 <= busy <= (os.cpu_count() or 1)


def test_describe_names_count_cores_load_and_policy() -> None:
    text = ThreadPlan(1, "PASSIVE", 2, 1.02, "measured").describe()
    assert text == "cpu threads: 1 of 2 cores (1.0 of them busy with other processes); OpenMP wait policy PASSIVE"


def _fresh_prepare(requested: int | None, env: dict[str, str]) -> dict:
    code = ("import json, os, sys; from ninfer.engine import cpu_threads as c; p = c.prepare(%r); import torch; "
            "print(json.dumps({'threads': p.threads, 'policy': p.wait_policy, "
            "'env_policy': os.environ.get('OMP_WAIT_POLICY'), 'torch_threads': torch.get_num_threads()}))" % requested)
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**clean, **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_prepare_before_torch_sets_count_and_passive_policy() -> None:
    got = _fresh_prepare(1, {})
    cores = len(os.sched_getaffinity(0))
    assert got["threads"] == got["torch_threads"] == 1
    if cores > 1:  # fewer threads than cores: OpenMP threads sleep instead of spinning
        assert got["policy"] == got["env_policy"] == "PASSIVE"


def test_prepare_keeps_the_users_wait_policy() -> None:
    got = _fresh_prepare(1, {"OMP_WAIT_POLICY": "active"})
    assert got["env_policy"] == "active" and got["policy"] == "ACTIVE"


def test_negative_threads_is_a_config_error() -> None:
    from ninfer.errors import ConfigError
    with pytest.raises(ConfigError, match="--threads"):
        cpu_threads.prepare(-1)


def test_adapter_follows_the_load_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Started with 2 threads on 2 cores: when others take a core it steps down to 1, and back up
    when they leave; not before `every_s` has passed."""
    import torch

    before = torch.get_num_threads()
    loads = iter([1.0, 1.0, 0.1])
    adapter = cpu_threads.ThreadAdapter(ThreadPlan(2, "default", 2, 0.0, "measured"), every_s=0.0)
    monkeypatch.setattr(adapter._probe, "busy_elsewhere", lambda cores: next(loads))
    try:
        adapter.tick()
        assert adapter.threads == torch.get_num_threads() == 1
        adapter.tick()
        assert adapter.threads == 1
        adapter.tick()
        assert adapter.threads == torch.get_num_threads() == 2
        adapter.every_s = 3600.0
        adapter._next = float("inf")
        adapter.tick()  # not due: the probe is not read again (the iterator is exhausted)
    finally:
        torch.set_num_threads(before)


def test_bench_probes_run_on_the_engine_thread(monkeypatch) -> None:
    """`ninfer bench`'s ceiling probes run where the model's torch calls run: a torch op on another
    thread gives it a second OpenMP team, and libgomp then stops spinning at every barrier."""
    import concurrent.futures
    import threading

    import torch

    from ninfer.cli import bench

    ran_on = []
    monkeypatch.setattr("ninfer.kernels.probes.measure_ceilings",
                        lambda device, dtype: ran_on.append(threading.current_thread()) or "ceilings")

    class Worker:
        thread: threading.Thread

        def call_on_worker(self, fn):
            future = concurrent.futures.Future()
            self.thread = threading.Thread(target=lambda: future.set_result(fn()))
            self.thread.start()
            self.thread.join()
            return future

    worker = Worker()
    assert bench._ceilings(worker, "cpu", torch.bfloat16) == "ceilings"
    assert ran_on == [worker.thread]
