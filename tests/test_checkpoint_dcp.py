"""Sharded DCP checkpoints with real ranks: save at T learner ranks, resume at T' (2 -> 1, 1 -> 2, 1 -> 1).

One spawn of 2 gloo ranks (FSDP2 `fully_shard` per decoder layer + root, fused AdamW as the
learner builds it, a few real steps) does all the T = 2 work; the T = 1 side runs in this
process without any process group. References are the full (gathered) state of the run that
saved the checkpoint; "one more identical step" is the same batch at T = 1 (all rows) and at
T = 2 (half the rows per rank, loss scaled by T because FSDP2 averages gradients), so the
weights after it agree to fp32 round-off. A control shows the comparison can fail: a learner
that loads the weights but not the AdamW state lands far outside the tolerance.
"""

from __future__ import annotations

import random
import re
import socket
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from components.models import build_tiny_policy, load_causal_lm, load_tokenizer
from components.trainer.checkpoint import (
    CheckpointError,
    checkpoint_steps,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from components.trainer.learner import make_optimizer

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=64, tie_word_embeddings=True, seed=0)
B, L = 4, 10  # step batch: 4 sequences of 10 tokens
ROUNDOFF = 1e-6  # |w_T1 - w_T2| after one more step (measured ~1.2e-8; without the AdamW state ~1e-2)
SPAWN_TIMEOUT_S = 240


# ---------------------------------------------------------------------------------------------
# one learner, identical at any T
def _batch(k: int) -> torch.Tensor:
    return torch.randint(8, 100, (B, L), generator=torch.Generator().manual_seed(1000 + k))  # [B, L]


def _new_learner(model_path: str, world: int):
    model = load_causal_lm(model_path)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt, sched = make_optimizer(model, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, warmup_steps=3)
    return model, opt, sched


def _train_step(model, opt, sched, k: int, rank: int = 0, world: int = 1) -> None:
    """Next-token CE summed over the WHOLE step batch / its token count; rank r trains rows r::world."""
    ids = _batch(k)[rank::world]  # [B/world, L]
    logits = model(input_ids=ids, use_cache=False).logits  # [b, L, V]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="sum")  # []
    loss = ce / (B * (L - 1)) * world  # x world: FSDP2 averages gradients over the ranks
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _full_state(model, opt) -> dict:
    """{"model": {fqn: tensor}, "optim": {fqn: {step, exp_avg, exp_avg_sq}}, "groups": param_groups}: gathered, CPU, cloned."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    on = dist.is_initialized()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=on, cpu_offload=on))
    clone = lambda t: t.detach().to("cpu").clone() if torch.is_tensor(t) else t  # noqa: E731
    return {
        "model": {k: clone(v) for k, v in msd.items()},
        "optim": {fqn: {n: clone(v) for n, v in st.items()} for fqn, st in osd.get("state", {}).items()},
        "groups": [{k: v for k, v in g.items()} for g in osd.get("param_groups", [])],
    }


def _assert_state_equal(got: dict, want: dict, what: str) -> None:
    assert got["model"].keys() == want["model"].keys(), what
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), f"{what}: model {k}"
    assert got["optim"].keys() == want["optim"].keys(), what
    for fqn, st in want["optim"].items():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}, st.keys()
        for n, v in st.items():
            assert torch.equal(got["optim"][fqn][n].float(), v.float()), f"{what}: optimizer {fqn}.{n}"
    assert got["groups"] == want["groups"], what


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _nontrivial(state: dict) -> None:
    """A few real steps: AdamW's moments are non-zero and step counts the updates."""
    st = state["optim"]["model.layers.0.self_attn.q_proj.weight"]
    assert st["step"].item() == 2.0 and st["exp_avg"].abs().max() > 0 and st["exp_avg_sq"].abs().max() > 0


# ---------------------------------------------------------------------------------------------
# the 2-rank job
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, model_path: str, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                           timeout=timedelta(seconds=120))
    try:
        root_p = Path(root)
        tok = load_tokenizer(model_path) if rank == 0 else None
        # A. train 2 steps at T = 2, save, then continue one step from the saved checkpoint at T = 2
        model, opt, sched = _new_learner(model_path, world)
        for k in (0, 1):
            _train_step(model, opt, sched, k, rank, world)
        torch.manual_seed(50 + rank)  # distinct RNG per rank
        ck2 = save_checkpoint(root_p / "run_t2" / "checkpoints", 2, model=model, optimizer=opt,
                              scheduler_state=sched.state_dict(),
                              trainer_state={"saved_by": world, "pending": ["rollout"]} if rank == 0 else None,
                              rank_state={"rank": rank, "rng": rng_state()}, keep=2, tokenizer=tok)
        state_a = _full_state(model, opt)
        model, opt, sched = _new_learner(model_path, world)
        loaded_a = load_checkpoint(ck2, model=model, optimizer=opt)
        sched.load_state_dict(loaded_a["scheduler_state"])
        reloaded_a = _full_state(model, opt)
        _train_step(model, opt, sched, 2, rank, world)
        after_a = _full_state(model, opt)["model"]
        # B. load the T = 1 checkpoint into T = 2, continue one step
        model, opt, sched = _new_learner(model_path, world)
        loaded_b = load_checkpoint(root_p / "run_t1" / "checkpoints" / "step_00000002", model=model, optimizer=opt)
        sched.load_state_dict(loaded_b["scheduler_state"])
        state_b = _full_state(model, opt)
        _train_step(model, opt, sched, 2, rank, world)
        after_b = _full_state(model, opt)["model"]
        torch.save({"rank_state_a": loaded_a["rank_state"], "rank_state_b": loaded_b["rank_state"],
                    "trainer_state_b": loaded_b["trainer_state"], "lr_b": opt.param_groups[0]["lr"]},
                   root_p / f"rank{rank}.pt")
        # C. a rank that never joins the save: rank 0 fails within the timeout, naming it
        hung_error, done = None, root_p / "hung_done"
        if rank == 0:
            try:
                save_checkpoint(root_p / "run_hung" / "checkpoints", 1, model=model, optimizer=opt, keep=1, timeout_s=1)
            except CheckpointError as err:
                hung_error = str(err)
            done.touch()
        else:  # alive but not saving, until rank 0 has given up (bounded)
            deadline = time.monotonic() + 60
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        if rank == 0:
            torch.save({"hung_error": hung_error, "state_a": state_a, "reloaded_a": reloaded_a, "after_a": after_a,
                        "state_b": state_b, "after_b": after_b}, root_p / "t2.pt")
    finally:
        dist.destroy_process_group()


def _spawn(fn, args, nprocs: int, timeout_s: float) -> None:
    """Run fn(rank, *args) in `nprocs` processes; a dead, failing or hung rank is a clear error."""
    ctx = torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):  # raises ProcessRaisedException/ProcessExitedException naming the rank
        if time.monotonic() > deadline:
            alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"learner ranks {alive} still running after {timeout_s} s (hung collective?)")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(build_tiny_policy(tmp_path_factory.mktemp("tiny") / "tiny", **TINY))


@pytest.fixture(scope="module")
def dcp_runs(tmp_path_factory, tiny_path):
    root = tmp_path_factory.mktemp("dcp")
    model_path = tiny_path
    tok = load_tokenizer(model_path)
    # T = 1 in this process, no process group: 2 steps, save, record, one more step
    model, opt, sched = _new_learner(model_path, 1)
    for k in (0, 1):
        _train_step(model, opt, sched, k)
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    rng = rng_state()
    draws = (torch.rand(4), np.random.rand(3), random.random())  # what the saved RNG state produces next
    ck1 = save_checkpoint(root / "run_t1" / "checkpoints", 2, model=model, optimizer=opt, scheduler_state=sched.state_dict(),
                          trainer_state={"saved_by": 1}, rank_state={"rank": 0, "rng": rng}, keep=2, tokenizer=tok)
    state_1 = _full_state(model, opt)
    _train_step(model, opt, sched, 2)
    after_1 = _full_state(model, opt)["model"]

    _spawn(_rank_main, (2, _free_port(), model_path, str(root)), nprocs=2, timeout_s=SPAWN_TIMEOUT_S)
    t2 = torch.load(root / "t2.pt", weights_only=False)
    ranks = [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {"root": root, "model_path": model_path, "ck1": ck1, "ck2": root / "run_t2" / "checkpoints" / "step_00000002",
            "state_1": state_1, "after_1": after_1, "draws": draws, "t2": t2, "ranks": ranks}


# ---------------------------------------------------------------------------------------------
@pytest.mark.slow  # shares the 2-rank spawn (~25 s CPU, more wall time on a busy machine)
def test_layout_of_a_two_rank_checkpoint(dcp_runs):
    ck2 = dcp_runs["ck2"]
    names = {p.relative_to(ck2).as_posix() for p in ck2.rglob("*") if p.is_file()}
    assert {"checkpoint.json", "trainer.pt", "dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp",
            "ranks/rank_00000.pt", "ranks/rank_00001.pt", "hf/config.json", "hf/tokenizer.json"} <= names, names
    assert latest_checkpoint(ck2.parent) == ck2 and list(checkpoint_steps(ck2.parent)) == [2]
    assert not [p for p in ck2.parent.iterdir() if p.name.startswith(".")]  # no tmp left
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(ck2 / "dcp").read_metadata().state_dict_metadata
    # HF names; the embedding is sharded in 2 row chunks; AdamW state per FQN
    assert len(md["model.model.embed_tokens.weight"].chunks) == 2
    assert "optim.state.model.embed_tokens.weight.exp_avg_sq" in md and "optim.state.model.norm.weight.step" in md


@pytest.mark.slow  # shares the 2-rank spawn (~25 s CPU, more wall time on a busy machine)
def test_save_two_ranks_load_one(dcp_runs):
    t2 = dcp_runs["t2"]
    _nontrivial(t2["state_a"])
    _assert_state_equal(t2["reloaded_a"], t2["state_a"], "T=2 -> T=2")
    model, opt, sched = _new_learner(dcp_runs["model_path"], 1)
    loaded = load_checkpoint(dcp_runs["ck2"], model=model, optimizer=opt)
    sched.load_state_dict(loaded["scheduler_state"])
    assert loaded["step"] == 2 and loaded["world_size"] == 2
    assert loaded["trainer_state"] == {"saved_by": 2, "pending": ["rollout"]}
    assert loaded["rank_state"]["rank"] == 0  # rank 0's own file
    _assert_state_equal(_full_state(model, opt), t2["state_a"], "T=2 -> T=1")
    _train_step(model, opt, sched, 2)
    diff = _max_diff(_full_state(model, opt)["model"], t2["after_a"])
    assert diff <= ROUNDOFF, diff
    # control: the weights without the AdamW state (and step count) do not give the same step
    model_c, opt_c, sched_c = _new_learner(dcp_runs["model_path"], 1)
    sched_c.load_state_dict(load_checkpoint(dcp_runs["ck2"], model=model_c, optimizer=None)["scheduler_state"])
    _train_step(model_c, opt_c, sched_c, 2)
    control = _max_diff(_full_state(model_c, opt_c)["model"], t2["after_a"])
    print(f"T=2 -> T=1: one more step differs by {diff:.3g}; without the AdamW state by {control:.3g}")
    assert control > 100 * ROUNDOFF, control


@pytest.mark.slow  # shares the 2-rank spawn (~25 s CPU, more wall time on a busy machine)
def test_save_one_rank_load_two(dcp_runs):
    t2, ranks = dcp_runs["t2"], dcp_runs["ranks"]
    _nontrivial(dcp_runs["state_1"])
    _assert_state_equal(t2["state_b"], dcp_runs["state_1"], "T=1 -> T=2")
    diff = _max_diff(t2["after_b"], dcp_runs["after_1"])
    print(f"T=1 -> T=2: one more step differs by {diff:.3g}")
    assert diff <= ROUNDOFF, diff
    assert ranks[0]["trainer_state_b"] == {"saved_by": 1}
    assert ranks[0]["rank_state_b"]["rank"] == 0 and ranks[1]["rank_state_b"] is None  # saved by 1 rank
    assert ranks[0]["lr_b"] == ranks[1]["lr_b"] == dcp_runs["state_1"]["groups"][0]["lr"]
    # each rank got its own RNG state back from the 2-rank checkpoint
    assert [r["rank_state_a"]["rank"] for r in ranks] == [0, 1]
    assert not torch.equal(ranks[0]["rank_state_a"]["rng"]["torch"], ranks[1]["rank_state_a"]["rng"]["torch"])


@pytest.mark.slow  # shares the 2-rank spawn (~25 s CPU, more wall time on a busy machine)
def test_one_rank_round_trip_is_bitwise(dcp_runs):
    model, opt, sched = _new_learner(dcp_runs["model_path"], 1)
    loaded = load_checkpoint(dcp_runs["ck1"], model=model, optimizer=opt)
    sched.load_state_dict(loaded["scheduler_state"])
    _assert_state_equal(_full_state(model, opt), dcp_runs["state_1"], "T=1 -> T=1")
    _train_step(model, opt, sched, 2)
    got = _full_state(model, opt)["model"]
    for k, v in dcp_runs["after_1"].items():
        assert torch.equal(got[k], v), k  # bit for bit
    set_rng_state(loaded["rank_state"]["rng"])
    t, n, p = dcp_runs["draws"]
    assert torch.equal(torch.rand(4), t) and np.array_equal(np.random.rand(3), n) and random.random() == p


@pytest.mark.slow  # shares the 2-rank spawn (~25 s CPU, more wall time on a busy machine)
def test_export_of_a_two_rank_checkpoint_in_one_process(dcp_runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from components.trainer.export import export_policy

    out = export_policy(dcp_runs["root"] / "run_t2", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # tied model stays tied
    for k, v in dcp_runs["t2"]["state_a"]["model"].items():
        assert torch.equal(hf.state_dict()[k], v), k




def _save(ckpt_dir: Path, step: int, model, opt, sched, keep: int) -> Path:
    return save_checkpoint(ckpt_dir, step, model=model, optimizer=opt, scheduler_state=sched.state_dict(),
                           trainer_state={"step": step}, rank_state={"rng": rng_state()}, keep=keep)


def test_killed_save_is_ignored_and_cleaned_and_keep_prunes(tiny_path, tmp_path, monkeypatch):
    import components.trainer.checkpoint as ckpt

    model, opt, sched = _new_learner(tiny_path, 1)
    ckpt_dir = tmp_path / "run" / "checkpoints"
    _train_step(model, opt, sched, 0)
    for step in (1, 2):
        _save(ckpt_dir, step, model, opt, sched, keep=3)

    def killed(tmp, final):  # the process dies after writing everything, before the rename
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ckpt, "_publish", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(ckpt_dir, 3, model, opt, sched, keep=3)
    monkeypatch.undo()
    tmp = ckpt_dir / ".step_00000003.tmp"
    assert (tmp / "checkpoint.json").is_file() and (tmp / "dcp" / ".metadata").is_file()  # complete but unpublished
    (ckpt_dir / "step_00000009").mkdir()  # a step directory without checkpoint.json (never published)
    (ckpt_dir / "step_00000009" / "junk").write_text("x")
    assert latest_checkpoint(ckpt_dir).name == "step_00000002"
    assert list(checkpoint_steps(ckpt_dir)) == [1, 2]
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(ckpt_dir / "step_00000009", model=model, optimizer=opt)
    assert tmp.is_dir()  # reading never deletes (a live run may be saving)

    for step in (3, 4, 5):
        _save(ckpt_dir, step, model, opt, sched, keep=2)
        assert not tmp.exists()  # the next save removed the killed one's leftovers
    assert list(checkpoint_steps(ckpt_dir)) == [4, 5]
    assert latest_checkpoint(ckpt_dir).name == "step_00000005"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_00000004", "step_00000005", "step_00000009"]
    # re-saving an existing step replaces it
    _train_step(model, opt, sched, 1)
    _save(ckpt_dir, 5, model, opt, sched, keep=2)
    model2, opt2, _ = _new_learner(tiny_path, 1)
    load_checkpoint(ckpt_dir / "step_00000005", model=model2, optimizer=opt2)
    for k, v in model.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v), k


def test_bad_calls_raise_clear_errors(tiny_path, tmp_path):
    model, opt, sched = _new_learner(tiny_path, 1)
    with pytest.raises(TypeError, match="needs model="):
        save_checkpoint(tmp_path / "c", 1, keep=1)
    with pytest.raises(ValueError, match="step must be >= 0"):
        save_checkpoint(tmp_path / "c", -1, model=model, optimizer=opt)
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        load_checkpoint(tmp_path / "missing", model=model, optimizer=opt)
    weights_only = save_checkpoint(tmp_path / "c", 1, model=model, optimizer=None, keep=1)
    with pytest.raises(CheckpointError, match="saved without an optimizer"):
        load_checkpoint(weights_only, model=model, optimizer=opt)
    from transformers import AutoConfig, AutoModelForCausalLM

    wide = AutoConfig.from_pretrained(tiny_path, hidden_size=64)
    other = AutoModelForCausalLM.from_config(wide)
    with pytest.raises(CheckpointError, match=r"cannot load .*rank 0: ValueError: Size mismatch"):
        load_checkpoint(weights_only, model=other, optimizer=None)


@pytest.mark.slow  # shares the 2-rank spawn (~25 s CPU, more wall time on a busy machine)
def test_a_rank_missing_from_the_save_is_named_not_a_hang(dcp_runs):
    err = dcp_runs["t2"]["hung_error"]
    assert err is not None and re.search(r"barrier .* Ranks? 1 failed to pass", err), err
    assert latest_checkpoint(dcp_runs["root"] / "run_hung" / "checkpoints") is None


def test_saving_before_the_first_step_leaves_the_optimizer_untouched(tiny_path, tmp_path):
    """DCP's get_state_dict initialises an empty optimizer by stepping it; a save must not do that."""
    model, opt, sched = _new_learner(tiny_path, 1)
    ck = save_checkpoint(tmp_path / "c", 0, model=model, optimizer=opt, scheduler_state=sched.state_dict(), keep=1)
    assert not opt.state  # still no AdamW state (no step = 1 sneaked in)
    _train_step(model, opt, sched, 0)
    want = _full_state(model, opt)
    model2, opt2, sched2 = _new_learner(tiny_path, 1)
    _train_step(model2, opt2, sched2, 5)  # a used optimizer: the load must reset it to the saved (empty) one
    loaded = load_checkpoint(ck, model=model2, optimizer=opt2)
    sched2.load_state_dict(loaded["scheduler_state"])
    assert not opt2.state
    _train_step(model2, opt2, sched2, 0)
    _assert_state_equal(_full_state(model2, opt2), want, "saved at step 0")
    assert want["optim"]["model.norm.weight"]["step"].item() == 1.0
