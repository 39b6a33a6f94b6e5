"""The launcher's public names, in one place; each concern lives in its own module.

    experiments.recipes      recipes read as text: config paths, a recipe's bindings, gin literals, SweepError
    experiments.sweep_spec   sweep specs: SweepSpec / RunSpec, parsing, expansion, run names, the tiny scale
    experiments.run_config   one run's configuration parsed once (RunConfig), validation of runs and bindings
    experiments.slurm        Slurm queries: partitions, node CPUs, job states, time limits
    experiments.run_state    run state and reconciliation: run.json / slurm.json / attempts.jsonl, plan
    experiments.submission   submitit executors, resources, RunJob, submit, wait
    experiments.sweep_cli    `scalerl sweep`: its arguments and main

`from experiments.launch import X` and `experiments.launch.RunJob` (in jobs submitted before)
keep working through the names below.
"""

from experiments.recipes import (ALGORITHM_PARAMS, ALGORITHM_REGISTRIES, BATCH_PARAMS, CONFIGS_DIR, EXPERIMENTS_DIR,
                                 PAPER_BATCH_REFERENCE, SWEEPS_DIR, SweepError, algorithm_bindings, gin_literal,
                                 recipe_binding, resolve_config, tiny_batch_bindings)
from experiments.run_config import (COMPONENT_PARAMS, DEFAULT_TARGET, RunConfig, check_binding, parse_binding,
                                    parse_run_configs, validate_runs)
from experiments.run_state import (ATTEMPTS_FILE, RECORDED_END, SLURM_FILE, Planned, attempt_outside_slurm,
                                   has_checkpoint, local_alive, lock_held, plan, read_json, read_run_info, reconcile,
                                   scheduler_state, utc_now, was_interrupted, write_json_atomic)
from experiments.slurm import (SLURM_ENDED, SLURM_GONE, SLURM_QUEUED, SLURM_RUNNING, array_task_ids, check_partition,
                               parse_sacct, parse_squeue, parse_time_min, partition_node_cpus, slurm_job_states,
                               slurm_partitions)
from experiments.submission import (LaunchOptions, RunFailed, RunJob, RunResources, check_device_request, job_parameters,
                                    job_result, local_parallelism, make_executor, run_resources, submit, wait)
from experiments.sweep_cli import (add_arguments, add_resource_arguments, add_slurm_arguments, main, options_from_args,
                                   prepare, print_plan)
from experiments.sweep_spec import (SPEC_KEYS, TINY_COMPUTE_BUDGET_FLOPS, TINY_MAX_STEPS, TINY_SCALE_BINDINGS, RunSpec,
                                    SweepSpec, expand, load_spec, parse_spec_text,
                                    resolve_spec_path, run_name, select_runs, slug, spec_from_dict)

__all__ = [
    "ALGORITHM_PARAMS", "ALGORITHM_REGISTRIES", "BATCH_PARAMS", "CONFIGS_DIR", "EXPERIMENTS_DIR",
    "PAPER_BATCH_REFERENCE", "SWEEPS_DIR", "SweepError", "algorithm_bindings", "gin_literal", "recipe_binding",
    "resolve_config", "tiny_batch_bindings",
    "COMPONENT_PARAMS", "DEFAULT_TARGET", "RunConfig", "check_binding", "parse_binding", "parse_run_configs",
    "validate_runs",
    "ATTEMPTS_FILE", "RECORDED_END", "SLURM_FILE", "Planned", "attempt_outside_slurm", "has_checkpoint", "local_alive",
    "lock_held", "plan", "read_json", "read_run_info", "reconcile", "scheduler_state", "utc_now", "was_interrupted",
    "write_json_atomic",
    "SLURM_ENDED", "SLURM_GONE", "SLURM_QUEUED", "SLURM_RUNNING", "array_task_ids", "check_partition", "parse_sacct",
    "parse_squeue", "parse_time_min", "partition_node_cpus", "slurm_job_states", "slurm_partitions",
    "LaunchOptions", "RunFailed", "RunJob", "RunResources", "check_device_request", "job_parameters", "job_result",
    "local_parallelism", "make_executor", "run_resources", "submit", "wait",
    "add_arguments", "add_resource_arguments", "add_slurm_arguments", "main", "options_from_args", "prepare",
    "print_plan",
    "SPEC_KEYS", "TINY_COMPUTE_BUDGET_FLOPS", "TINY_MAX_STEPS", "TINY_SCALE_BINDINGS", "RunSpec", "SweepSpec", "expand",
    "load_spec", "parse_spec_text", "resolve_spec_path", "run_name", "select_runs", "slug", "spec_from_dict",
]

