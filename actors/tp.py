"""Tensor-parallel ranks of one engine: rank 0 is the engine's own worker, ranks 1..N-1 are spawned processes
(`actors.tp_rank`) that each hold their shard of the model and their own KV pool (their KV heads), run every step
rank 0 runs, and discard their logits (every rank computes the same whole logits; rank 0 samples).

Each step, rank 0 sends the step's prepared inputs (`StepInputs`: small host tensors) over one pipe per rank,
pickled, and then runs its forward; the ranks' forwards meet in the model's all-reduces (gloo on the CPU, NCCL on
GPUs). A pipe rather than a torch.distributed broadcast: the ranks need a pipe anyway (startup handshake, stop,
errors), it carries variable-sized inputs in one message where a broadcast needs their sizes first, a dead rank
shows on it at once (a broken pipe), and it is the same on the CPU and on GPUs (no gloo group beside the NCCL one).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import pickle
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from voltserve import owned_dirs
from voltserve.config import EngineConfig
from voltserve.distributed import init_tp_group
from voltserve.errors import EngineDeadError
from voltserve.runner import ModelRunner

logger = logging.getLogger(__name__)

# how long a rank may take to start (import torch, join the group, load its shard) and to stop
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0
FOLDER_PREFIX = "voltserve-tp-"  # the rendezvous folders, in the temporary folder
# how long a failed step waits for a rank process to be seen gone, so the error names its exit code
_EXIT_GRACE_S = 2.0


class TPRanks:
    """The rank processes 1..N-1 of one engine, and this process's membership (rank 0) in their group.

    Attributes:
        tp: rank 0's TPGroup (torch.distributed's default group, joined in `start`).
        procs: rank r's process at index r - 1.
    """

    def __init__(self, folder: str):
        self.folder = folder
        self.tp = None
        self.procs: list[mp.Process] = []
        self.conns: list[mpc.Connection] = []
        self._stopping = False
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)  # wakes the watcher thread at stop
        self._watcher: threading.Thread | None = None

    @classmethod
    def start(cls, config: EngineConfig, device: str, spare_cores: int = 0) -> "TPRanks":
        """Spawn ranks 1..N-1 (N = config.tensor_parallel_size) and join their group as rank 0 (rendezvous through
        a file in a fresh temporary folder, so no port can clash; `voltserve.owned_dirs`: the folders of engines
        that were killed are removed here). Returns once the group exists; the ranks then load their shards while
        rank 0 loads its own.

        Raises:
            RuntimeError: a rank died or reported an error before joining the group (its traceback included).
        """
        from actors.tp_rank import rank_main  # the spawned process imports it by name

        ranks = cls(owned_dirs.make(FOLDER_PREFIX))
        init_method = f"file://{ranks.folder}/store"
        ctx = mp.get_context("spawn")  # fork would copy this process's threads and CUDA state
        try:
            for rank in range(1, config.tensor_parallel_size):
                ours, theirs = ctx.Pipe()
                level = logging.getLogger().getEffectiveLevel() or logging.WARNING  # NOTSET would log all
                args = (rank, config, device, init_method, spare_cores, theirs, level)
                proc = ctx.Process(target=rank_main, args=args, name=f"voltserve-tp-rank{rank}",
                                   daemon=True)  # never outlives the engine
                proc.start()
                theirs.close()
                ranks.procs.append(proc)
                ranks.conns.append(ours)
            # every rank reached its rendezvous: rank 0 blocks in it only while the others are there too
            for rank in range(1, config.tensor_parallel_size):
                ranks._expect(rank, "hello")
            ranks.tp = init_tp_group(0, config.tensor_parallel_size, init_method, device)
        except BaseException:
            ranks.stop()
            raise
        return ranks

    def agree_num_blocks(self, own: int) -> int:
        """The KV pool size of every rank: the smallest any rank can hold (`own` is rank 0's). Sends it to the
        ranks and returns once each has allocated its pool.

        Raises:
            RuntimeError: a rank failed while loading or allocating.
        """
        num_blocks = min([own] + [self._expect(r, "capacity")[1] for r in range(1, len(self.procs) + 1)])
        for conn in self.conns:
            conn.send(num_blocks)
        for rank in range(1, len(self.procs) + 1):
            self._expect(rank, "ready")
        return num_blocks

    def _expect(self, rank: int, tag: str) -> tuple:
        """Rank `rank`'s next startup message, which must be (tag, ...)."""
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        if not mpc.wait([conn, proc.sentinel], START_TIMEOUT_S):
            raise RuntimeError(f"tensor-parallel rank {rank} sent no {tag!r} in {START_TIMEOUT_S:.0f} s")
        try:
            msg = conn.recv() if conn.poll() else None
        except EOFError:
            msg = None
        if msg is None:
            proc.join(_EXIT_GRACE_S)
            raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.exitcode} while starting")
        if msg[0] == "error":
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{msg[1]}")
        if msg[0] != tag:
            raise RuntimeError(f"tensor-parallel rank {rank} sent {msg[0]!r}, expected {tag!r}")
        return msg

    def send_step(self, step) -> None:
        """Hand a prepared step (`StepInputs`, host tensors) to every rank, which runs its forward at once.

        Raises:
            EngineDeadError: a rank is gone (its pipe is closed).
        """
        payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            try:
                conn.send_bytes(payload)
            except OSError as exc:  # BrokenPipeError / ConnectionResetError: the rank exited
                raise self.dead_error() from exc

    def dead_error(self) -> EngineDeadError:
        """EngineDeadError naming the first rank process that exited (waiting up to a moment for one to)."""
        # exit codes are polled, never waited for: the watcher thread may look at once, and while one thread's
        # waitpid reaps a process the other's finds nothing (exitcode None for a moment, not for good)
        deadline = time.monotonic() + _EXIT_GRACE_S
        while True:
            for rank, proc in enumerate(self.procs, 1):
                if (code := proc.exitcode) is not None:
                    return EngineDeadError(f"tensor-parallel rank {rank} exited with code {code}")
            if time.monotonic() > deadline:
                return EngineDeadError("a tensor-parallel step failed; the ranks are out of step")
            time.sleep(0.01)

    def watch(self, on_exit: Callable[[int, int], None]) -> None:
        """Call on_exit(rank, exit code) from a thread when a rank process exits before `stop`."""

        def run() -> None:
            sentinels = {p.sentinel: r for r, p in enumerate(self.procs, 1)}
            ready = mpc.wait(list(sentinels) + [self._wake_r])
            if self._stopping:
                return
            rank = next(sentinels[s] for s in ready if s in sentinels)
            proc = self.procs[rank - 1]
            while (code := proc.exitcode) is None:  # gone (sentinel closed); maybe being reaped by dead_error
                time.sleep(0.01)
            on_exit(rank, code)

        self._watcher = threading.Thread(target=run, name="tp-rank-watcher", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """Stop every rank (a stop message, then terminate / kill what has not exited in STOP_TIMEOUT_S) and leave
        the group. Idempotent; blocks (call it off the event loop)."""
        self._stopping = True
        self._wake_w.send_bytes(b"")
        stop = pickle.dumps(None)
        for conn in self.conns:
            try:
                conn.send_bytes(stop)
            except OSError:
                pass  # already gone
        for rank, proc in enumerate(self.procs, 1):
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                logger.warning("tensor-parallel rank %d did not stop in %.0f s; terminating it", rank,
                               STOP_TIMEOUT_S)
                proc.terminate()
                proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns = []
        if self.tp is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.tp = None
        if self._watcher is not None:
            self._watcher.join()
        owned_dirs.remove(self.folder)


class TPModelRunner(ModelRunner):
    """Rank 0's ModelRunner: every eager forward first hands its inputs to the other ranks (`TPRanks.send_step`).
    Steps always run eagerly (no `graphs`), so `async_sampler` is None and nothing is launched ahead.

    A forward that raises leaves the other ranks waiting in, or past, a collective rank 0 never reached: the ranks
    are out of step for good, so the error is EngineDeadError (the engine dies, it does not fail one step).
    """

    def __init__(self, *args, ranks: TPRanks, **kwargs):
        super().__init__(*args, **kwargs)
        self.ranks = ranks

    def forward(self, step):
        self.ranks.send_step(step)
        try:
            return super().forward(step)
        except Exception as exc:
            raise self.ranks.dead_error() from exc
