"""Typed run configuration: YAML files in ``configs/``, dotted command-line overrides, clear errors.

A :class:`RunConfig` has the sections ``model``, ``trainer`` (a discriminated union on ``kind``:
``jax`` | ``megatron``), ``fleet`` (:class:`hetrl.samplers.fleet.FleetConfig`), ``correction``
(a preset of :data:`hetrl.core.correction.PRESETS` plus threshold overrides), ``async``
(group and batch sizes, sampling, ``max_staleness``, weight-update mode), ``environment``,
``logging``, ``checkpointing`` and ``ray`` (settings of ``backend: ray``; ``backend`` picks the
orchestrator backend, ``local`` or ``ray``). Every model forbids unknown keys, so a typo fails
naming it.

Ownership: each setting lives in exactly one section. The correction is configured only in
``correction`` and checkpoints only in ``checkpointing``; the ``trainer`` section is the
trainer's own config as it stands (:class:`hetrl.trainer_jax.config.JaxTrainerConfig` or
:class:`hetrl.trainer_megatron.config.MegatronTrainerConfig`, both
:class:`hetrl.core.training.TrainerSettings` in one vocabulary plus their own keys). Switching
trainers (``--trainer megatron`` or the override ``trainer.kind=megatron``) changes only the
kind: the shared settings keep their meaning, and a setting the other trainer cannot honour is
refused naming it (``trainer.distributed: a setting of the 'jax' trainer only ...``).

:func:`load_config` reads a YAML file, applies overrides ``a.b[0].c=value`` (the value parsed as
YAML, so ``2``, ``0.5``, ``true``, ``null``, ``[0.5, 2.0]`` are typed) and validates. Any
problem raises :class:`ConfigError` whose message names the dotted key, e.g.
``fleet.pools[3].weight_precision: accelerator 'a100' does not run weight format 'fp8_e4m3'
natively``; an unknown key gets the nearest known one (``logging.evrey: unknown key 'evrey' (did
you mean 'every'?)``), and an error an override caused names the override instead of the file
(``--set trainer.optimzer.learning_rate=1e-4: unknown key 'optimzer' (did you mean
'optimizer'?)``). ``environment.options`` are typed by the environment's ``name``
(:mod:`hetrl.envs.options`), so they are checked here too. :meth:`RunConfig.to_yaml` prints the resolved config (defaults filled,
correction thresholds resolved); loading that output gives the same config.

**Paths.** Every output of a run lives under ``output_dir`` (the run folder, laid out by
:class:`hetrl.orchestrator.run_folder.RunFolder`); no other section names an output path.
A relative path written in a config file (``output_dir``, ``model.path``, ``model.cache_dir``,
``ray.temp_dir``) is relative to the directory of that file, never to the working directory, so
a config means the same run wherever it is started from (the shipped configs in ``configs/``
write ``../runs/...`` and ``../assets/models``, the repository's own folders); a relative path
given as a command-line override (``--set output_dir=X``) is relative to the working directory,
as any path typed in a shell. Absolute paths and URLs (``gs://...``) are kept as they are.
"""

from __future__ import annotations

import difflib
import pathlib
import re
import types
from typing import Annotated, Any, Literal, Mapping, Sequence, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, create_model, model_validator

from hetrl.errors import UserError
from hetrl.core.checkpoints import CheckpointConfig
from hetrl.core.correction import CorrectionConfig, correction_preset
from hetrl.core.schema import SamplingParams
from hetrl.core.training import MESH_SHORTHANDS
from hetrl.envs.options import CodingEnvOptions, SyntheticEnvOptions
from hetrl.samplers.fleet import FleetConfig
from hetrl.trainer_jax.config import JaxTrainerConfig
from hetrl.trainer_megatron.config import MegatronTrainerConfig
from hetrl.warmstart.config import WarmstartConfig

__all__ = [
    "ConfigError", "ModelSection", "TrainerSection", "CorrectionSection", "AsyncSection", "EnvironmentSection", "SyntheticEnvironmentSection",
    "CodingEnvironmentSection", "LoggingSection",
    "CheckpointingSection", "RaySection", "RunConfig", "CONFIG_DIR", "load_config", "validate_config", "apply_override",
    "load_yaml", "format_path",
    "resolve_config_path", "resolve_file_paths", "PATH_KEYS",
]

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
"""The repository's ``configs/`` directory (bare config names are looked up there)."""


class ConfigError(UserError, ValueError):
    """A configuration problem; the message names the file (or the ``--set`` override) and the dotted key."""


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ====================================================================== sections
class ModelSection(_Strict):
    """The policy checkpoint; exactly one of:

    * ``tiny``: a tiny Qwen with random weights built on the fly (:mod:`hetrl.models.tiny`, ``seed``);
    * ``warmstart``: the tiny Qwen3 warm-started by ``hetrl warmstart`` with these settings
      (:class:`~hetrl.warmstart.config.WarmstartConfig`), trained once if not there yet;
    * ``path``: an HF checkpoint directory.

    Built models are cached under ``cache_dir`` (None: ``model/`` in the run folder), named by
    their settings, so runs with the same settings share one. Building them is not this
    section's job: :func:`hetrl.models.resolve.resolve_model` does it when a run starts."""

    tiny: Literal["qwen3", "qwen2"] | None = None
    seed: int = Field(0, ge=0)
    warmstart: WarmstartConfig | None = None
    path: str | None = None
    cache_dir: str | None = None

    @model_validator(mode="after")
    def _one(self) -> "ModelSection":
        if sum(x is not None for x in (self.tiny, self.warmstart, self.path)) != 1:
            raise ValueError("set exactly one of 'tiny' (a tiny model built on the fly), 'warmstart' (a tiny model "
                             "warm-started by `hetrl warmstart`) or 'path' (an HF checkpoint)")
        return self


TrainerSection = Annotated[Union[JaxTrainerConfig, MegatronTrainerConfig], Field(discriminator="kind")]
"""The trainer: ``kind`` (``jax`` | ``megatron``) and that trainer's config."""

_CorrectionFields = create_model(
    "_CorrectionFields", __base__=_Strict,
    **{name: (info.annotation | None, Field(None, description=info.description))
       for name, info in CorrectionConfig.model_fields.items()},
)


class CorrectionSection(_CorrectionFields):  # type: ignore[misc, valid-type]
    """``preset`` (a name in :data:`PRESETS`) plus any :class:`CorrectionConfig` field given
    explicitly as an override (an omitted field keeps the preset's value; ``null`` sets None)."""

    preset: str = "hetrl"

    @property
    def overrides(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.model_fields_set - {"preset"}}

    def resolve(self) -> CorrectionConfig:
        return correction_preset(self.preset, **self.overrides)

    @model_validator(mode="after")
    def _resolves(self) -> "CorrectionSection":
        try:
            self.resolve()
        except ValidationError as err:  # re-raised as a plain error so the location stays `correction`
            raise ValueError("; ".join(f"{format_path(e['loc'])}: {_error_message(e)}" if e["loc"] else _error_message(e)
                                       for e in err.errors())) from None
        return self


class AsyncSection(_Strict):
    """The asynchronous loop. A step trains ``batch_groups`` groups of ``group_size`` rollouts
    (one prompt each). No trained group is older than ``max_staleness`` weight versions;
    ``stale_policy`` drops or regenerates older ones. ``weight_update``: pools load new weights
    ``between_requests`` (in-flight requests finish on the old ones) or ``abort`` in-flight
    requests and resample them on the new ones. ``schedule``: ``async`` (replicas generate
    continuously in their own threads) or ``lockstep``: deterministic: each step, the trainer's
    thread generates the batch's groups itself, group i on replica ``i mod n`` (alive replicas,
    fleet order), every replica reseeded from (seed, step, replica), then trains on them in group
    order; a run, and a run resumed from any of its checkpoints, gives the same result for the same
    seed (embedded pools only; needs ``max_staleness: 0``)."""

    group_size: int = Field(4, ge=1)
    batch_groups: int = Field(8, ge=1)
    max_staleness: int = Field(1, ge=0)
    stale_policy: Literal["drop", "regenerate"] = "drop"
    weight_update: Literal["between_requests", "abort"] = "between_requests"
    max_new_tokens: int = Field(64, ge=1)
    sampling: SamplingParams = SamplingParams()
    schedule: Literal["async", "lockstep"] = "async"

    @model_validator(mode="after")
    def _lockstep(self) -> "AsyncSection":
        if self.schedule == "lockstep" and (self.max_staleness != 0 or self.weight_update != "between_requests"):
            raise ValueError("schedule 'lockstep' generates each batch on the current weights: it needs "
                             "max_staleness: 0 and weight_update: between_requests")
        return self


class SyntheticEnvironmentSection(_Strict):
    """``name: synthetic``: the synthetic coding suite; ``options``: :class:`SyntheticEnvOptions`
    (``suite``, ``eval``, ``coding``)."""

    name: Literal["synthetic"] = "synthetic"
    options: SyntheticEnvOptions = SyntheticEnvOptions()


class CodingEnvironmentSection(_Strict):
    """``name: coding``: the coding environment on task sets from files (HumanEval- or
    MBPP-format JSONL) or by name; ``options``: :class:`CodingEnvOptions` (``train``,
    ``heldout``, ``eval``, ``coding``)."""

    name: Literal["coding"]
    options: CodingEnvOptions


def _environment_name(data: Any) -> str | None:
    """The ``name`` tag of an environment section (``synthetic`` when omitted)."""
    return data.get("name", "synthetic") if isinstance(data, dict) else getattr(data, "name", None)


EnvironmentSection = Annotated[Union[Annotated[SyntheticEnvironmentSection, Tag("synthetic")],
                                     Annotated[CodingEnvironmentSection, Tag("coding")]],
                               Discriminator(_environment_name, custom_error_type="environment_name",
                                             custom_error_message="name must be 'synthetic' or 'coding'")]
"""The task environment: ``name`` (``synthetic`` | ``coding``, default ``synthetic``) and its
``options``, validated by the environment's own options model, so a mistyped option fails when the
config is loaded (and by ``--dry-run``)."""


class WandbSection(_Strict):
    """A Weights & Biases run of ``project`` (``entity``; ``name``, None: the run's name;
    ``tags``) logging every metric record and the resolved config: online when ``WANDB_API_KEY``
    is set, else offline under ``<output_dir>/wandb`` (the optional ``wandb`` extra)."""

    project: str = Field("hetrl", min_length=1)
    entity: str | None = None
    name: str | None = None
    tags: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _installed(self) -> "WandbSection":
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ValueError("wandb is not installed: pip install 'hetrl[wandb]', or remove logging.wandb")
        return self


class LoggingSection(_Strict):
    """Metrics every ``every`` steps to the console and to the run folder (``metrics.jsonl``
    and TensorBoard event files under ``tensorboard/``); with ``wandb`` set, also to a W&B run
    (:class:`WandbSection`)."""

    every: int = Field(1, ge=1)
    console: bool = True
    level: Literal["debug", "info", "warning", "error"] = "info"
    wandb: WandbSection | None = None


class RaySection(_Strict):
    """The Ray backend (``backend: ray``): ``address`` of a running cluster (None: start a
    private local instance with ``num_cpus`` CPUs, default all, its files under ``temp_dir``,
    default a fresh short directory in /tmp)."""

    address: str | None = None
    num_cpus: int | None = Field(None, ge=1)
    temp_dir: str | None = None


_CheckpointFields = create_model(
    "_CheckpointFields", __base__=_Strict,
    **{name: (info.annotation, info) for name, info in CheckpointConfig.model_fields.items() if name != "directory"},
)


class CheckpointingSection(_CheckpointFields):  # type: ignore[misc, valid-type]
    """Trainer checkpoints in the run folder's ``checkpoints/``: the fields of
    :class:`CheckpointConfig` but its ``directory`` (one every ``every`` steps, 0: only at the
    end; the newest ``keep`` retained, None: all; written in the background with
    ``async_save``, Orbax only). ``resume``: continue the run in ``output_dir`` from its
    newest checkpoint (with the rollout buffer's snapshot); without it a run refuses a folder
    that already holds one (:mod:`hetrl.orchestrator.run_folder`)."""

    resume: bool = False

    def checkpoint_config(self, directory: str) -> CheckpointConfig:
        """The trainers' :class:`CheckpointConfig` of this section, writing under ``directory``."""
        return CheckpointConfig(directory=directory, **self.model_dump(exclude={"resume"}))


class RunConfig(_Strict):
    """A whole run: ``steps`` trainer steps seeded by ``seed``, outputs under ``output_dir``,
    on the ``backend`` ``local`` (threads in one process) or ``ray`` (pool replicas and the
    trainer in Ray actors; settings in ``ray``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    name: str = Field("run", min_length=1)
    seed: int = Field(0, ge=0)
    steps: int = Field(100, ge=1)
    output_dir: str = "runs"
    backend: Literal["local", "ray"] = "local"
    model: ModelSection
    trainer: TrainerSection = JaxTrainerConfig()
    fleet: FleetConfig
    correction: CorrectionSection = CorrectionSection()
    async_: AsyncSection = Field(AsyncSection(), alias="async")
    environment: EnvironmentSection = SyntheticEnvironmentSection()
    logging: LoggingSection = LoggingSection()
    checkpointing: CheckpointingSection = CheckpointingSection()
    ray: RaySection = RaySection()

    @model_validator(mode="after")
    def _lockstep_pools(self) -> "RunConfig":
        if self.async_.schedule == "lockstep" and any(p.engine != "embedded" for p in self.fleet.pools):
            raise ValueError("async.schedule 'lockstep' reseeds every replica each step: embedded pools only "
                             "(a server's sampling is not reproducible from a seed)")
        return self

    @model_validator(mode="after")
    def _lockstep_autopilot(self) -> "RunConfig":
        if (self.async_.schedule == "lockstep" and self.fleet.routing == "autopilot"
                and self.fleet.cost_clock != "modelled"):
            raise ValueError("fleet.routing 'autopilot' under async.schedule 'lockstep' needs fleet.cost_clock "
                             "'modelled': the autopilot reads each pool's throughput from its busy time, which on "
                             "the wall clock differs run to run, and lockstep runs must repeat exactly")
        return self

    @model_validator(mode="after")
    def _server_supports_exact(self) -> "RunConfig":
        """Server pools that rebuild kept sets from a log-prob head: ``async.sampling`` must fit it."""
        from hetrl.samplers.head_support import HeadSupportError, check_head_params

        for pool in self.fleet.pools:
            if pool.engine != "embedded" and pool.server.resolved_sampling_mask(pool.engine) == "head":
                try:
                    check_head_params(self.async_.sampling, pool.server.top_logprobs_num,
                                      approximate=pool.server.support == "head_tail")
                except HeadSupportError as err:
                    raise ValueError(f"fleet.pools[{pool.name}] with async.sampling: {err}") from None
        return self

    def resolved(self) -> dict[str, Any]:
        """Plain data of the resolved config: every default filled in, the correction section
        with all thresholds of its preset + overrides (fields owned by another section left
        out), so that validating it again gives an equal config."""
        data = self.model_dump(mode="json", by_alias=True)
        data["correction"] = {"preset": self.correction.preset, **self.correction.resolve().model_dump(mode="json")}
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.resolved(), sort_keys=False, default_flow_style=None)


# ====================================================================== loading
def _check_unique_keys(node: yaml.Node | None, seen_nodes: set[int] | None = None) -> None:
    """Raise a YAML error at the second occurrence of a scalar key repeated in one map of the
    composed document ``node`` (plain YAML keeps the last value silently)."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if node is None or id(node) in seen_nodes:  # aliases share nodes (and may be recursive)
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_marks: dict[tuple[str, str], yaml.Mark] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                first = first_marks.setdefault((key.tag, key.value), key.start_mark)
                if first is not key.start_mark:
                    raise yaml.constructor.ConstructorError(
                        f"found the key {key.value!r}", first,
                        "and the same key again (a key may appear once per map)", key.start_mark)
            _check_unique_keys(key, seen_nodes)
            _check_unique_keys(value, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_unique_keys(item, seen_nodes)


def load_yaml(text: str) -> Any:
    """Parse YAML ``text`` safely, refusing a key repeated in one map (so ``steps: 5`` followed
    later by ``steps: 50`` is an error, not a quiet 50-step run)."""
    _check_unique_keys(yaml.compose(text, Loader=yaml.SafeLoader))
    return yaml.safe_load(text)


_KEY = r"[^.\[\]=\s]+"
_PATH = re.compile(rf"{_KEY}(?:\.{_KEY}|\[\d+\])*")
_TOKEN = re.compile(rf"({_KEY})|\[(\d+)\]")


def _parse_path(path: str) -> list[str | int]:
    """``a.b[0].c`` -> ``['a', 'b', 0, 'c']``; raises ConfigError on a malformed path."""
    if not _PATH.fullmatch(path):
        raise ConfigError(f"override key {path!r} is malformed (expected e.g. fleet.pools[0].replicas)")
    return [m.group(1) if m.group(1) is not None else int(m.group(2)) for m in _TOKEN.finditer(path)]


def _override_path(key: str) -> list[str | int]:
    """The parsed path an override sets: a mesh shorthand (``trainer.tensor_parallel``,
    :data:`hetrl.core.training.MESH_SHORTHANDS`) sets its ``trainer.mesh`` axis, so that it
    overrides the file's mesh like any other override."""
    parts = _parse_path(key.strip())
    if len(parts) == 2 and parts[0] == "trainer" and parts[1] in MESH_SHORTHANDS:
        return ["trainer", "mesh", MESH_SHORTHANDS[parts[1]]]
    return parts


def format_path(parts: Sequence[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply ``key=value`` to the raw config ``data`` in place. ``key`` is dotted with list
    indices (``fleet.pools[0].replicas``); missing maps on the way are created; an index must
    exist or equal the list's length (append). ``value`` is parsed as YAML."""
    key, sep, raw = override.partition("=")
    if not sep:
        raise ConfigError(f"override {override!r} must look like key=value")
    parts = _override_path(key)
    try:
        value = load_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {key}: value {raw!r} is not valid YAML: {err}") from None
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        where = format_path(parts[: i + 1])
        if isinstance(part, int):
            if not isinstance(node, list):
                raise ConfigError(f"override {where}: {format_path(parts[:i])} is not a list")
            if part > len(node):
                raise ConfigError(f"override {where}: index out of range (the list has {len(node)} items)")
            if part == len(node):
                node.append(value if last else ({} if isinstance(parts[i + 1], str) else []))
            elif last:
                node[part] = value
        else:
            if not isinstance(node, dict):
                raise ConfigError(f"override {where}: {format_path(parts[:i])} is not a map")
            if last:
                node[part] = value
            elif part not in node or node[part] is None:
                node[part] = {} if isinstance(parts[i + 1], str) else []
        if not last:
            node = node[part]


def _error_parts(loc: Sequence[str | int], raw: Any) -> list[str | int]:
    """The key path of a pydantic error location, walking the raw data so that the union tag
    pydantic inserts (``trainer.jax.mesh`` for ``trainer: {kind: jax, mesh: ...}``, or
    ``environment.synthetic.options`` for an environment whose ``name`` is omitted) is dropped."""
    parts: list[str | int] = []
    node = raw
    for i, p in enumerate(loc):
        if isinstance(node, dict) and isinstance(p, str) and p not in node:
            following = loc[i + 1] if i + 1 < len(loc) else None
            if p in (node.get("kind"), node.get("name")) or (isinstance(following, str) and following in node):
                continue
        parts.append(p)
        if isinstance(node, dict):
            node = node.get(p)
        elif isinstance(node, list) and isinstance(p, int) and p < len(node):
            node = node[p]
        else:
            node = None
    return parts


def _members(tp: Any) -> list[Any]:
    """The types ``tp`` may be: ``Annotated`` unwrapped, a union split, None dropped."""
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if get_origin(tp) in (Union, types.UnionType):
        return [m for arg in get_args(tp) for m in _members(arg) if m is not type(None)]
    return [tp]


def _step(tp: Any, part: str | int) -> Any:
    """The type at ``part`` (a field, alias, union tag or index) inside ``tp``, or None."""
    for member in _members(tp):
        if isinstance(member, type) and issubclass(member, BaseModel):
            for name, info in member.model_fields.items():
                if part in (name, info.alias):
                    return info.annotation
            for tag in ("kind", "name"):  # a discriminated union's tag: pydantic's location names it
                info = member.model_fields.get(tag)
                if info is not None and get_origin(info.annotation) is Literal and get_args(info.annotation) == (part,):
                    return member
        elif isinstance(part, int) and get_origin(member) in (list, tuple):
            return get_args(member)[0]
        elif isinstance(part, str) and get_origin(member) is dict:
            return get_args(member)[1]
    return None


REMOVED_OUTPUT_KEYS = {("logging", "jsonl_path"): "metrics.jsonl", ("logging", "tensorboard_dir"): "tensorboard/",
                       ("checkpointing", "directory"): "checkpoints/"}
"""Output paths a config once set, now fixed inside the run folder (refused naming ``output_dir``)."""


def _other_trainer_with(loc: Sequence[str | int]) -> str | None:
    """The kind of the other trainer whose config has the key at pydantic location ``loc``
    (``('trainer', kind, ...)``, a key the ``kind`` trainer lacks), else None."""
    if len(loc) < 3 or loc[0] != "trainer":
        return None
    for other in _members(TrainerSection):
        kind = get_args(other.model_fields["kind"].annotation)[0]
        if kind != loc[1]:
            tp: Any = other
            for part in loc[2:]:
                tp = _step(tp, part) if tp is not None else None
            if tp is not None:
                return kind
    return None


def _unknown_key_message(loc: Sequence[str | int]) -> str:
    """``unknown key 'x'`` with the nearest field name of the model at ``loc`` (did you mean);
    for a key of :data:`REMOVED_OUTPUT_KEYS`, where that output lives now."""
    key = loc[-1]
    other = _other_trainer_with(loc)
    if other is not None:
        return (f"{key!r} is a setting of the {other!r} trainer only: the {loc[1]!r} trainer cannot honour it; "
                f"remove it (or set trainer.kind: {other})")
    if tuple(loc) in REMOVED_OUTPUT_KEYS:
        return (f"every output of a run lives under output_dir (this one is <output_dir>/"
                f"{REMOVED_OUTPUT_KEYS[tuple(loc)]}): remove {key!r} and set output_dir instead")
    tp: Any = RunConfig
    for part in loc[:-1]:
        tp = _step(tp, part) if tp is not None else None
    names = [n for m in _members(tp) if isinstance(m, type) and issubclass(m, BaseModel)
             for name, info in m.model_fields.items() for n in (info.alias or name,)]
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    return f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else
                                     (f" (known keys: {', '.join(sorted(set(names)))})" if names else ""))


def _error_message(error: Mapping[str, Any]) -> str:
    """One pydantic error's message: an unknown key with its did-you-mean; a validator's own
    message without pydantic's ``Value error,`` prefix."""
    if error["type"] == "extra_forbidden":
        return _unknown_key_message(error["loc"])
    if error["type"] == "value_error" and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    return error["msg"]


def _is_prefix(a: Sequence[str | int], b: Sequence[str | int]) -> bool:
    return len(a) <= len(b) and list(b[: len(a)]) == list(a)


def _error_line(error: Mapping[str, Any], raw: Any, overrides: Sequence[str]) -> str:
    """``key: message``, or ``--set OVERRIDE: [key: ]message`` when the latest override that
    set this key (or a section above it, or a key below it) caused it."""
    parts, message = _error_parts(error["loc"], raw), _error_message(error)
    key = format_path(parts)
    if parts:
        for override in reversed(overrides):
            target = _override_path(override.partition("=")[0])
            if _is_prefix(target, parts) or _is_prefix(parts, target):
                return f"--set {override}: {message}" if len(target) >= len(parts) else f"--set {override}: {key}: {message}"
    return f"{key}: {message}" if key else message


def validate_config(data: Any, source: str = "<config>", overrides: Sequence[str] = ()) -> RunConfig:
    """Validate raw config data; raise :class:`ConfigError` naming every bad key (and the
    ``--set`` override among ``overrides`` that caused an error, instead of the file)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a map, got {type(data).__name__}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        lines = list(dict.fromkeys(_error_line(e, data, overrides) for e in err.errors()))
        if all(line.startswith("--set ") for line in lines):  # the command line's fault, not the file's
            raise ConfigError("\n".join(lines) if len(lines) > 1 else lines[0]) from None
        raise ConfigError(f"{source}: invalid config:\n  " + "\n  ".join(lines)) from None


def resolve_config_path(name: str | pathlib.Path) -> pathlib.Path:
    """``name`` if it exists, else ``configs/<name>`` (``.yaml`` optional) in the repository."""
    path = pathlib.Path(name)
    if path.exists():
        return path
    for candidate in (CONFIG_DIR / path.name, CONFIG_DIR / f"{path.name}.yaml"):
        if path.parent == pathlib.Path(".") and candidate.exists():
            return candidate
    raise ConfigError(f"config file {str(name)!r} not found (nor in {CONFIG_DIR})")


PATH_KEYS = (("output_dir",), ("model", "path"), ("model", "cache_dir"), ("ray", "temp_dir"))
"""The settings that are file-system paths (resolved against the config file's directory)."""


def resolve_file_paths(data: dict[str, Any], base: pathlib.Path) -> None:
    """Make the relative paths of :data:`PATH_KEYS` in the raw config ``data`` (read from a file
    in ``base``) absolute, in place; absolute paths, URLs (``scheme://``) and non-strings stay."""
    for keys in PATH_KEYS:
        node: Any = data
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        value = node.get(keys[-1]) if isinstance(node, dict) else None
        if isinstance(value, str) and value and "://" not in value and not pathlib.Path(value).expanduser().is_absolute():
            node[keys[-1]] = str((base / value).resolve())


def load_config(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Read the YAML config at ``path`` (see :func:`resolve_config_path`), make its relative
    paths relative to the file's directory (:func:`resolve_file_paths`), apply ``overrides`` in
    order (their paths stay relative to the working directory), validate. An unreadable file,
    malformed YAML or a key repeated in one map raises :class:`ConfigError` naming the file
    (and the line, for YAML errors)."""
    file = resolve_config_path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{file}: cannot read the config: {err}") from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{file}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the config must be a map, got {type(data).__name__}")
    resolve_file_paths(data, file.resolve().parent)
    for o in overrides:
        apply_override(data, o)
    return validate_config(data, str(file), overrides)
