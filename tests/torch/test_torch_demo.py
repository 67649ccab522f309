"""The main job: `hp-cp demo` (reference stack and the transformers model) passes parity."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from hp_cp_torch.cli.commands import main


def test_demo_reference_cp2(capsys):
    assert main(["demo", "--cp", "2", "--layout", "load_balanced"]) == 0
    out = capsys.readouterr().out
    assert "PARITY OK" in out and "bytes sent" in out


def test_demo_transformers_cp2(capsys):
    pytest.importorskip("transformers")
    assert main(["demo", "--cp", "2", "--model", "transformers"]) == 0
    out = capsys.readouterr().out
    assert "PARITY OK" in out and "compressed_sparse_attention" in out


# ------------------------------------------------------------------ refusals (issue 12)
# Each is one line on stderr and exit status 2, before any rank starts.


def _refused(capsys, *argv: str) -> str:
    assert main(["demo", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("hp-cp demo: error: ")
    return lines[0]


def test_demo_refuses_more_ranks_than_the_machine_hosts(capsys):
    line = _refused(capsys, "--cp", "100000")
    assert "--cp 100000 would start 100000 local processes" in line
    assert "CPU core(s)" in line and "GiB of available memory" in line
    assert "--allow-oversubscribe" in line and "--launcher torchrun" in line


def test_capacity_counts_cores_and_memory():
    from hp_cp_torch.cli.commands import demo_refusal

    def args(cp, oversubscribe=False):
        return argparse.Namespace(
            cp=cp,
            launcher="local",
            allow_oversubscribe=oversubscribe,
            seq_len=None,
            layout="contiguous",
        )

    gib = 2**30
    assert demo_refusal(args(8), cores=2, memory_bytes=20 * gib) is None
    line = demo_refusal(args(9), cores=2, memory_bytes=20 * gib)
    assert "2 CPU core(s) and 20.0 GiB" in line and "hosts at most 8. Use --cp 8" in line
    line = demo_refusal(args(8), cores=64, memory_bytes=2 * gib)  # memory-bound: 4 fit
    assert "hosts at most 4" in line
    assert demo_refusal(args(100, oversubscribe=True), cores=2, memory_bytes=gib) is None


def test_demo_rejects_bad_cp(capsys):
    assert _refused(capsys, "--cp", "0").endswith("--cp must be >= 1, got 0.")


@pytest.mark.parametrize("length", ["0", "-5"])
def test_demo_refuses_a_non_positive_seq_len(capsys, length):
    line = _refused(capsys, "--cp", "2", "--seq-len", length)
    assert f"--seq-len must be a positive number of tokens, got {length}" in line


def test_demo_refuses_a_seq_len_the_layout_cannot_shard(capsys):
    line = _refused(capsys, "--cp", "4", "--seq-len", "1001")
    assert "needs the sequence length to be a multiple of 4; got 1001 rows" in line
    assert line.endswith("For the demo: --seq-len 1000 or 1004.")
    line = _refused(capsys, "--cp", "2", "--seq-len", "6", "--layout", "load_balanced")
    assert "multiple of 4" in line and line.endswith("--seq-len 4 or 8.")


def test_demo_refuses_torchrun_outside_torchrun(capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    line = _refused(capsys, "--launcher", "torchrun")
    assert "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not set" in line
    assert "torchrun --nproc-per-node N -m hp_cp_torch.cli demo --launcher torchrun" in line


def test_refusal_exit_status_from_the_command_line():
    """The real entry point: exit status 2, one stderr line, no traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "hp_cp_torch.cli", "demo", "--cp", "4", "--seq-len", "1001"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr


# ------------------------------------------------------------------ the launcher


def _late_group(rank: int, world: int) -> int:
    """Rank 0 returns at once; rank 1 makes a group of its own two seconds later, which needs
    the store rank 0's process hosts."""
    import time

    import torch
    import torch.distributed as dist

    if rank == 0:
        return 0
    time.sleep(2)
    group = dist.new_group([1], use_local_synchronization=True)
    one = torch.ones(1)
    dist.all_reduce(one, group=group)
    return int(one.item())


def test_a_rank_that_returns_early_keeps_the_store_up_for_the_rest():
    from hp_cp_torch.cli.launch import run_ranks

    assert run_ranks(2, _late_group, timeout=120) == [0, 1]


_ORPHAN_JOB = """
import os, sys, time
from hp_cp_torch.cli.launch import run_ranks

def wait_forever(rank, world, folder):
    with open(os.path.join(folder, f"{rank}.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(600)

if __name__ == "__main__":
    run_ranks(2, wait_forever, sys.argv[1], timeout=900)
"""


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a container's init may never reap one)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_ranks_die_with_the_process_that_launched_them(tmp_path):
    """A killed launcher (``kill -9`` of ``hp-cp bench``, say) leaves no rank running on."""
    import os
    import signal
    import time

    script = tmp_path / "job.py"
    script.write_text(_ORPHAN_JOB)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert parent.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.2)
        ranks = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert all(_running(pid) for pid in ranks)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in ranks if _running(pid)]
    for pid in left:  # do not leave them to the next test either
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher"
