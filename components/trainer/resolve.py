"""A run resolved once: `ResolvedRun`, made in the launching process and handed to every process.

The launching process parses the run's gin files once (`gin_config.parse_gin_files`), builds and
validates its `TrainConfig` once (every chosen component's hyper-parameters, defaults included,
in `TrainConfig.components`), resolves model.path, and captures here what the run's processes
need from gin: the modules the gin files import (a user's components register on import) and
``precision.emulate``. The result is one frozen, picklable object: `--print-config` prints it,
run.json records it, every learner rank and generator gets it (`WorkerSetup.run`). A process of
the run calls `enter_run` and reads no gin: it builds its components from the object.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from components.trainer.config import TrainConfig
from components.trainer.roles import Layout

__all__ = ["ResolvedRun", "resolved_run", "enter_run", "layout_of"]


def layout_of(cfg: TrainConfig) -> Layout:
    """The run's process layout (learner ranks, generators, GPUs per generator) from its config."""
    from components.trainer.config import engine_gpus

    return Layout(learner_ranks=cfg.learner_ranks, num_generators=cfg.num_generators,
                  gpus_per_generator=engine_gpus(cfg))


@dataclass(frozen=True)
class ResolvedRun:
    """One run, resolved (picklable; the same object in every process).

    cfg: the TrainConfig, model.path resolved, every component's hyper-parameters in
        `cfg.components`. layout: learner ranks, generators, GPUs per generator.
    config_files, bindings: what it was resolved from (absolute files; --gin bindings).
    sys_path: directories put on sys.path (the config files' and the working directory).
    modules: the modules the gin files import (user components), imported by every process.
    emulate: ``precision.emulate`` ("auto", "on", "off").
    config_text: the run's configuration as gin bindings (config.gin): every setting the
        launching process read, and every component's hyper-parameters, defaults included.
    settings: ((key, text), ...): every setting as run.json records it and a re-run of the run
        directory is compared against (experiments/run_settings.py `resolved_settings`).
    module_files: ({"module", "file", "path"}, ...): where each user module was imported from, so
        that `scalerl eval RUN_DIR` imports them again from any working directory.
    """

    cfg: TrainConfig
    layout: Layout
    config_files: tuple = ()
    bindings: tuple = ()
    sys_path: tuple = ()
    modules: tuple = ()
    emulate: str = "auto"
    config_text: str = ""
    settings: tuple = ()
    module_files: tuple = ()

    def to_dict(self) -> dict:
        """The run as run.json records it ("resolved")."""
        return {
            "config_files": list(self.config_files),
            "bindings": list(self.bindings),
            "modules": list(self.modules),
            "precision_emulate": self.emulate,
            "layout": dataclasses.asdict(self.layout),
            "components": {f"{family}/{name}": _plain(dict(params)) for family, name, params in self.cfg.components},
        }


def _plain(value):
    """`value` as JSON holds it: numbers, strings, None, lists and dicts of them; anything else its repr."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def resolved_run(cfg: TrainConfig, config_files: Sequence[str], bindings: Sequence[str],
                 sys_path: Sequence[str], *, settings: Optional[dict] = None,
                 module_files: Sequence[dict] = ()) -> ResolvedRun:
    """The ResolvedRun of `cfg` (resolved and validated), captured from gin's parsed state: call it in the
    launching process, right after the config was parsed and checked. `settings` / `module_files`: what
    experiments/ reads of the parse for run.json (`ResolvedRun`)."""
    from components.precision import emulation_mode
    from components.trainer.gin_config import components_config_str, imported_modules, operative_config_str
    from components.trainer.runlog import merge_operative_configs

    text = merge_operative_configs(operative_config_str(), [components_config_str(cfg.components)])
    return ResolvedRun(cfg=cfg, layout=layout_of(cfg), config_files=tuple(config_files), bindings=tuple(bindings),
                       sys_path=tuple(sys_path), modules=tuple(imported_modules()), emulate=emulation_mode(),
                       config_text=text, settings=tuple(sorted((settings or {}).items())),
                       module_files=tuple(dict(m) for m in module_files))


def enter_run(run: ResolvedRun) -> None:
    """Make this process one of `run`'s: its sys.path, the built-in components, the user modules its gin
    files import, and its ``precision.emulate``. Gin is not parsed: components are built from `run`."""
    from components.precision import set_emulation_mode
    from components.quiet import quiet_gin
    from components.registry import load_builtin_components

    for path in reversed(run.sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    load_builtin_components()
    quiet_gin()
    for module in run.modules:
        importlib.import_module(module)
    set_emulation_mode(run.emulate)
