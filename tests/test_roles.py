"""components/trainer/roles.py: roles from ranks, the process environment (scalerl or Slurm),
port blocks outside the kernel's ephemeral range, GPU assignment."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from components.trainer import roles as R


def test_layout_roles_and_bad_layouts():
    lay = R.Layout(learner_ranks=2, num_generators=3)
    assert [r.name for r in lay.roles()] == ["learner-0", "learner-1", "generator-0", "generator-1", "generator-2"]
    assert lay.role(0).is_hub and not lay.role(1).is_hub and not lay.role(2).is_learner
    assert lay.peer_names() == ["learner-1", "generator-0", "generator-1", "generator-2"]
    assert lay.devices_reserved(on_gpu=False) == 5
    assert R.Layout(2, 2, gpus_per_generator=4).devices_reserved(on_gpu=True) == 10
    assert R.Layout(1, 1).devices_reserved(on_gpu=True, available=1) == 1  # sharing one GPU counts it once
    with pytest.raises(ValueError, match="rank 5 is outside this run's 5 processes"):
        lay.role(5)
    with pytest.raises(ValueError, match="learner_ranks=0"):
        R.Layout(0, 1)


def test_process_env_from_scalerl_and_from_slurm():
    env = R.process_env({"SCALERL_RANK": "2", "SCALERL_WORLD_SIZE": "3", "SCALERL_PORT_BASE": "21000"})
    assert (env.rank, env.world_size, env.source, env.endpoints.port_base) == (2, 3, "scalerl", 21000)
    assert env.endpoints.hub_port == 21002 and env.endpoints.weight_port == 21001
    slurm = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "3", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "nodeA",
             "SLURM_LOCALID": "1"}
    env = R.process_env(slurm)
    assert (env.rank, env.world_size, env.local_rank, env.source, env.endpoints.host) == (1, 3, 1, "slurm", "nodeA")
    assert env.endpoints.port_base == R.slurm_port_base("4242")  # every task of the job computes the same block
    assert R.process_env({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}) is None  # one task: a plain process
    # a batch script (sbatch -n 3) has SLURM_PROCID=0 and the job's SLURM_NTASKS, but no step: one process
    assert R.process_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_JOB_ID": "9", "SLURM_LOCALID": "0"}) is None
    assert R.process_env({}) is None


def test_the_hub_is_the_first_node_even_without_scontrol(monkeypatch):
    """A task in a container may have no `scontrol`: the node list is expanded all the same."""
    def no_scontrol(*a, **k):
        raise FileNotFoundError("scontrol")

    monkeypatch.setattr(R.subprocess, "run", no_scontrol)
    slurm = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "16", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu-b[07-08,11]"}
    assert R.process_env(slurm).endpoints.host == "gpu-b07"
    step = dict(slurm, SLURM_STEP_NODELIST="gpu-a[3,5-6],x")  # the step's nodes before the job's
    assert R.process_env(step).endpoints.host == "gpu-a3"
    assert R.process_env(dict(slurm, SCALERL_HUB_HOST="10.0.0.9")).endpoints.host == "10.0.0.9"
    # a template serves every job of a sweep: the first node's name on its fast network
    assert R.process_env(dict(step, SCALERL_HUB_HOST="{node}-ib")).endpoints.host == "gpu-a3-ib"


def test_port_blocks_lie_below_the_ephemeral_range(tmp_path, monkeypatch):
    """A block in the ephemeral range can be probed free and then taken by an outgoing connection
    before the hub binds it (seen: 'Address already in use' on a port probed free seconds before)."""
    lo, _ = R.ephemeral_port_range()
    for job in ("1", "41", "99999", "123456789", "4242_7"):
        base = R.slurm_port_base(job)
        assert R.PORT_FLOOR <= base and base + R.PORTS_PER_RUN <= lo, (job, base, lo)
    assert R.slurm_port_base("41") != R.slurm_port_base("42")
    for _ in range(20):
        base = R.free_port_base()
        assert R.PORT_FLOOR <= base and base + R.PORTS_PER_RUN <= lo and (base - R.PORT_FLOOR) % R.PORTS_PER_RUN == 0
    with socket.socket() as s:  # the block it returns is free: every port binds
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", base))
    # another kernel range is read from the file; an unreadable one falls back to Linux's default
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert R.ephemeral_port_range(str(f)) == (40000, 60999)
    assert R.ephemeral_port_range(str(tmp_path / "missing")) == (32768, 60999)
    monkeypatch.setattr(R, "ephemeral_port_range", lambda: (40000, 60999))
    assert all(R.slurm_port_base(str(j)) + R.PORTS_PER_RUN <= 40000 for j in range(0, 5000, 7))


def test_assign_gpus_exclusive_shared_and_errors():
    lay = R.Layout(learner_ranks=2, num_generators=2, gpus_per_generator=2)
    got = [R.assign_gpus(lay, r, [0, 1, 2, 3], gpus_on_node=8) for r in range(4)]
    assert got == [[0], [1], [2, 3], [4, 5]]
    one = R.Layout(1, 1)
    assert [R.assign_gpus(one, r, [0, 1], gpus_on_node=1) for r in range(2)] == [[0], [0]]  # shared
    with pytest.raises(RuntimeError, match="needs 2 GPUs .* has 1"):
        R.assign_gpus(lay, 2, [2], gpus_on_node=1)
    with pytest.raises(RuntimeError, match="no visible GPU"):
        R.assign_gpus(one, 0, [0, 1], gpus_on_node=0)
    with pytest.raises(ValueError, match="rank 3 is not among"):
        R.assign_gpus(lay, 3, [0, 1], gpus_on_node=8)


def test_gpus_shared_is_one_answer_for_the_whole_run(tmp_path, monkeypatch):
    lay = R.Layout(learner_ranks=2, num_generators=2, gpus_per_generator=2)  # needs 1 + 1 + 2 + 2 GPUs
    assert not R.gpus_shared(lay, ranks_per_node=4, gpus_on_node=6)
    assert R.gpus_shared(lay, ranks_per_node=4, gpus_on_node=5)
    assert not R.gpus_shared(lay, ranks_per_node=2, gpus_on_node=4)  # node 0: 1 + 1, node 1: 2 + 2
    assert R.gpus_shared(lay, ranks_per_node=2, gpus_on_node=3)  # node 1 needs 4
    assert R.gpus_shared(R.Layout(1, 1), ranks_per_node=2, gpus_on_node=1)  # a learner and a generator on one GPU
    # every process the local launcher starts gets the run's answer with its GPUs
    from components.trainer.launcher import child_env

    endpoints = R.Endpoints("127.0.0.1", 40000)
    for visible, shared in (("0", "1"), ("0,1", "0")):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        envs = [child_env(r, R.Layout(1, 1), endpoints, tmp_path / "setup.pkl", on_gpu=True) for r in range(2)]
        assert [e[R.GPUS_SHARED_ENV] for e in envs] == [shared, shared]


def test_slurm_tasks_take_their_gpus_per_node_or_as_slurm_bound_them_per_task():
    """Per node (scalerl's jobs): each task picks its own from all of the node's GPUs by rank, and they
    are shared when too few. Per task (--gpus-per-task): each task sees only its own, takes what its
    role needs, and nothing is shared (so the weight sync can use NCCL)."""
    lay = R.Layout(learner_ranks=2, num_generators=2, gpus_per_generator=2)  # 1 + 1 + 2 + 2 GPUs

    def penv(rank, local_rank, world=4):
        return R.ProcessEnv(rank=rank, world_size=world, local_rank=local_rank, endpoints=R.Endpoints("h", 40000),
                            source="slurm")

    node = {"SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "1"}
    eight = [str(i) for i in range(8)]
    assert [R.slurm_task_gpus(lay, penv(r, r), eight, node) for r in range(4)] == [
        (["0"], False), (["1"], False), (["2", "3"], False), (["4", "5"], False)]
    assert [R.slurm_task_gpus(lay, penv(r, r), ["0", "1", "2"], node)[1] for r in range(4)] == [True] * 4
    two_nodes = {"SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2"}
    assert R.slurm_task_gpus(lay, penv(3, 1), ["4", "5", "6", "7"], two_nodes) == (["6", "7"], False)

    per_task = {"SLURM_GPUS_PER_TASK": "2", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "1"}
    assert R.slurm_task_gpus(lay, penv(0, 0), ["5", "6"], per_task) == (["5"], False)
    assert R.slurm_task_gpus(lay, penv(3, 3), ["1", "3"], per_task) == (["1", "3"], False)
    one_each = {"SLURM_GPUS_PER_TASK": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1"}
    pair = R.Layout(1, 1)
    assert [R.slurm_task_gpus(pair, penv(r, r, world=2), ["0"], one_each) for r in range(2)] == [(["0"], False)] * 2
    with pytest.raises(RuntimeError, match=r"generator-1 needs 2 GPU\(s\) \(vllm.tensor_parallel_size\) but Slurm bound 1 "
                                           r"to its task \(1 per task.*--gpus-per-task=2"):
        R.slurm_task_gpus(lay, penv(3, 3), ["7"], dict(one_each, SLURM_NTASKS_PER_NODE="4"))
    # newer Slurm reports --gpus-per-task as a TRES; a typed count
    tres = {"SLURM_TRES_PER_TASK": "cpu=4,gres/gpu:a100=1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1"}
    assert [R.slurm_task_gpus(pair, penv(r, r, world=2), ["3"], tres) for r in range(2)] == [(["3"], False)] * 2
    assert R.slurm_task_gpus(pair, penv(1, 1, world=2), ["3"], {**one_each, "SLURM_GPUS_PER_TASK": "a100:1"}) == (["3"], False)
    # bound per task in name only (--gpu-bind=none): every task sees the node, so they pick by rank
    unbound = {"SLURM_GPUS_PER_TASK": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1"}
    assert [R.slurm_task_gpus(pair, penv(r, r, world=2), ["0", "1"], unbound) for r in range(2)] == [(["0"], False), (["1"], False)]


def test_slurm_tasks_per_node_and_uneven_nodes():
    """`--ntasks` (what --overcommit jobs ask for) leaves SLURM_NTASKS_PER_NODE unset and may put
    uneven task counts on the nodes: the counts come from SLURM_STEP_TASKS_PER_NODE, this node's
    ranks from SLURM_GTIDS."""
    assert R.slurm_tasks_per_node({}) is None
    assert R.slurm_tasks_per_node({"SLURM_STEP_TASKS_PER_NODE": "3"}) == [3]
    assert R.slurm_tasks_per_node({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}) == [2, 2, 2, 1]
    assert R.slurm_tasks_per_node({"SLURM_TASKS_PER_NODE": "5,3"}) == [5, 3]  # the job's, when the step's is absent
    assert R.slurm_tasks_per_node({"SLURM_STEP_TASKS_PER_NODE": "2(y3)"}) is None
    # 2 learners + 2 generators of 2 GPUs (6 GPUs) on two 4-GPU nodes, placed 3 + 1 by Slurm:
    # node 0 holds learner-0, learner-1, generator-0 (4 GPUs), node 1 generator-1 (2 of 4)
    lay = R.Layout(learner_ranks=2, num_generators=2, gpus_per_generator=2)
    four = ["0", "1", "2", "3"]

    def task(rank, local_rank, node, gtids):
        env = {"SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_NNODES": "2", "SLURM_NODEID": str(node), "SLURM_GTIDS": gtids}
        penv = R.ProcessEnv(rank=rank, world_size=4, local_rank=local_rank, endpoints=R.Endpoints("h", 40000), source="slurm")
        return R.slurm_task_gpus(lay, penv, four, env)

    assert [task(r, r, 0, "0,1,2") for r in range(3)] == [(["0"], False), (["1"], False), (["2", "3"], False)]
    assert task(3, 0, 1, "3") == (["0", "1"], False)
    # (read as an even 2 + 2 split, rank 2 was "not among its node's ranks"); whether GPUs are shared,
    # by the counts of each node:
    assert R.gpus_shared(lay, [3, 1], 4) is False and R.gpus_shared(lay, [3, 1], 3) is True
    assert R.gpus_shared(lay, 2, 4) is False and R.gpus_shared(lay, 2, 3) is True  # the int form still works
    with pytest.raises(RuntimeError, match=r"holds ranks \[0, 2\] \(SLURM_GTIDS\), not a block .*--distribution=block"):
        R.slurm_task_gpus(lay, R.ProcessEnv(rank=2, world_size=4, local_rank=1, endpoints=R.Endpoints("h", 40000), source="slurm"),
                          four, {"SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "0", "SLURM_GTIDS": "0,2"})


def test_gpus_bound_per_task_reads_both_ways_slurm_reports_them():
    assert R.gpus_bound_per_task({}) is None
    assert R.gpus_bound_per_task({"SLURM_GPUS_PER_TASK": "2"}) == 2
    assert R.gpus_bound_per_task({"SLURM_GPUS_PER_TASK": "h100:4"}) == 4
    assert R.gpus_bound_per_task({"SLURM_GPUS_PER_TASK": "", "SLURM_TRES_PER_TASK": "gres/gpu=1"}) == 1
    assert R.gpus_bound_per_task({"SLURM_TRES_PER_TASK": "cpu=8,gres/gpu:a100:2"}) == 2
    assert R.gpus_bound_per_task({"SLURM_TRES_PER_TASK": "cpu=8"}) is None
    assert R.gpus_bound_per_task({"SLURM_GPUS_PER_TASK": "lots"}) is None


def test_a_local_run_pins_each_process_to_its_own_cpu_when_there_are_enough():
    import os

    from components.trainer.roles import pin_cpu

    before = os.sched_getaffinity(0)
    cpus = sorted(before)
    try:
        assert pin_cpu(0, len(cpus) + 1, environ={}) is None  # more processes than CPUs: left alone
        assert os.sched_getaffinity(0) == before
        assert pin_cpu(0, 1, environ={"SLURM_JOB_ID": "7"}) is None  # Slurm's task binding decides
        assert pin_cpu(0, 1, environ={"SCALERL_PIN_CPUS": "0"}) is None
        slot = len(cpus) - 1
        assert pin_cpu(slot, len(cpus), environ={}) == cpus[slot]
        assert os.sched_getaffinity(0) == {cpus[slot]}
    finally:
        os.sched_setaffinity(0, before)


def test_every_task_of_a_slurm_step_defaults_to_the_same_run_directory():
    """`srun -n 3 scalerl train CFG` without --run-dir: a timestamp differs between tasks started in
    different seconds (ranks would wait for a directory nobody writes); the job id does not."""
    from experiments.train import default_run_dir

    tasks = [{"SLURM_PROCID": str(r), "SLURM_STEP_NUM_TASKS": "3", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1",
              "SLURM_JOB_NODELIST": "n1", "SCALERL_HUB_HOST": "n1"} for r in range(3)]
    dirs = {default_run_dir(["experiments/configs/tiny_cpu.gin"], env) for env in tasks}
    assert dirs == {Path("runs") / "tiny_cpu" / "slurm-4242.1"}  # another step of the job: another run
    plain = default_run_dir(["experiments/configs/tiny_cpu.gin"], {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"})
    assert plain.parent == Path("runs") / "tiny_cpu" and plain.name[:2] == "20"  # one task: a timestamp
    batch = default_run_dir(["experiments/configs/tiny_cpu.gin"], {"SLURM_PROCID": "0", "SLURM_NTASKS": "3"})
    assert batch.name[:2] == "20"  # a batch script is one process


def test_gloo_across_nodes_on_a_loopback_named_node_is_refused_with_the_fix(monkeypatch):
    """Gloo advertises the address the node's own name resolves to: 127.0.1.1 (Debian's /etc/hosts)
    would leave the other nodes' ranks waiting minutes for a connection; the error says what to set."""
    import components.trainer.weight_sync as W
    from components.trainer.weight_sync_backends import _join_gloo
    from components.trainer.worker import init_learner_group

    resolved = {"addr": "127.0.1.1"}
    monkeypatch.setattr(socket, "gethostname", lambda: "node1")
    monkeypatch.setattr(socket, "gethostbyname", lambda host: resolved["addr"])
    two_nodes = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2"}
    msg = R.gloo_interface_problem(two_nodes)
    assert "'node1' resolves to the loopback address 127.0.1.1" in msg and "set GLOO_SOCKET_IFNAME" in msg
    assert R.gloo_interface_problem(dict(two_nodes, GLOO_SOCKET_IFNAME="ib0")) is None
    assert R.gloo_interface_problem(dict(two_nodes, SLURM_STEP_NUM_NODES="1")) is None  # one node: loopback works
    assert R.gloo_interface_problem(dict(two_nodes, SCALERL_RANK="1")) is None  # spawned on one machine
    assert R.gloo_interface_problem({"SLURM_NNODES": "2"}) is None  # a batch script, no step: one node
    resolved["addr"] = "10.0.0.7"
    assert R.gloo_interface_problem(two_nodes) is None
    # both gloo groups refuse before any rendezvous (which would wait minutes)
    resolved["addr"] = "127.0.1.1"
    for k, v in two_nodes.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("SCALERL_RANK", raising=False)
    with pytest.raises(RuntimeError, match=r"learner group \(gloo\): this node's name 'node1'"):
        init_learner_group(1, 2, R.Endpoints("node0", 29400), "cpu", timeout_s=1.0)
    group = W.WeightGroup(master_addr="node0", master_port=29401, num_generators=1)
    with pytest.raises(W.WeightSyncError, match=r"weight group rank 1 \(gloo\): this node's name 'node1'"):
        _join_gloo(group, 1)


def test_settle_heap_takes_start_up_objects_out_of_full_collections_and_still_frees_new_cycles():
    """In a fresh interpreter (freezing pytest's own heap would leak its later garbage): the
    survivors of start-up leave the collector's generations, garbage is collected first, and a
    cycle made afterwards is still freed by a full collection."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import gc, weakref
        from components.trainer.roles import settle_heap

        class Node:
            pass

        keep = [[i] for i in range(200_000)]  # start-up's live objects
        junk = Node(); junk.me = junk; dead = weakref.ref(junk); del junk  # start-up's garbage: a cycle
        before = len(gc.get_objects())
        frozen = settle_heap()
        assert dead() is None, "start-up's garbage was frozen instead of freed"
        assert frozen >= 200_000, frozen
        after = len(gc.get_objects())
        assert after < before // 20, (before, after)  # a full pass no longer walks them
        new = Node(); new.me = new; gone = weakref.ref(new); del new
        gc.collect()
        assert gone() is None, "a cycle made after settle_heap was not collected"
        assert len(keep) == 200_000
        print("ok", before, after, frozen)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=str(Path(__file__).resolve().parents[1]),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout + out.stderr
