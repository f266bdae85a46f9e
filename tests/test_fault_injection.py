"""Fault injection: a training run (a batched model, ``batchlayers.optim.Adam``, a scheduler,
``model_data_loader`` with two workers drawing random augmentations, a ``TrainState`` checkpoint every two
steps with ``batchlayers.save``) is killed with SIGKILL 20 times, at points drawn at random inside a save,
inside a training step, and between the batches of an epoch while the workers prefetch. Each time, every
checkpoint file the kill left is whole and equal to the uninterrupted run's, and the run resumed from the
last one ends with exactly the uninterrupted run's weights, optimizer, scheduler, sampler and generator
states.

The runs are forked from one server process that imported torch once (an import takes seconds on a busy
2-core machine). A kill point is a (window, step, line) triple: the line-th Python line executed inside a
window (a save, a step) of the given step, counted with ``sys.settrace``, or the start of a step. A run told
to die there writes ``KILLME`` and blocks until the test sends SIGKILL to its process group (the run and its
DataLoader workers), so the kill lands exactly there, with no timing involved. The uninterrupted reference
run counts the lines of every window, and for each save the lines during which its temporary file exists,
so that some kills are aimed into the middle of writing a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_resume import AugmentedDataset, assert_same
from torch import nn

import batchlayers as bl

NUM_MODELS, NUM_SAMPLES, BATCH_SIZE, EPOCHS, EVERY = 4, 32, 8, 3, 2
PER_EPOCH = NUM_SAMPLES // BATCH_SIZE
TOTAL = EPOCHS * PER_EPOCH  # 12 steps; checkpoints after steps 2, 4, ..., 12 (4 and 8 end an epoch)
SAVE_STEPS = list(range(EVERY, TOTAL + 1, EVERY))
KILLS = 20
TIMEOUT = 60  # seconds any one message from the server may take before the test fails


def checkpoint_name(step: int) -> str:
    return f"step-{step:04d}.pt"


# ---------------------------------------------------------------- the training run (in the forked process)


def say(message: str) -> None:
    os.write(sys.stdout.fileno(), f"{message}\n".encode())  # one write: lines of processes never interleave


class KillPoints:
    """Counts the Python lines run inside each window, and blocks at the line a kill is aimed at."""

    def __init__(self, workdir: Path, kill: dict | None, count: bool) -> None:
        self.workdir, self.kill, self.count = workdir, kill, count

    def die_here(self) -> None:
        say("KILLME")
        os.read(0, 1)  # blocks until the SIGKILL (or returns if the test itself died: stdin closed)
        os._exit(3)

    def at(self, window: str, step: int) -> None:
        if self.kill is not None and (self.kill["window"], self.kill["step"]) == (window, step):
            self.die_here()

    @contextlib.contextmanager
    def window(self, window: str, step: int) -> Iterator[None]:
        aimed = self.kill is not None and (self.kill["window"], self.kill["step"]) == (window, step)
        if not aimed and not self.count:
            yield
            return
        lines, temporary_lines = 0, []

        def trace(frame: Any, event: str, arg: Any) -> Any:
            nonlocal lines
            if event == "line":
                lines += 1
                if aimed and lines == self.kill["line"]:
                    self.die_here()
                if self.count and window == "save" and any(n.startswith(".step-") for n in os.listdir(self.workdir)):
                    temporary_lines.append(lines)
            return trace

        sys.settrace(trace)
        try:
            yield
        finally:
            sys.settrace(None)
        if self.count:
            span = [temporary_lines[0], temporary_lines[-1]] if temporary_lines else None
            say("COUNT " + json.dumps({"window": window, "step": step, "lines": lines, "temporary": span}))


def build() -> tuple[bl.TrainState, Any]:
    torch.manual_seed(0), random.seed(0)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(NUM_SAMPLES, 6, generator=generator), torch.randint(3, (NUM_SAMPLES,), generator=generator)
    model = nn.Sequential(
        bl.BatchedLinear(NUM_MODELS, 6, 16), nn.Dropout(0.1), nn.Tanh(), bl.BatchedLinear(NUM_MODELS, 16, 3)
    )
    optimizer = bl.optim.Adam(model.parameters(), lr=torch.logspace(-3, -1, NUM_MODELS))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    loader = bl.model_data_loader(
        AugmentedDataset(x, y),
        NUM_MODELS,
        BATCH_SIZE,
        seed=3,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    return bl.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader), loader


def train(workdir: str, kill: dict | None = None, count: bool = False) -> None:
    """Train from the newest checkpoint in ``workdir`` (or from scratch) to the end, saving every EVERY steps."""
    workdir = Path(workdir)
    points = KillPoints(workdir, kill, count)
    state, loader = build()
    model, optimizer, scheduler, _ = state.objects.values()
    checkpoints = sorted(workdir.glob("step-*.pt"))
    if checkpoints:
        state.load_state_dict(bl.load(checkpoints[-1]))
    say(f"RESUMED {checkpoints[-1].name if checkpoints else None}")
    position = loader.state_dict()
    step = position["epoch"] * PER_EPOCH + position["batches_yielded"]
    while loader.batch_sampler.sampler.epoch < EPOCHS:
        for xb, yb in loader:
            step += 1
            points.at("batch", step)  # the batch is here, the workers are fetching the next ones
            with points.window("step", step):
                losses = bl.losses.cross_entropy(model(xb), yb)
                optimizer.zero_grad()
                losses.sum().backward()
                optimizer.step()
            if step % EVERY == 0:
                with points.window("save", step):
                    bl.save(state.state_dict(), workdir / checkpoint_name(step))
        scheduler.step()
    say("DONE")


def serve() -> None:
    """Reads one JSON job per line, runs ``train(**job)`` in a forked child, reports START and EXIT."""
    torch.set_num_threads(1)
    # A run resumed after an epoch's last step calls scheduler.step() before its first optimizer.step().
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setpgid(0, 0)  # its own group, which its DataLoader workers join: one killpg kills all
                train(**job)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # also here, so the group exists before anyone hears of the pid
        say(f"START {pid}")
        _, status = os.waitpid(pid, 0)
        say(f"EXIT {pid} {status}")


# ---------------------------------------------------------------- the test side


class Server:
    def __init__(self, tmp: Path) -> None:
        tests, root = Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent
        self.stderr_path = tmp / "server.stderr"
        self.stderr = open(self.stderr_path, "w")  # closed in close()
        code = (
            f"import sys; sys.path[:0] = [{str(root)!r}, {str(tests)!r}]; import test_fault_injection as t; t.serve()"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            cwd=root,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.children: list[int] = []

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def fail(self, why: str) -> None:
        self.stderr.flush()
        pytest.fail(f"{why}\n--- server stderr ---\n{self.stderr_path.read_text()[-4000:]}")

    def next_line(self) -> str:
        try:
            line = self.lines.get(timeout=TIMEOUT)
        except queue.Empty:
            self.fail(f"no message from the training server within {TIMEOUT} s")
        if line is None:
            self.fail("the training server exited")
        return line

    def run(self, workdir: Path, kill: dict | None = None, count: bool = False) -> tuple[list[str], bool]:
        """Runs ``train`` in a fresh child; returns its messages and whether it was killed."""
        self.process.stdin.write(json.dumps({"workdir": str(workdir), "kill": kill, "count": count}) + "\n")
        self.process.stdin.flush()
        start = self.next_line()
        if not start.startswith("START "):
            self.fail(f"expected START, got {start!r}")
        pid = int(start.split()[1])
        self.children.append(pid)
        messages, killed = [], False
        while not (line := self.next_line()).startswith("EXIT "):
            if line == "KILLME":
                os.killpg(pid, signal.SIGKILL)
                killed = True
            else:
                messages.append(line)
        status = int(line.split()[2])
        if killed:
            if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
                self.fail(f"the run was to die by SIGKILL, its wait status is {status}")
        elif not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and messages[-1:] == ["DONE"]):
            self.fail(f"the run failed (wait status {status}); its messages: {messages}")
        return messages, killed

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()  # the server's loop ends
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=TIMEOUT)
        for group in [self.process.pid, *self.children]:  # whatever is left after a failure
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        self.process.wait(timeout=TIMEOUT)
        self.reader.join(timeout=TIMEOUT)
        self.process.stdout.close()
        self.stderr.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("server"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference(server: Server, tmp_path_factory) -> dict[str, Any]:
    """The uninterrupted run: its checkpoints, and the lines of its windows."""
    workdir = tmp_path_factory.mktemp("reference")
    messages, _ = server.run(workdir, count=True)
    counts = {}
    for message in messages:
        if message.startswith("COUNT "):
            entry = json.loads(message[len("COUNT ") :])
            counts[entry["window"], entry["step"]] = entry
    checkpoints = {checkpoint_name(step): bl.load(workdir / checkpoint_name(step)) for step in SAVE_STEPS}
    assert sorted(p.name for p in workdir.iterdir()) == sorted(checkpoints), "the uninterrupted run left other files"
    return {"counts": counts, "checkpoints": checkpoints}


SAVE_PHASES = ["writing", "before", "after"]  # the temporary file exists / is yet to be created / was renamed


def kill_point(case: int, counts: dict) -> dict:
    """Case ``case``'s kill, drawn from a generator seeded with it: a third inside saves (in turn while the
    temporary file exists, before it is created, and after it was renamed onto the checkpoint), a third inside
    steps, a third between batches."""
    rng = random.Random(f"kill-{case}")
    window = ["save", "step", "batch"][case % 3]
    if window == "batch":
        return {"window": window, "step": rng.randint(1, TOTAL), "line": 0}
    step = rng.choice(SAVE_STEPS) if window == "save" else rng.randint(1, TOTAL)
    lines = counts[window, step]["lines"]
    if window == "step":
        return {"window": window, "step": step, "line": rng.randint(1, lines)}
    first, last = counts[window, step]["temporary"]
    phase = SAVE_PHASES[case // 3 % 3]
    low, high = {"writing": (first, last), "before": (1, first - 1), "after": (last + 1, lines)}[phase]
    return {"window": window, "step": step, "line": rng.randint(low, high), "phase": phase}


def check_checkpoints(workdir: Path, reference: dict) -> list[str]:
    """Every checkpoint file is whole and equal to the uninterrupted run's at that step; returns their names."""
    names = sorted(p.name for p in workdir.glob("step-*.pt"))
    for name in names:
        assert_same(bl.load(workdir / name), reference["checkpoints"][name], name)
    return names


@pytest.mark.parametrize("case", range(KILLS))
def test_killed_run_resumes_exactly(case: int, server: Server, reference: dict, tmp_path: Path) -> None:
    kill = kill_point(case, reference["counts"])
    _, killed = server.run(tmp_path, kill=kill)
    assert killed, f"the run never reached its kill point {kill}"
    names = check_checkpoints(tmp_path, reference)
    saved = [s for s in SAVE_STEPS if s < kill["step"] or (s == kill["step"] and kill.get("phase") == "after")]
    assert names == [checkpoint_name(s) for s in saved], f"kill {kill}"
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name not in names)
    if kill.get("phase") == "writing":  # the kill hit the write: its temporary file, hidden, is all that is left
        assert len(leftovers) == 1 and leftovers[0].startswith(f".{checkpoint_name(kill['step'])}.tmp-"), leftovers
    else:
        assert leftovers == [], f"kill {kill}"
    messages, _ = server.run(tmp_path)
    assert messages[0] == f"RESUMED {names[-1] if names else None}", "not resumed from the newest checkpoint"
    assert check_checkpoints(tmp_path, reference) == [checkpoint_name(s) for s in SAVE_STEPS]
