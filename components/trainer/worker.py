"""The entry point of every process of a run: its role comes from its rank (roles.py).

    python -m components.trainer.worker      # a process spawned by `scalerl train` (launcher.py)
    run_training(...) inside a Slurm task     # experiments/train.py calls `run_role` directly

- learner rank 0 (the hub): `Trainer(...).run()` (loop.py), owns the run directory;
- learner rank k >= 1: `follower_main`, which trains its share of every step (FSDP2
  collectives with the other learner ranks), joins the weight gathering, checkpoints its shard;
- generator i: `generator_main` (generator.py).
Learner ranks form one torch.distributed group (gloo on CPU, NCCL on GPU) when T > 1.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from components.trainer import messages as M
from components.trainer.roles import pin_cpu, settle_heap
from components.trainer.exits import exit_code_of, exit_process, record_hub_lost
from components.trainer.runlog import record_exception

__all__ = ["run_role", "follower_main", "hub_main", "init_learner_group", "main", "exit_after"]


def exit_after(grace_s: float) -> threading.Timer:
    """End this process with code 0 `grace_s` from now unless it has ended by then: for a peer
    whose role is over and that still returns to a caller (submitit writes the task's result
    after the function returns), so that a thread that never returns (a hung verifier's) cannot
    keep the process, and its Slurm task, alive through interpreter shutdown."""
    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    timer = threading.Timer(grace_s, leave)
    timer.daemon = True
    timer.start()
    return timer


def init_learner_group(rank: int, world_size: int, endpoints, device: str, timeout_s: float) -> None:
    """The learner ranks' torch.distributed group (the FSDP2 group), when there is more than one."""
    import torch
    import torch.distributed as dist

    if world_size <= 1 or dist.is_initialized():
        return
    backend = "nccl" if str(device).startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    else:
        from components.trainer.roles import gloo_interface_problem

        problem = gloo_interface_problem()
        if problem:
            raise RuntimeError(f"learner group (gloo): {problem}")
    from components.trainer.weight_wire import run_store

    timeout = datetime.timedelta(seconds=timeout_s)
    # rank 0 hosts the store; every key under the run's token, so that a process of another run (or of an
    # earlier attempt of this Slurm job) that reaches the same port never takes a rank of this group
    store = dist.TCPStore(endpoints.host, int(endpoints.learner_port), world_size, rank == 0, timeout,
                          wait_for_workers=False)
    dist.init_process_group(backend, store=run_store(store, endpoints.token), rank=rank, world_size=world_size,
                            timeout=timeout)


def _build_learner(setup):
    import torch

    from components.models import empty_causal_lm, load_tokenizer
    from components.trainer.attention import learner_attn_implementation
    from components.trainer.learner import Learner

    cfg = setup.cfg
    tokenizer = load_tokenizer(cfg.model_path)
    # an empty skeleton: learner rank 0 reads the checkpoint and sends this rank its shards
    model = empty_causal_lm(cfg.model_path, dtype=torch.float32,
                            attn_implementation=learner_attn_implementation(cfg, setup.device))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Learner(model, cfg, pad_id, torch.device(setup.device)), tokenizer


def follower_main(index: int, setup, endpoints, layout) -> None:
    """Learner rank `index` >= 1: trains its share of each step as learner-0 directs."""
    import torch

    from components.trainer.accounting import proc_stats
    from components.trainer.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
    from components.trainer.resolve import enter_run
    from components.trainer.transport import Aborted, HubLost, Peer, TransportError
    from components.trainer.weight_sync import push_weights

    cfg = setup.cfg
    name = f"learner-{index}"

    def lost(error) -> None:  # heartbeat thread: the hub is gone, maybe while we are inside a collective
        print(f"[{name}] {error}; exiting", file=sys.stderr, flush=True)
        exit_process(exit_code_of(error), lambda: record_hub_lost(setup, error, first_peer=index == 1))

    if setup.device == "cpu":
        torch.set_num_threads(1)
        pin_cpu(index, layout.world_size)
    peer = Peer(name, endpoints.host, endpoints.hub_port, heartbeat_s=cfg.heartbeat_s, timeout_s=cfg.heartbeat_timeout_s,
                on_lost=lost, connect_timeout_s=max(cfg.heartbeat_timeout_s, cfg.queue_timeout_s, 300.0),
                run_token=endpoints.token)
    try:
        enter_run(setup.run)
        torch.manual_seed(cfg.seed)
        init_learner_group(index, layout.learner_ranks, endpoints, setup.device, timeout_s=max(cfg.queue_timeout_s, 300.0))
        learner, tokenizer = _build_learner(setup)
        settle_heap()  # start-up's objects out of the collector's full passes
        peer.send(M.Ready(index, pid=os.getpid(), proc=proc_stats()))
        while True:
            msg = peer.recv(timeout_s=1.0)
            if msg is None:
                continue
            if isinstance(msg, M.Stop):
                break
            if isinstance(msg, M.LoadCheckpoint):
                if msg.path is not None:
                    loaded = load_checkpoint(Path(msg.path), model=learner.model, optimizer=learner.optimizer)
                    learner.scheduler.load_state_dict(loaded["scheduler_state"])
                    learner.version = int(loaded["trainer_state"]["version"]) if loaded.get("trainer_state") else learner.version
                    if loaded.get("rank_state") is not None:
                        set_rng_state(loaded["rank_state"])
            elif isinstance(msg, M.TrainStep):
                part = learner.train_shard(msg.shard)
                peer.send(M.StepDone(index, part, proc_stats()))
            elif isinstance(msg, M.ScoreOld):  # pi_old before a step's first update, in the same forwards as rank 0
                part = {"old_logp": [learner.old_logprobs(shard) for shard in msg.shards]}
                peer.send(M.StepDone(index, part, proc_stats()))
            elif isinstance(msg, M.JoinWeightSync):  # join the parameter gathers; learner-0 broadcasts
                push_weights(learner.model, cfg.precision, msg.update, None)
            elif isinstance(msg, M.SaveCheckpoint):
                save_checkpoint(Path(setup.run_dir) / "checkpoints", int(msg.step), model=learner.model, optimizer=learner.optimizer,
                                scheduler_state=learner.scheduler.state_dict(), trainer_state=None, rank_state=rng_state(),
                                keep=cfg.keep_checkpoints, tokenizer=None)
            else:
                raise RuntimeError(f"{name}: unknown message {type(msg).__name__}")
    except (HubLost, Aborted, TransportError) as err:
        print(f"[{name}] {err}; exiting", file=sys.stderr, flush=True)
        peer.close()
        os._exit(exit_code_of(err))
    except BaseException:  # noqa: BLE001 - report to the hub, then die
        try:
            tb = traceback.format_exc()
            print(f"[{name}] failed:\n{tb}", file=sys.stderr, flush=True)
            peer.send(M.Failed(index, tb), timeout_s=10.0)
            time.sleep(1.0)  # let the message leave; no goodbye: the hub must see a failure, not a clean leave
        finally:
            os._exit(1)
    peer.close()


def hub_main(setup, endpoints, layout) -> str:
    """Learner rank 0: the training loop. Returns "done"; raises on failure."""
    from components.trainer.loop import Trainer
    from components.trainer.resolve import enter_run

    cfg = setup.cfg
    enter_run(setup.run)
    init_learner_group(0, layout.learner_ranks, endpoints, setup.device, timeout_s=max(cfg.queue_timeout_s, 300.0))
    return Trainer(cfg, Path(setup.run_dir), setup, layout, endpoints, run_info=setup.run_info, progress=setup.progress).run()


def run_role(rank: int, setup, endpoints, layout) -> str | None:
    """Run this process's role to its end (rank 0 returns the run's status; raises on failure)."""
    role = layout.role(rank)
    if role.is_hub:
        return hub_main(setup, endpoints, layout)
    # shutdown belongs to the hub (and to the launcher): Slurm and terminals signal every process
    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
        try:
            signal.signal(sig, signal.SIG_IGN)
        except ValueError:  # not the main thread
            pass
    if role.is_learner:
        follower_main(role.index, setup, endpoints, layout)
    else:
        from components.trainer.generator import generator_main

        generator_main(role.index, setup, endpoints, layout)
    return None


def main() -> int:
    """A process spawned by `scalerl train` on this machine (launcher.py): the env says who it is."""
    import dataclasses
    import logging

    from components.trainer.roles import process_env

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    penv = process_env()
    if penv is None:
        print("components.trainer.worker: SCALERL_RANK / SCALERL_WORLD_SIZE are not set; start runs with `scalerl train`",
              file=sys.stderr)
        return 2
    with open(os.environ["SCALERL_SETUP"], "rb") as f:
        setup, layout = pickle.load(f)
    from components.trainer.generator import resolve_device

    role = layout.role(penv.rank)
    setup = dataclasses.replace(setup, device=resolve_device(setup.cfg.device, role.kind, role.index),
                                progress=setup.progress and role.is_hub)
    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):  # the launcher owns shutdown
        signal.signal(sig, signal.SIG_IGN)
    if not role.is_hub:
        run_role(penv.rank, setup, penv.endpoints, layout)
        # its work is done and the hub has everything: leave now, not after interpreter shutdown
        # (a thread that never returns, e.g. a hung verifier's, would keep the process alive)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    try:
        run_role(penv.rank, setup, penv.endpoints, layout)
    except BaseException as err:  # noqa: BLE001 - the run directory says why
        record_exception(Path(setup.run_dir), err)
        print(f"[learner-0] run failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    return 0  # config.gin: the Trainer wrote the run's operative config (its own + the generators')


if __name__ == "__main__":
    sys.exit(main())
