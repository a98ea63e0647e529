r"""A study's runs in TensorBoard's HParams dashboard: `tensorboard --logdir WORKDIR`, HParams tab.

The study report (tfscale.study) writes, for every finished run (its summary.json exists):

    WORKDIR/hparams/<cell>/seed<k>/events.out.tfevents.study   one session: its hyperparameters and final metrics
    WORKDIR/hparams/events.out.tfevents.study                  the experiment: every hyperparameter with the
                                                                values seen, every metric

A run's hyperparameters are `cell` (its name), `seed` and every key the cell's overrides set
(`--config.data.global_batch_size=512` -> `data.global_batch_size`), with the value the run's
config.json records (the value it trained with: a Slurm job's own overrides win there too), or the
override's text typed as bool/int/float/str when there is no config.json. A key whose values mix
int and float is written as float, one mixing other types as str: the dashboard wants one type a column.
Its metrics are the final figures of summary.json (METRICS, those present) as scalars at the run's
last step.

Written without TensorFlow, from tensorboard's own protos (`summary_v2.hparams_pb`,
`hparams_config_pb`, `scalar_pb`) and record writer. Rewriting gives the same bytes (fixed file
names, times taken from summary.json), each file replaced atomically, so refreshing the report (once
more, or from several Slurm array tasks) never adds a row; a run that is no longer finished, or no
longer in the study, loses its session.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import socket

from tfscale import io as tfio
from tfscale.workdir import layout

DIR_NAME = "hparams"  # beside runs/: each run's own tensorboard/ stays as train.py wrote it
# TensorBoard reads every file whose name holds "tfevents"; one fixed name a directory keeps rewrites idempotent.
EVENTS_NAME = "events.out.tfevents.study"
METRICS = ("eval_top1", "eval_top5", "eval_loss", "wall_time_s", "images_per_sec")
_OVERRIDE = re.compile(r"^--config\.([A-Za-z_][\w.]*)=(.*)$", re.DOTALL)
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class RunSpec:
    cell: str
    seed: int
    overrides: tuple[str, ...]  # the cell's own, `--config.KEY=VALUE` each
    directory: str  # the run's workdir (summary.json, config.json)


def override_items(cell: str, overrides) -> list[tuple[str, str]]:
    """[(dotted key, value text)] of a cell's overrides; ValueError naming the cell and the override."""
    items = []
    for override in overrides:
        match = _OVERRIDE.match(override)
        if not match:
            raise ValueError(f"cell {cell}: override {override!r} is not --config.KEY=VALUE")
        items.append((match.group(1), match.group(2)))
    return items


def typed(text: str) -> bool | int | float | str:
    """An override's text as the value it spells: bool, int, float, else the text itself."""
    if text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _config_value(config: dict | None, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    # A tuple (decay_epochs) is a JSON list in config.json: the dashboard takes it as text.
    return node if isinstance(node, (bool, int, float, str)) else json.dumps(node)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _summary_path(spec: RunSpec) -> str:
    return layout.summary(spec.directory)


def run_hparams(spec: RunSpec, config: dict | None) -> dict:
    """{"cell", "seed", every key the cell's overrides set}: the values the run trained with."""
    values = {"cell": spec.cell, "seed": spec.seed}
    for key, text in override_items(spec.cell, spec.overrides):
        value = _config_value(config, key)
        values[key] = typed(text) if value is _MISSING else value
    return values


def one_type_per_key(sessions: list[dict]) -> list[dict]:
    """The sessions' values with each key of one type: int+float -> float, any other mix -> str."""
    kinds: dict[str, set] = {}
    for values in sessions:
        for key, value in values.items():
            kinds.setdefault(key, set()).add(type(value))
    convert = {key: float if kind == {int, float} else str for key, kind in kinds.items() if len(kind) > 1}
    return [{key: convert[key](value) if key in convert else value for key, value in values.items()}
            for values in sessions]


def _event_file(events) -> bytes:
    """An event file's bytes: the version record, then `events` (tensorboard's TFRecord framing)."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    buffer = io.BytesIO()
    writer = RecordWriter(buffer)
    writer.write(event_pb2.Event(wall_time=events[0].wall_time, file_version="brain.Event:2").SerializeToString())
    for event in events:
        writer.write(event.SerializeToString())
    return buffer.getvalue()


def _session_events(spec: RunSpec, hparams: dict, summary: dict, finished_s: float) -> list:
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.hparams import summary_v2 as hp
    from tensorboard.plugins.scalar import summary_v2 as scalar

    wall_time_s = summary.get("wall_time_s")
    started_s = finished_s - wall_time_s if _is_number(wall_time_s) else finished_s
    session = _sorted_content(hp.hparams_pb(hparams, trial_id=f"{spec.cell}/seed{spec.seed}",
                                            start_time_secs=started_s))
    events = [event_pb2.Event(wall_time=started_s, step=0, summary=session)]
    step = int(summary.get("steps", 0))
    for metric in METRICS:
        if _is_number(summary.get(metric)):
            events.append(event_pb2.Event(wall_time=finished_s, step=step,
                                          summary=scalar.scalar_pb(metric, summary[metric])))
    return events


def _sorted_content(summary):
    """`summary` with its plugin content serialised in key order: hparams_pb writes the hparams map in
    the process's hash order, and a rewrite must give the same bytes."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    for value in summary.value:
        content = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
        value.metadata.plugin_data.content = content.SerializeToString(deterministic=True)
    return summary


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _experiment_events(sessions: list[dict], metrics: list[str], created_s: float) -> list:
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.hparams import summary_v2 as hp

    seen: dict[str, set] = {}
    for values in sessions:
        for key, value in values.items():
            seen.setdefault(key, set()).add(value)
    hparams = [hp.HParam(key, hp.Discrete(seen[key])) for key in seen]  # Discrete sorts them
    config = hp.hparams_config_pb(hparams=hparams, metrics=[hp.Metric(metric) for metric in metrics],
                                  time_created_secs=created_s)
    return [event_pb2.Event(wall_time=created_s, step=0, summary=config)]


def _replace(directory: str, data: bytes) -> None:
    """`directory`/EVENTS_NAME replaced atomically, staged under a name without "tfevents" (TensorBoard
    would read a half-written one)."""
    os.makedirs(directory, exist_ok=True)
    # Host and pid: Slurm array tasks on several nodes may refresh the report into one shared directory.
    staged = os.path.join(directory, f".staged-events-{socket.gethostname()}-{os.getpid()}")
    tfio.write_bytes(staged, data)
    os.replace(staged, os.path.join(directory, EVENTS_NAME))


def _remove_stale(root: str, specs: list[RunSpec]) -> None:
    """Sessions of runs not finished (checked now: another report may have just written one) or not in
    the study, with their directory and its cell's when left empty. Only those: an empty directory
    elsewhere may be one another report is about to write into."""
    keep = {os.path.join(spec.cell, f"seed{spec.seed}") for spec in specs if os.path.exists(_summary_path(spec))}
    for directory, _, files in os.walk(root, topdown=False):
        relative = os.path.relpath(directory, root)
        if relative != "." and EVENTS_NAME in files and relative not in keep:
            tfio.remove_quietly(os.path.join(directory, EVENTS_NAME))
            for empty in (directory, os.path.dirname(directory)):
                try:
                    os.rmdir(empty)  # fails, as it should, when something else is in it
                except OSError:
                    break


def write(workdir: str, specs: list[RunSpec]) -> str:
    """The HParams summaries of the finished runs among `specs` (see the module docstring); returns their root."""
    root = os.path.join(workdir, DIR_NAME)
    finished = []
    for spec in specs:
        summary_path = _summary_path(spec)
        summary = _read_json(summary_path)
        if summary is not None:
            config = _read_json(layout.config(spec.directory))
            finished.append((spec, run_hparams(spec, config), summary, os.path.getmtime(summary_path)))
    sessions = one_type_per_key([hparams for _, hparams, _, _ in finished])
    for (spec, _, summary, finished_s), hparams in zip(finished, sessions):
        _replace(os.path.join(root, spec.cell, f"seed{spec.seed}"),
                 _event_file(_session_events(spec, hparams, summary, finished_s)))
    if finished:
        metrics = [metric for metric in METRICS
                   if any(_is_number(summary.get(metric)) for _, _, summary, _ in finished)]
        created_s = min(finished_s for _, _, _, finished_s in finished)
        _replace(root, _event_file(_experiment_events(sessions, metrics, created_s)))
    else:
        tfio.remove_quietly(os.path.join(root, EVENTS_NAME))
    if os.path.isdir(root):
        _remove_stale(root, specs)
    return root
